"""What every provider adapter shares.

- :class:`Retention`: how long the provider keeps what a lookup reads (its idempotency
  records, a message history), judged by the key's first send (``ctx.first_sent_at``,
  as the journal's events record it) against the database's clock (``ctx.now()``).
  :meth:`Retention.not_found` is what a lookup returns when it found nothing: ``None``
  (the key did not take effect, send it again) within the window,
  :class:`~runledger.Unknowable` past it.
- :func:`landing_wait` / :func:`await_landing`: a request the client gave up on may still
  reach the provider. A lookup waits until the last send (``ctx.sent_at``) is older than
  the provider's own bound on it before it says "not found": the worker takes that for
  certain (after the last attempt the call fails as never applied).

Every age here is a database timestamp against the database's clock as the worker
measures it (:meth:`ToolContext.now`), never against this host's clock: a host whose
clock is minutes off judges them right (docs/concepts.md).
- :func:`retry_after`: seconds a 429 or 503 asks the client to wait.
- :func:`marker`: the key as a hidden marker in a body a lookup can search.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runledger.flows import ToolContext, Unknowable

__all__ = [
    "KEY_FIELD",
    "Retention",
    "await_landing",
    "landing_wait",
    "marker",
    "retry_after",
    "wait_landing",
]

# the name under which adapters store the key in a provider's metadata
KEY_FIELD = "runledger_key"


def _age(ctx: ToolContext, now: dt.datetime | None = None) -> dt.timedelta | None:
    if ctx.first_sent_at is None:
        return None
    return (now or ctx.now()) - ctx.first_sent_at


@dataclass(frozen=True, slots=True)
class Retention:
    """How long the provider keeps what the lookup reads.

    ``margin`` is taken off the window: the key's first send is known by the database's
    clock (or, for a key dispatched before runledger 0.2, by its last dispatch), the
    provider's own clock may differ, and a failover's doubted call counts from when the
    failover was seen, after the send it doubts.
    """

    window: dt.timedelta
    margin: dt.timedelta = dt.timedelta(minutes=10)
    name: str = "the provider"

    def __post_init__(self) -> None:
        if self.window <= dt.timedelta(0) or self.margin < dt.timedelta(0):
            raise ValueError("a retention window must be positive and its margin not negative")

    def expired(self, ctx: ToolContext, now: dt.datetime | None = None) -> bool:
        """Whether the key may be past the window: its first send is older than the
        window less the margin, or unknown (conservative)."""
        age = _age(ctx, now)
        return age is None or age >= self.window - self.margin

    def not_found(self, ctx: ToolContext, **facts: Any) -> None:
        """A lookup that found nothing: ``None`` within the window; past it, raises
        :class:`~runledger.Unknowable` (what was asked goes in ``facts``)."""
        if not self.expired(ctx):
            return None
        age = _age(ctx)
        told = "unknown" if age is None else f"{age.total_seconds() / 3600:.1f} h"
        raise Unknowable(
            f"nothing found for key {ctx.idempotency_key}, but the key is {told} old and "
            f"{self.name} keeps what the lookup reads for {_span(self.window)}: it may "
            "have taken effect and been forgotten",
            key_age_hours=None if age is None else round(age.total_seconds() / 3600, 3),
            window_hours=round(self.window.total_seconds() / 3600, 3),
            **facts,
        )


def _span(d: dt.timedelta) -> str:
    hours = d.total_seconds() / 3600
    if hours >= 48 and hours % 24 == 0:
        return f"{int(hours // 24)} days"
    return f"{hours:g} hours"


def landing_wait(ctx: ToolContext, bound: float, now: dt.datetime | None = None) -> float:
    """Seconds until a request sent at ``ctx.sent_at`` can no longer land at the provider,
    given ``bound``: the longest the provider takes to act on a request it received (its
    own request timeout). 0 when that time is past or nothing was sent. Judged by the
    database's clock (``ctx.now()``), as ``sent_at`` is."""
    if ctx.sent_at is None:
        return 0.0
    left = (ctx.sent_at + dt.timedelta(seconds=bound) - (now or ctx.now())).total_seconds()
    return max(0.0, left)


LEASE_SPARE = 1.0  # seconds of lease a landing wait leaves unslept, for the answer


def _next_nap(ctx: ToolContext, bound: float) -> float:
    """How long to sleep now before the last send can no longer land: at most what the
    lease allows (renewals move it on while the wait goes on); raises ``TimeoutError``
    (the lookup failed: asked again later) when the lease is about to end."""
    wait = landing_wait(ctx, bound)
    if wait <= 0:
        return 0.0
    room = ctx.remaining() - LEASE_SPARE
    if room <= 0:
        raise TimeoutError(
            f"the last send of {ctx.idempotency_key} may still land for {wait:.1f} s, "
            "and the lease is about to end: asking again later"
        )
    return min(wait, room)


def wait_landing(ctx: ToolContext, bound: float) -> None:
    """Block (a plain ``def`` lookup) until the last send can no longer land: a lookup
    that found nothing before then proves nothing (the request may still be on its way).
    The worker renews the lease meanwhile."""
    waited = 0.0
    while (nap := _next_nap(ctx, bound)) > 0:
        time.sleep(nap)
        waited += nap
    if waited:
        ctx.observe(waited_for_landing_s=round(waited, 3))


async def await_landing(ctx: ToolContext, bound: float) -> None:
    """:func:`wait_landing` for an ``async def`` lookup."""
    waited = 0.0
    while (nap := _next_nap(ctx, bound)) > 0:
        await asyncio.sleep(nap)
        waited += nap
    if waited:
        ctx.observe(waited_for_landing_s=round(waited, 3))


def retry_after(headers: Mapping[str, str], default: float = 1.0, cap: float = 60.0) -> float:
    """The seconds a ``Retry-After`` header asks for (a number of seconds or an HTTP
    date), within ``[0, cap]``; ``default`` when it is missing or unreadable."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return default
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        # the provider's clock (its HTTP date) against this host's: neither is the database's
        seconds = (when - dt.datetime.now(dt.UTC)).total_seconds()
    if not math.isfinite(seconds):
        return default
    return min(max(seconds, 0.0), cap)


def marker(key: str) -> str:
    """The key as a hidden marker for a body (Markdown and HTML ignore the comment)."""
    return f"<!-- {KEY_FIELD}:{key} -->"

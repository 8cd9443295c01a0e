"""What one holder learns about a call while it settles it, kept for the person who
decides the call if it becomes ``unknown``.

Each send that did not return and each lookup that found nothing is a step (a call
whose tool returned, or whose lookup found it, is never unknown): when it started (UTC,
by the database's clock as the worker measures it: :mod:`runledger.clock`),
how long it took, how it ended, and what the tool or the lookup observed
(``ToolContext.observe``: what was asked, what the provider answered, its request id).
An earlier sender that was waited for is a step too, and so is each claim of the run
without progress, when the crash-loop guard gives the call up (:meth:`Trail.journaled`).
The steps go into the call's ``error`` under ``evidence`` when it is marked ``unknown``
(or, by the crash-loop guard, found without effect); nothing is written otherwise.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import dataclass, field
from typing import Any

from runledger.clock import DatabaseClock, wall_now
from runledger.worker.runs import jsonable

__all__ = ["MAX_FACTS", "MAX_STEPS", "Trail"]

MAX_STEPS = 20  # the last ones are kept
MAX_FACTS = 10  # facts observed per step
MAX_FACT_CHARS = 2000  # a fact longer than this, as JSON, is cut to it


def _fact(facts: dict[str, Any]) -> dict[str, Any]:
    value = jsonable(facts)
    text = json.dumps(value, sort_keys=True)
    if len(text) <= MAX_FACT_CHARS:
        return value  # type: ignore[no-any-return]
    return {"truncated": text[:MAX_FACT_CHARS]}


@dataclass(slots=True)
class Trail:
    """One call's sends and lookups by this holder, and the key's send times."""

    first_sent: dt.datetime | None = None  # the key's first dispatch, by anyone
    sent: dt.datetime | None = None  # the current attempt's dispatch
    # whether first_sent is known: the key was never sent before this holder, or the
    # journal was read for it
    first_known: bool = False
    steps: list[dict[str, Any]] = field(default_factory=list)
    # the database's clock as the worker measures it: the send times above are compared
    # with the journal's, and the steps' times are shown beside the events'; None: this
    # host's clock (a trail built without a worker)
    clock: DatabaseClock | None = field(default=None, repr=False)

    def _now(self) -> dt.datetime:
        return wall_now() if self.clock is None else self.clock.now()

    def dispatched(self) -> None:
        """This holder dispatched the call: the key is sent now (its dispatch has just
        committed), stamped with the latest the database's clock can be (a lookup
        compares with the earliest: its landing wait never ends early)."""
        now = wall_now() if self.clock is None else self.clock.latest()
        if self.first_sent is None:
            self.first_sent = now
        self.first_known = True
        self.sent = now

    def add(
        self,
        step: str,
        started: float,
        observed: list[dict[str, Any]] | None = None,
        **detail: Any,
    ) -> None:
        """A step that began at ``started`` (``time.monotonic()``) and ends now."""
        took = time.monotonic() - started
        at = self._now() - dt.timedelta(seconds=took)
        entry: dict[str, Any] = {
            "step": step,
            "at": at.isoformat(timespec="milliseconds"),
            "ms": round(took * 1000),
        }
        entry.update(jsonable({k: v for k, v in detail.items() if v is not None}))
        if observed:
            entry["observed"] = [_fact(f) for f in observed[-MAX_FACTS:]]
        self.steps.append(entry)
        del self.steps[:-MAX_STEPS]

    def journaled(
        self,
        step: str,
        at: dt.datetime,
        observed: list[dict[str, Any]] | None = None,
        **detail: Any,
    ) -> None:
        """A step the run's journal tells of, not one this holder took: it happened at
        ``at`` (the database's clock), as an earlier holder's claim of the run."""
        entry: dict[str, Any] = {
            "step": step,
            "at": at.astimezone(dt.UTC).isoformat(timespec="milliseconds"),
        }
        entry.update(jsonable({k: v for k, v in detail.items() if v is not None}))
        if observed:
            entry["observed"] = [_fact(f) for f in observed[-MAX_FACTS:]]
        self.steps.append(entry)
        del self.steps[:-MAX_STEPS]

    def attach(self, error: dict[str, Any]) -> dict[str, Any]:
        """``error`` with the steps, for ``complete_call(..., 'unknown')``."""
        if not self.steps:
            return error
        return {**error, "evidence": list(self.steps)}

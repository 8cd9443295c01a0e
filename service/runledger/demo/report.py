"""The demo's audit: the journal against the provider's own record of what happened.

It holds when no idempotency key took effect twice at the provider, every succeeded call
has its effect there, every run succeeded or paused (and every paused run waits on
an ``unknown`` call), and every check of ``runledger audit`` passes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from runledger.db.batch import read_batch
from runledger.demo import SAFETY


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolLine:
    tool: str
    calls: int
    sends: int
    effects: int
    duplicated: int
    looked_up: int  # found by the lookup after a crash (not sent again)
    unknown: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Unknown:
    run_id: str
    key: str
    tool: str
    to: str
    effects: int  # the provider's effects under the key: what a person would check

    def resolution(self, resend: bool = True) -> str:
        """What the provider's record says: ``applied``, else ``not_applied`` (sent again
        under the same key), or ``abandoned`` where nothing could send it again (the
        demo's provider is gone)."""
        if self.effects:
            return "applied"
        return "not_applied" if resend else "abandoned"

    def command(self, resend: bool = True) -> str:
        return f"runledger resolve {self.key} {self.resolution(resend)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Audit:
    runs: int
    statuses: dict[str, int]
    takeovers: int
    tools: list[ToolLine]
    missing: list[str]  # succeeded calls without an effect at the provider
    duplicated: list[str]  # keys that took effect more than once
    unknown: list[Unknown]
    paused_without_unknown: list[str]
    failed: dict[str, Any]
    broken_checks: list[str]
    sample: tuple[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.missing
            or self.duplicated
            or self.paused_without_unknown
            or self.broken_checks
            or set(self.statuses) - {"succeeded", "paused"}
            or sum(self.statuses.values()) != self.runs
        )


def audit(url: str, prefix: str, runs: int, effects: Sequence[dict[str, Any]]) -> Audit:
    """The demo's runs (ids ``{prefix}-*``) against ``effects``, the provider's record."""
    from runledger.audit import run_checks

    per_key = Counter(str(e["key"]) for e in effects if str(e["key"]).startswith(prefix + "-"))
    with psycopg.connect(url, autocommit=True) as conn:
        batch = read_batch(conn, prefix)
    calls = batch.calls
    tools = []
    for tool in SAFETY:
        mine = [c for c in calls if c.tool == tool]
        keys = [str(c.idempotency_key) for c in mine]
        tools.append(
            ToolLine(
                tool=tool,
                calls=len(mine),
                sends=sum(int(c.attempts) for c in mine),
                effects=sum(per_key[k] for k in keys),
                duplicated=sum(per_key[k] > 1 for k in keys),
                looked_up=sum(bool(c.has_receipt) for c in mine),
                unknown=sum(c.status == "unknown" for c in mine),
            )
        )
    unknown = [
        Unknown(
            run_id=str(c.run_id),
            key=str(c.idempotency_key),
            tool=str(c.tool),
            to=str((c.args or {}).get("to", "")),
            effects=per_key[str(c.idempotency_key)],
        )
        for c in calls
        if c.status == "unknown"
    ]
    with_unknown = {u.run_id for u in unknown}
    return Audit(
        runs=runs,
        statuses=batch.statuses,
        takeovers=batch.takeovers,
        tools=tools,
        missing=[
            str(c.idempotency_key)
            for c in calls
            if c.status == "succeeded" and not per_key[str(c.idempotency_key)]
        ],
        duplicated=sorted(k for k, n in per_key.items() if n > 1),
        unknown=unknown,
        paused_without_unknown=[r for r in batch.paused if r not in with_unknown],
        failed=batch.failed,
        broken_checks=[f.check.name for f in run_checks(url) if not f.ok],
        sample=batch.sample,
    )


def print_audit(a: Audit, elapsed: float, kills: int, say: Callable[[str], None]) -> None:
    order = ("succeeded", "paused", "failed", "cancelled", "running", "queued")
    counts = ", ".join(f"{a.statuses[s]} {s}" for s in order if a.statuses.get(s))
    say(f"\n{a.runs} runs in {elapsed:.1f} s: {counts or 'none'}")
    say(f"{kills} SIGKILLs mid-call; {a.takeovers} runs taken over by another worker")
    say(f"  {'tool':<15}{'safety':<12}{'calls':>5}{'sends':>7}{'effects':>9}{'twice':>7}")
    for t in a.tools:
        say(
            f"  {t.tool:<15}{SAFETY[t.tool]:<12}{t.calls:>5}{t.sends:>7}{t.effects:>9}"
            f"{t.duplicated:>7}  {_note(t)}"
        )
    say(f"succeeded calls without their effect at the provider: {len(a.missing)}")
    say(f"invariant checks (runledger audit): {', '.join(a.broken_checks) or 'all ok'}")
    for run_id, error in a.failed.items():
        say(f"  not succeeded or paused: {run_id} {error}")
    for run_id in a.paused_without_unknown:
        say(f"  paused without an unknown call: {run_id}")
    say("audit: OK" if a.ok else "audit: FAILED")
    if a.sample:
        say(f"\nthe agent's answer ({a.sample[0]}): {a.sample[1]}")


def _note(t: ToolLine) -> str:
    if t.duplicated:
        return f"{t.duplicated} key(s) took effect twice"
    if t.tool == "create_ticket":
        again = t.sends - t.calls
        return f"{again} sent again after a crash, deduplicated by key" if again else ""
    if t.tool == "charge":
        return f"{t.looked_up} found by lookup after a crash, not sent again" if t.looked_up else ""
    return f"{t.unknown} unknown: paused for a person" if t.unknown else ""


def print_paused(
    unknown: Sequence[Unknown], say: Callable[[str], None], *, resend: bool = True
) -> None:
    """The paused runs and the command that settles each. ``resend``: a call resolved
    ``not_applied`` can be sent again (the demo's provider runs on, or the advice is for a
    ``--keep`` run); without it, ``not_applied`` is not offered: the run would only pause
    again, its tool unable to reach the provider."""
    if not unknown:
        return
    runs = len({u.run_id for u in unknown})
    plural = "s" if runs > 1 else ""
    if all(u.tool == "send_email" for u in unknown):
        say(
            f"\n{runs} run{plural} paused on an email a worker was sending when it died: "
            "runledger\nnever sends an unsafe call twice by itself. Check the provider, then "
            "tell runledger:"
        )
    else:
        say(
            f"\n{runs} run{plural} paused on calls nobody knows the outcome of. Check the provider:"
        )
    for u in unknown:
        what = f"the email to {u.to}" if u.tool == "send_email" else f"the {u.tool} call"
        seen = f"the provider has {what}" if u.effects else f"the provider never got {what}"
        say(f"  {u.run_id}: {seen}, so")
        say(f"    {u.command(resend)}")
    if resend:
        say("  (or not_applied: send it again under the same key; abandoned: give up on it)")
    else:
        say(
            "  (or abandoned: give up on it, effect or not. Not not_applied: sending it again "
            "needs the demo's provider, which stopped with the demo)"
        )

"""The seed's crash windows for every safety class: one table, two tests.

``tests/process/test_crash_windows.py`` SIGKILLs a real worker at each named crash
point and lets a second worker recover; ``tests/unit/test_recovery.py`` drives
:func:`runledger.worker.recovery.next_step` through the same rows with no database.

A row: the first worker dies at ``point`` inside the first call of the run (a call of
``tool`` of the ``scripted`` demo flow); then the next worker does ``steps`` with that
call, which ends ``call_status`` with ``attempts`` dispatches in the journal and
``effects`` effects at the provider for its key, and the run ends ``run_status``
(before any reconciliation by a person).
"""

from __future__ import annotations

from dataclasses import dataclass

from runledger.model import Outcome, Safety
from runledger.worker.recovery import (
    Complete,
    Dispatch,
    Lookup,
    MarkUnknown,
    Reuse,
    Step,
)

# the scripted flow's tools, one of every safety class
TOOLS: dict[str, Safety] = {
    "ticket": Safety.IDEMPOTENT,  # the provider deduplicates the key
    "charge": Safety.LOOKUP,  # the provider does not deduplicate, but can be asked
    "email": Safety.UNSAFE,  # neither: every send is another e-mail
    "read": Safety.READ_ONLY,  # no effect at the provider
}

POINTS = ("before_dispatch", "after_dispatch", "after_effect", "after_complete")

UNSAFE_IN_FLIGHT = MarkUnknown(
    {"reason": "in flight when its worker stopped; unsafe to repeat", "attempts": 1}
)
SUCCEED = Complete(Outcome.SUCCEEDED)


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    point: str
    tool: str
    steps: tuple[Step, ...]
    call_status: str
    attempts: int
    effects: int
    run_status: str

    @property
    def id(self) -> str:
        return f"{self.point}-{self.tool}"

    @property
    def safety(self) -> Safety:
        return TOOLS[self.tool]

    @property
    def resends(self) -> int:
        """How often the next worker dispatches the call again (same key)."""
        return sum(isinstance(s, Dispatch) for s in self.steps)

    @property
    def found_by_lookup(self) -> bool:
        """The receipt is the lookup's answer: asked, and completed without a send."""
        return any(isinstance(s, Lookup) for s in self.steps) and not self.resends


def _row(point: str, tool: str, steps: tuple[Step, ...], attempts: int, effects: int) -> Row:
    paused = any(isinstance(s, MarkUnknown) for s in steps)
    return Row(
        point=point,
        tool=tool,
        steps=steps,
        call_status="unknown" if paused else "succeeded",
        attempts=attempts,
        effects=effects,
        run_status="paused" if paused else "succeeded",
    )


ROWS: tuple[Row, ...] = (
    # before sending: the effect was not requested -> send it with the persisted key
    _row("before_dispatch", "ticket", (Dispatch(), SUCCEED), 1, 1),
    _row("before_dispatch", "charge", (Dispatch(), SUCCEED), 1, 1),
    _row("before_dispatch", "email", (Dispatch(), SUCCEED), 1, 1),
    _row("before_dispatch", "read", (Dispatch(), SUCCEED), 1, 0),
    # sent, the tool never ran: idempotent repeats, lookup finds nothing and repeats,
    # read_only reruns, unsafe cannot know -> unknown and the run pauses
    _row("after_dispatch", "ticket", (Dispatch(), SUCCEED), 2, 1),
    _row("after_dispatch", "charge", (Lookup(), Dispatch(), SUCCEED), 2, 1),
    _row("after_dispatch", "email", (UNSAFE_IN_FLIGHT,), 1, 0),
    _row("after_dispatch", "read", (Dispatch(), SUCCEED), 2, 0),
    # the effect exists, the journal does not know: same key (the provider dedups), the
    # lookup finds it (no second send), unsafe pauses, read_only reruns
    _row("after_effect", "ticket", (Dispatch(), SUCCEED), 2, 1),
    _row("after_effect", "charge", (Lookup(), SUCCEED), 1, 1),
    _row("after_effect", "email", (UNSAFE_IN_FLIGHT,), 1, 1),
    _row("after_effect", "read", (Dispatch(), SUCCEED), 2, 0),
    # the receipt is saved: reuse it, never call again
    _row("after_complete", "ticket", (Reuse(),), 1, 1),
    _row("after_complete", "charge", (Reuse(),), 1, 1),
    _row("after_complete", "email", (Reuse(),), 1, 1),
    _row("after_complete", "read", (Reuse(),), 1, 0),
)

assert {(r.point, r.tool) for r in ROWS} == {(p, t) for p in POINTS for t in TOOLS}

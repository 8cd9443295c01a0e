"""Crash points for tests: the worker SIGKILLs itself at a named point.

TEST ONLY: ``RUNLEDGER_CRASH_AT`` is honoured only when ``RUNLEDGER_TESTING=1`` is set
too (the test harness's worker pool sets it); without it the worker ignores crash
points and logs one warning at startup. ``RUNLEDGER_CRASH_AT`` holds comma-separated
specs ``point[:tool[:n]]``:
kill at ``point`` (``before_dispatch``, ``after_dispatch``, ``after_effect`` -- the
tool returned, before ``complete_call`` -- or ``after_complete``), optionally only for
``tool`` and only at its ``n``-th occurrence in this process (default: the first).
``load_journal`` kills while loading a run's journal; its second part is the run id
(``load_journal:my-run``), which then must not contain ``:``.
``after_decide`` kills when the policy (the model) has answered and nothing of its
decision is journaled; ``after_record_turn`` right after the decision committed
(``record_turn``; for the final decision, which otherwise ends the run in the same
commit, the worker armed with this point records it first and finishes the run after).

The fast path fuses writes; the points keep their meaning on it. A call's result and
the next call's dispatch are one commit (``complete_and_dispatch``): ``before_dispatch`` of
that next call kills before it (the previous call's result is not committed either),
``after_complete`` of the previous call and ``after_dispatch`` of the next kill after it.
Their second part is the turn number (``after_decide:0``: the first decision;
``after_record_turn:2:1``: the first time turn 2 is recorded in this process).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

POINTS = (
    "before_dispatch",
    "after_dispatch",
    "after_effect",
    "after_complete",
    "load_journal",
    "after_decide",
    "after_record_turn",
)
ENV = "RUNLEDGER_CRASH_AT"
TESTING_ENV = "RUNLEDGER_TESTING"


@dataclass(slots=True)
class _Spec:
    point: str
    tool: str | None
    nth: int
    seen: int = 0


class CrashPoints:
    def __init__(self, spec: str | None) -> None:
        self.specs: list[_Spec] = []
        for part in (spec or "").split(","):
            part = part.strip()
            if not part:
                continue
            point, _, rest = part.partition(":")
            tool, _, nth = rest.partition(":")
            if point not in POINTS:
                raise ValueError(f"{ENV}: unknown crash point {point!r}; expected one of {POINTS}")
            self.specs.append(_Spec(point=point, tool=tool or None, nth=int(nth or 1)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CrashPoints:
        """The crash points of ``RUNLEDGER_CRASH_AT``, if ``RUNLEDGER_TESTING=1``; else none."""
        env = os.environ if environ is None else environ
        spec = env.get(ENV, "").strip()
        if spec and env.get(TESTING_ENV) != "1":
            log.warning("%s is set but %s=1 is not: crash points are ignored", ENV, TESTING_ENV)
            return cls(None)
        return cls(spec or None)

    @property
    def armed(self) -> bool:
        return bool(self.specs)

    def wants(self, point: str, tool: str) -> bool:
        """Whether a spec names this point (and this tool, turn or run id, or none): the
        worker then keeps open the moment that a fused write would close (the final
        decision recorded, the run not finished yet), so the point still kills there."""
        return any(s.point == point and s.tool in (None, tool) for s in self.specs)

    def hit(self, point: str, tool: str) -> None:
        """``tool`` is the tool's name, the run id for ``load_journal``, the turn number
        for ``after_decide`` and ``after_record_turn``."""
        if not self.specs:
            return
        for spec in self.specs:
            if spec.point != point or (spec.tool is not None and spec.tool != tool):
                continue
            spec.seen += 1
            if spec.seen == spec.nth:
                os.kill(os.getpid(), signal.SIGKILL)

"""Crash points for tests: the worker SIGKILLs itself at a named point.

TEST ONLY. ``RUNLEDGER_CRASH_AT`` holds comma-separated specs ``point[:tool[:n]]``:
kill at ``point`` (``before_dispatch``, ``after_dispatch``, ``after_effect`` -- the
tool returned, before ``complete_call`` -- or ``after_complete``), optionally only for
``tool`` and only at its ``n``-th occurrence in this process (default: the first).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

POINTS = ("before_dispatch", "after_dispatch", "after_effect", "after_complete")
ENV = "RUNLEDGER_CRASH_AT"


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
    def from_env(cls) -> CrashPoints:
        return cls(os.environ.get(ENV))

    def hit(self, point: str, tool: str) -> None:
        for spec in self.specs:
            if spec.point != point or (spec.tool is not None and spec.tool != tool):
                continue
            spec.seen += 1
            if spec.seen == spec.nth:
                os.kill(os.getpid(), signal.SIGKILL)

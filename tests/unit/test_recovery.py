"""The crash-window table as a pure function, without a database.

The rows of ``tests/crash_windows.py`` (the ones the process test SIGKILLs real
workers for) are driven through :func:`next_step` against a model of the journal and
the provider; then the ambiguous-failure, retry and exhausted paths, row by row; then
every sequence of tool and lookup answers up to a length, against the guarantees.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from runledger.model import Approval, CallStatus, Outcome, Safety
from runledger.worker.recovery import (
    AwaitApproval,
    AwaitSender,
    Complete,
    Dispatch,
    Known,
    LookedUp,
    Lookup,
    MarkUnknown,
    Pause,
    Reuse,
    Step,
    ToolMissing,
    Window,
    next_step,
    window_of,
)
from tests.crash_windows import ROWS, Row

MAX_ATTEMPTS = 3  # the scripted flow's tools keep the default


# -- the crash windows, the same rows as the process test -------------------------------


@dataclass
class World:
    """The journal's view of the call and the provider's effects for its key."""

    status: CallStatus
    attempts: int
    effects: int

    def send(self, tool: str) -> None:
        """``dispatch_call`` then the tool, which returns (it is not the one that crashes)."""
        self.attempts += 1
        if tool == "ticket":  # the provider deduplicates the key
            self.effects = max(self.effects, 1)
        elif tool in ("charge", "email"):  # every request is another effect
            self.effects += 1


def after_crash(point: str, tool: str) -> World:
    """What the first worker left behind when it died at ``point`` inside ``tool``."""
    effect = 0 if tool == "read" else 1
    return {
        "before_dispatch": World(CallStatus.PLANNED, 0, 0),
        "after_dispatch": World(CallStatus.DISPATCHED, 1, 0),
        "after_effect": World(CallStatus.DISPATCHED, 1, effect),
        "after_complete": World(CallStatus.SUCCEEDED, 1, effect),
    }[point]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_crash_window(row: Row) -> None:
    world = after_crash(row.point, row.tool)
    known = Known(
        window=window_of(world.status),
        safety=row.safety,
        tool=row.tool,
        max_attempts=MAX_ATTEMPTS,
        attempts=world.attempts,
        # the first worker was killed: the next one found its process gone
        sender_ended="process_gone",
    )
    steps: list[Step] = []
    while len(steps) < 10:
        step = next_step(known)
        steps.append(step)
        match step:
            case Dispatch():
                world.send(row.tool)
                known = dataclasses.replace(
                    known,
                    window=Window.RETURNED,
                    tries=known.tries + 1,
                    looked_up=LookedUp.NOT_ASKED,
                )
            case Lookup():
                answer = LookedUp.FOUND if world.effects else LookedUp.NOT_FOUND
                known = dataclasses.replace(known, looked_up=answer)
            case Complete(outcome=outcome):
                world.status = CallStatus(outcome)
                break
            case MarkUnknown():
                world.status = CallStatus.UNKNOWN
                break
            case Reuse():
                break
            case _:
                pytest.fail(f"unexpected step {step}")
    assert tuple(steps) == row.steps
    assert str(world.status) == row.call_status
    assert world.attempts == row.attempts
    assert world.effects == row.effects
    run_status = "paused" if world.status is CallStatus.UNKNOWN else "succeeded"
    assert run_status == row.run_status


# -- ambiguous failures, retries, exhaustion ----------------------------------------------

E = {"type": "TimeoutError", "message": "no answer"}
LE = {"type": "ConnectionError", "message": "lookup down"}
NA = {"reason": "refused", "not_applied": True}

IDEM, LOOK, UNSAFE, READ = Safety.IDEMPOTENT, Safety.LOOKUP, Safety.UNSAFE, Safety.READ_ONLY


def k(window: Window, safety: Safety | None, **kw: Any) -> Known:
    kw.setdefault("max_attempts", MAX_ATTEMPTS)
    return Known(window=window, safety=safety, tool="act", **kw)


TABLE: list[tuple[str, Known, Step]] = [
    # the tool raised or timed out: like a crash after sending
    ("idempotent retries, same key", k(Window.AMBIGUOUS, IDEM, tries=1, error=E), Dispatch(True)),
    ("idempotent last retry", k(Window.AMBIGUOUS, IDEM, tries=2, error=E), Dispatch(True)),
    (
        "idempotent exhausted is unknown",
        k(Window.AMBIGUOUS, IDEM, tries=3, error=E),
        MarkUnknown({"reason": "retries exhausted", **E}),
    ),
    (
        "one attempt only",
        k(Window.AMBIGUOUS, IDEM, tries=1, max_attempts=1, error=E),
        MarkUnknown({"reason": "retries exhausted", **E}),
    ),
    ("read_only reruns", k(Window.AMBIGUOUS, READ, tries=1, error=E), Dispatch(True)),
    (
        "read_only exhausted fails",
        k(Window.AMBIGUOUS, READ, tries=3, error=E),
        Complete(Outcome.FAILED, E),
    ),
    (
        "unsafe is unknown at once",
        k(Window.AMBIGUOUS, UNSAFE, tries=1, error=E),
        MarkUnknown({"reason": "ambiguous failure of an unsafe tool", **E}),
    ),
    ("lookup asks first", k(Window.AMBIGUOUS, LOOK, tries=1, error=E), Lookup()),
    (
        "lookup asks even when exhausted",
        k(Window.AMBIGUOUS, LOOK, tries=3, error=E),
        Lookup(),
    ),
    (
        "lookup found: its receipt",
        k(Window.AMBIGUOUS, LOOK, tries=1, error=E, looked_up=LookedUp.FOUND),
        Complete(Outcome.SUCCEEDED),
    ),
    (
        "lookup not found: send again",
        k(Window.AMBIGUOUS, LOOK, tries=1, error=E, looked_up=LookedUp.NOT_FOUND),
        Dispatch(True),
    ),
    (
        "lookup not found, exhausted: no effect, failed",
        k(Window.AMBIGUOUS, LOOK, tries=3, error=E, looked_up=LookedUp.NOT_FOUND),
        Complete(Outcome.FAILED, E),
    ),
    (
        "lookup failed: ask again",
        k(Window.AMBIGUOUS, LOOK, tries=1, looked_up=LookedUp.FAILED, lookups_failed=2),
        Lookup(True),
    ),
    (
        "lookup failed every time: unknown",
        k(
            Window.AMBIGUOUS,
            LOOK,
            tries=1,
            error=E,
            looked_up=LookedUp.FAILED,
            lookups_failed=3,
            lookup_error=LE,
        ),
        MarkUnknown({"reason": "lookup failed", **LE}),
    ),
    # found dispatched on recovery
    ("in flight idempotent", k(Window.IN_FLIGHT, IDEM, attempts=2), Dispatch()),
    ("in flight read_only", k(Window.IN_FLIGHT, READ, attempts=2), Dispatch()),
    ("in flight lookup", k(Window.IN_FLIGHT, LOOK, attempts=2), Lookup()),
    (
        "in flight lookup not found",
        k(Window.IN_FLIGHT, LOOK, attempts=2, looked_up=LookedUp.NOT_FOUND),
        Dispatch(),
    ),
    (
        "in flight lookup failed every time",
        k(Window.IN_FLIGHT, LOOK, looked_up=LookedUp.FAILED, lookups_failed=3, lookup_error=LE),
        MarkUnknown({"reason": "lookup failed", **LE}),
    ),
    (
        "in flight unsafe",
        k(Window.IN_FLIGHT, UNSAFE, attempts=2),
        MarkUnknown(
            {"reason": "in flight when its worker lost the run; unsafe to repeat", "attempts": 2}
        ),
    ),
    # the pause says only what is known of the earlier sender: "stopped" once its process
    # was found gone, else how its send ended
    (
        "in flight unsafe, its sender's process gone",
        k(Window.IN_FLIGHT, UNSAFE, attempts=2, sender_ended="process_gone"),
        MarkUnknown(
            {"reason": "in flight when its worker stopped; unsafe to repeat", "attempts": 2}
        ),
    ),
    (
        "in flight unsafe, its sender's lease ran out without a word",
        k(Window.IN_FLIGHT, UNSAFE, attempts=2, sender_ended="lease_expired"),
        MarkUnknown(
            {
                "reason": "in flight when its worker lost the run: its lease ended without "
                "word from it; unsafe to repeat",
                "attempts": 2,
            }
        ),
    ),
    (
        "in flight unsafe, its sender's tool raised",
        k(Window.IN_FLIGHT, UNSAFE, attempts=1, sender_ended="raised"),
        MarkUnknown(
            {
                "reason": "in flight when its worker lost the run: its tool raised; "
                "unsafe to repeat",
                "attempts": 1,
            }
        ),
    ),
    (
        "in flight unsafe after a failover that may have lost its dispatch",
        k(Window.IN_FLIGHT, UNSAFE, attempts=1, failover=True, sender_ended="lease_expired"),
        MarkUnknown(
            {
                "reason": "may have been sent on the timeline a failover lost; unsafe to repeat",
                "attempts": 1,
            }
        ),
    ),
    (
        "in flight, tool gone",
        k(Window.IN_FLIGHT, None),
        MarkUnknown({"reason": "tool act is not in this flow"}),
    ),
    # in flight from an earlier holder that may still be sending it (revision 0031)
    ("sender active, idempotent", k(Window.IN_FLIGHT, IDEM, sender_active=True), AwaitSender()),
    ("sender active, lookup", k(Window.IN_FLIGHT, LOOK, sender_active=True), AwaitSender()),
    ("sender active, unsafe", k(Window.IN_FLIGHT, UNSAFE, sender_active=True), AwaitSender()),
    ("sender active, read_only", k(Window.IN_FLIGHT, READ, sender_active=True), Dispatch()),
    (
        "sender active, tool gone",
        k(Window.IN_FLIGHT, None, sender_active=True),
        MarkUnknown({"reason": "tool act is not in this flow"}),
    ),
    (
        "sender active, a lookup already said not found",
        k(Window.IN_FLIGHT, LOOK, sender_active=True, looked_up=LookedUp.NOT_FOUND),
        AwaitSender(),
    ),
    # certainly not applied
    (
        "not applied, retry: back to planned",
        k(Window.NOT_APPLIED, IDEM, tries=1, reason="refused", retry=True),
        Complete(Outcome.NOT_APPLIED, NA),
    ),
    (
        "not applied, retry, exhausted",
        k(Window.NOT_APPLIED, IDEM, tries=3, reason="refused", retry=True),
        Complete(Outcome.FAILED, NA),
    ),
    (
        "not applied",
        k(Window.NOT_APPLIED, IDEM, tries=1, reason="refused"),
        Complete(Outcome.FAILED, NA),
    ),
    (
        "not applied is certain even for unsafe",
        k(Window.NOT_APPLIED, UNSAFE, tries=1, reason="refused", retry=True),
        Complete(Outcome.NOT_APPLIED, NA),
    ),
    ("planned", k(Window.PLANNED, UNSAFE), Dispatch()),
    ("planned again after not applied", k(Window.PLANNED, UNSAFE, tries=1), Dispatch(True)),
    ("planned, tool gone", k(Window.PLANNED, None), ToolMissing()),
    ("returned", k(Window.RETURNED, UNSAFE, tries=1), Complete(Outcome.SUCCEEDED)),
    ("already unknown", k(Window.UNKNOWN, IDEM), Pause()),
    ("already unknown, tool gone", k(Window.UNKNOWN, None), Pause()),
    ("settled", k(Window.SETTLED, UNSAFE), Reuse()),
    # a person must approve the call before it is sent
    ("awaiting approval", k(Window.AWAITING_APPROVAL, UNSAFE), AwaitApproval()),
    ("awaiting approval, idempotent", k(Window.AWAITING_APPROVAL, IDEM), AwaitApproval()),
    ("awaiting approval, tool gone", k(Window.AWAITING_APPROVAL, None), ToolMissing()),
]


@pytest.mark.parametrize(("known", "step"), [t[1:] for t in TABLE], ids=[t[0] for t in TABLE])
def test_next_step(known: Known, step: Step) -> None:
    assert next_step(known) == step


@pytest.mark.parametrize(
    ("status", "window"),
    [
        (CallStatus.PLANNED, Window.PLANNED),
        (CallStatus.DISPATCHED, Window.IN_FLIGHT),
        (CallStatus.UNKNOWN, Window.UNKNOWN),
        (CallStatus.SUCCEEDED, Window.SETTLED),
        (CallStatus.FAILED, Window.SETTLED),
    ],
)
def test_the_window_a_journaled_call_is_in(status: CallStatus, window: Window) -> None:
    assert window_of(status) == window
    # an approval only matters while the call is planned and pending
    assert window_of(status, Approval.APPROVED) == window
    if status is not CallStatus.PLANNED:
        assert window_of(status, Approval.PENDING) == window


@pytest.mark.parametrize(
    ("approval", "window"),
    [
        (None, Window.PLANNED),
        (Approval.PENDING, Window.AWAITING_APPROVAL),
        (Approval.APPROVED, Window.PLANNED),
    ],
)
def test_a_planned_call_waits_while_its_approval_is_pending(
    approval: Approval | None, window: Window
) -> None:
    assert window_of(CallStatus.PLANNED, approval) == window
    # a denied call is failed: settled, reused, never sent
    assert window_of(CallStatus.FAILED, Approval.DENIED) == Window.SETTLED


# -- every sequence of answers keeps the guarantees -------------------------------------

TOOL_ANSWERS = ("returns", "raises", "not_applied", "not_applied_retry")
LOOKUP_ANSWERS = ("found", "not_found", "raises")


def drive(known: Known, tool: Iterator[str], lookup: Iterator[str]) -> list[tuple[Step, str]]:
    """Carry the steps out as the executor does, the tool and its lookup answering from
    the iterators; returns each step with the answer it got ("" for none)."""
    trace: list[tuple[Step, str]] = []
    for _ in range(100):
        step = next_step(known)
        match step:
            case Dispatch():
                answer = next(tool)
                sent = dataclasses.replace(
                    known,
                    tries=known.tries + 1,
                    looked_up=LookedUp.NOT_ASKED,
                    lookups_failed=0,
                    lookup_error=None,
                )
                known = {
                    "returns": dataclasses.replace(sent, window=Window.RETURNED),
                    "raises": dataclasses.replace(sent, window=Window.AMBIGUOUS, error=E),
                    "not_applied": dataclasses.replace(
                        sent, window=Window.NOT_APPLIED, reason="no", retry=False
                    ),
                    "not_applied_retry": dataclasses.replace(
                        sent, window=Window.NOT_APPLIED, reason="no", retry=True
                    ),
                }[answer]
            case Lookup():
                answer = next(lookup)
                known = {
                    "found": dataclasses.replace(known, looked_up=LookedUp.FOUND),
                    "not_found": dataclasses.replace(known, looked_up=LookedUp.NOT_FOUND),
                    "raises": dataclasses.replace(
                        known,
                        looked_up=LookedUp.FAILED,
                        lookups_failed=known.lookups_failed + 1,
                        lookup_error=LE,
                    ),
                }[answer]
            case Complete(outcome=Outcome.NOT_APPLIED):
                answer = ""
                known = dataclasses.replace(known, window=Window.PLANNED)
            case _:
                trace.append((step, ""))
                return trace
        trace.append((step, answer))
    raise AssertionError(f"no end after 100 steps: {trace}")


def sequences(answers: tuple[str, ...], n: int) -> Iterator[tuple[str, ...]]:
    for length in range(1, n + 1):
        yield from itertools.product(answers, repeat=length)


@pytest.mark.parametrize("safety", list(Safety))
@pytest.mark.parametrize("start", [Window.PLANNED, Window.IN_FLIGHT])
@pytest.mark.parametrize("max_attempts", [1, 2, 3])
def test_every_sequence_of_answers_keeps_the_guarantees(
    safety: Safety, start: Window, max_attempts: int
) -> None:
    for tool_answers in sequences(TOOL_ANSWERS, max_attempts):
        for lookup_answers in sequences(LOOKUP_ANSWERS, 3):
            known = Known(window=start, safety=safety, tool="act", max_attempts=max_attempts)
            tool = itertools.chain(tool_answers, itertools.repeat("returns"))
            lookup = itertools.chain(lookup_answers, itertools.repeat("not_found"))
            trace = drive(known, tool, lookup)
            steps = [s for s, _ in trace]
            where = (safety, start, max_attempts, tool_answers, lookup_answers, steps)

            # it ends, with the call settled or reconcilable
            assert isinstance(steps[-1], Complete | MarkUnknown), where
            # bounded: never more sends than max_attempts in one holder
            assert sum(isinstance(s, Dispatch) for s in steps) <= max_attempts, where
            # never a second send while the first may have taken effect, unless the
            # class allows it: idempotent (same key), read_only (no effect), lookup
            # (after the provider said "not found"); a certain "not applied" always may
            maybe_applied = start is Window.IN_FLIGHT
            for i, (step, answer) in enumerate(trace):
                if isinstance(step, Dispatch) and maybe_applied:
                    assert safety is not Safety.UNSAFE, where
                    if safety is Safety.LOOKUP:
                        before, said = trace[i - 1]
                        assert isinstance(before, Lookup) and said == "not_found", where
                if isinstance(step, Dispatch):
                    maybe_applied = answer == "raises"
                if isinstance(step, Complete) and step.outcome is Outcome.NOT_APPLIED:
                    maybe_applied = False
            # a found receipt is recorded, never sent again
            for i, (step, answer) in enumerate(trace):
                if isinstance(step, Lookup) and answer == "found":
                    assert trace[i + 1][0] == Complete(Outcome.SUCCEEDED), where
            # failed means certainly no effect: never an idempotent or unsafe call that
            # may have happened (those are unknown, for a person to reconcile)
            last = steps[-1]
            if isinstance(last, Complete) and last.outcome is Outcome.FAILED:
                said = trace[-2][1] if len(trace) > 1 else ""
                if safety in (Safety.IDEMPOTENT, Safety.UNSAFE):
                    assert said in ("not_applied", "not_applied_retry"), where

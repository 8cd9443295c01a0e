"""The seed's crash-window table as one pure function: what to do next with one call.

| window (what is known)               | recovery                                          |
| ------------------------------------ | ------------------------------------------------- |
| ``planned``: not sent                | send it with the persisted key                    |
| ``planned``, but a failover may have | ``lookup`` and ``unsafe``: dispatched without a   |
|   lost its dispatch (``suspect``)    | send, then recovered as in flight; the others     |
|                                      | send with the same key (docs/failover.md)         |
| ``in_flight``: sent, no response     | ``lookup`` asks; ``idempotent`` sends again with   |
|   (found ``dispatched`` on recovery) | the same key; ``read_only`` reruns; ``unsafe``    |
|                                      | cannot know: ``unknown`` and the run pauses       |
| ``in_flight``, and its earlier       | wait for it (``read_only`` excepted): it releases  |
|   sender may still be sending it     | the call (with its result, if it got one), its    |
|   (``sender_active``)                | process is found gone, or its lease expires       |
| ``ambiguous``: the tool raised or    | like in flight, within ``max_attempts``; once     |
|   timed out                          | exhausted ``idempotent`` is ``unknown``, the      |
|                                      | others (no effect) fail                           |
| ``not_applied``: certainly no effect | back to ``planned`` (same key) or failed          |
| ``returned``: the tool answered      | record the result and the receipt                 |
| ``settled``: the receipt is saved    | reuse it, move on                                 |
| ``unknown``: already ambiguous       | pause; a person reconciles                        |
| a lookup raised ``Unknowable``: the  | ``unknown`` at once, with what it saw: neither     |
|   provider cannot tell (past its     | sent again nor asked again                        |
|   retention window, say)             |                                                   |
| ``awaiting_approval``: planned, a    | pause; a person approves (then it is ``planned``)  |
|   person must approve it first       | or denies it (then it is ``failed``: settled)     |

:func:`next_step` takes what the executor knows (:class:`Known`) and returns one
:class:`Step`; :mod:`runledger.worker.calls` carries it out and asks again. No I/O
here, nothing asynchronous, no clock: every row is a unit test.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from runledger.model import Approval, CallStatus, Outcome, Safety

__all__ = [
    "AwaitApproval",
    "AwaitSender",
    "Complete",
    "Dispatch",
    "Known",
    "LookedUp",
    "Lookup",
    "MarkUnknown",
    "Pause",
    "Probe",
    "Reuse",
    "Step",
    "ToolMissing",
    "Window",
    "next_step",
    "window_of",
]


class Window(StrEnum):
    """What is known about the call's effect at this moment."""

    PLANNED = "planned"  # not sent (or certainly not applied and sent again, same key)
    IN_FLIGHT = "in_flight"  # found dispatched on recovery: sent, no response journaled
    AMBIGUOUS = "ambiguous"  # the tool raised (not NotApplied) or timed out
    NOT_APPLIED = "not_applied"  # the tool raised NotApplied: certainly no effect
    RETURNED = "returned"  # the tool returned: its result and receipt are in hand
    SETTLED = "settled"  # the journal has the outcome (succeeded or failed)
    UNKNOWN = "unknown"  # the journal says unknown: only a person can settle it
    AWAITING_APPROVAL = "awaiting_approval"  # planned, not to be sent before a person approves


class LookedUp(StrEnum):
    """The answer of the provider's lookup since the last send."""

    NOT_ASKED = "not_asked"
    FOUND = "found"  # the key took effect: its receipt is in hand
    NOT_FOUND = "not_found"  # the key did not take effect
    FAILED = "failed"  # the lookup itself raised or timed out
    UNKNOWABLE = "unknowable"  # the provider cannot tell (runledger.Unknowable)


def window_of(status: CallStatus, approval: Approval | None = None) -> Window:
    """The window a call is in when a worker reads it from the journal."""
    if status is CallStatus.PLANNED and approval is Approval.PENDING:
        return Window.AWAITING_APPROVAL
    return {
        CallStatus.PLANNED: Window.PLANNED,
        CallStatus.DISPATCHED: Window.IN_FLIGHT,
        CallStatus.UNKNOWN: Window.UNKNOWN,
        CallStatus.SUCCEEDED: Window.SETTLED,
        CallStatus.FAILED: Window.SETTLED,
    }[status]


@dataclass(frozen=True, slots=True, kw_only=True)
class Known:
    """Everything :func:`next_step` decides on, for one call of one holder."""

    window: Window
    safety: Safety | None  # None: the journal names a tool this flow does not have
    tool: str = ""
    max_attempts: int = 1
    tries: int = 0  # sends by this holder (a recovered call starts at 0)
    attempts: int = 0  # the journal's attempt count when the call was read
    looked_up: LookedUp = LookedUp.NOT_ASKED
    lookups_failed: int = 0  # failed lookups since the last send
    error: dict[str, Any] | None = None  # the tool's last exception (type, message)
    lookup_error: dict[str, Any] | None = None  # the lookup's last exception
    # why the provider cannot tell (Unknowable's reason), when it said so
    unknowable: str | None = None
    reason: str | None = None  # NotApplied's reason
    retry: bool = False  # NotApplied(retry=True)
    # planned, never dispatched on this timeline, of a run a failover affected: it may
    # have been dispatched and sent on the timeline the failover lost
    suspect: bool = False
    # the call is suspect, or the failover marked it dispatched: says so when it pauses
    failover: bool = False
    # in flight from an earlier holder that may still be sending it: a lookup cannot see
    # a request still on its way, and a second send may land beside it (docs/leases.md)
    sender_active: bool = False
    # how that earlier sender's send ended, once it could no longer be sending: what its
    # release said ("process_gone", "raised", "cancelled", ...), or "lease_expired" when
    # it said nothing before its lease ran out; None when no earlier sender was waited for
    sender_ended: str | None = None


@dataclass(frozen=True, slots=True)
class Dispatch:
    """``dispatch_call`` then invoke the tool, with the call's one key."""

    backoff: bool = False  # wait first: an earlier send of this holder failed


@dataclass(frozen=True, slots=True)
class Probe:
    """``dispatch_call`` without invoking the tool: the call may have been sent on a
    timeline a failover lost, so from here on it is recovered as in flight."""


@dataclass(frozen=True, slots=True)
class AwaitSender:
    """Wait until the call's earlier sender can no longer be sending it: it released the
    call, its process is found gone, or its lease expired by the database clock. Then
    the call is recovered as in flight, or journaled with the result its sender got."""


@dataclass(frozen=True, slots=True)
class Lookup:
    """Ask the provider whether the key took effect."""

    backoff: bool = False  # wait first: the previous lookup failed


@dataclass(frozen=True, slots=True)
class Complete:
    """``complete_call``. ``succeeded`` records what is in hand: the tool's result and
    receipt, or the receipt the lookup found. ``not_applied`` returns the call to
    ``planned`` (the same key is sent again); ``failed`` is final."""

    outcome: Outcome
    error: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class MarkUnknown:
    """``complete_call(..., 'unknown')`` -- not failed: it may have happened -- and pause."""

    error: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Pause:
    """The call is already ``unknown``: pause the run without writing anything."""


@dataclass(frozen=True, slots=True)
class AwaitApproval:
    """The call waits for a person's approval: send nothing, pause the run (after the
    other calls of its group) without writing anything for the call."""


@dataclass(frozen=True, slots=True)
class Reuse:
    """The receipt is saved: nothing to send, move on."""


@dataclass(frozen=True, slots=True)
class ToolMissing:
    """A planned call of a tool this code does not have: fail the run, send nothing."""


Step = (
    Dispatch
    | Probe
    | AwaitSender
    | Lookup
    | Complete
    | MarkUnknown
    | Pause
    | AwaitApproval
    | Reuse
    | ToolMissing
)


def next_step(k: Known) -> Step:
    """The crash-window table: what to do next with this call."""
    match k.window:
        case Window.SETTLED:
            return Reuse()
        case Window.UNKNOWN:
            return Pause()
        case Window.AWAITING_APPROVAL:
            # a tool this code lacks fails the run now rather than ask a person for nothing
            return ToolMissing() if k.safety is None else AwaitApproval()
        case Window.RETURNED:
            return Complete(Outcome.SUCCEEDED)
        case Window.NOT_APPLIED:
            error = {"reason": k.reason, "not_applied": True}
            if k.retry and k.tries < k.max_attempts:
                return Complete(Outcome.NOT_APPLIED, error)
            return Complete(Outcome.FAILED, error)
        case Window.PLANNED:
            if k.safety is None:
                return ToolMissing()
            if k.suspect and k.safety in (Safety.LOOKUP, Safety.UNSAFE):
                return Probe()  # idempotent, read_only: sending again with the key is safe
            return Dispatch(backoff=k.tries > 0)
        case Window.IN_FLIGHT:
            return _in_flight(k)
        case Window.AMBIGUOUS:
            return _ambiguous(k)


def _in_flight(k: Known) -> Step:
    """Sent by an earlier holder, no response journaled: the effect may exist."""
    if k.safety is None:
        return MarkUnknown({"reason": f"tool {k.tool} is not in this flow"})
    if k.sender_active and k.safety is not Safety.READ_ONLY:
        return AwaitSender()
    if k.safety is Safety.UNSAFE:
        why = f"in flight when its worker {_LOST.get(k.sender_ended or '', _LOST[''])}"
        if k.failover:
            why = "may have been sent on the timeline a failover lost"
        return MarkUnknown({"reason": f"{why}; unsafe to repeat", "attempts": k.attempts})
    if k.safety is Safety.LOOKUP:
        asked = _ask(k)
        if asked is not None:
            return asked
    # idempotent: the provider deduplicates the key; read_only: no effect;
    # lookup: the provider says the key did not take effect
    return Dispatch()


# What a pause reason says of the earlier sender of an unsafe call found in flight: only
# what is known. A worker "stopped" only when its process was found gone; a worker that
# lost its connection, or its lease, may still be running.
_LOST = {
    "process_gone": "stopped",
    "lease_expired": "lost the run: its lease ended without word from it",
    "raised": "lost the run: its tool raised",
    "cancelled": "lost the run: its tool was cancelled",
    "": "lost the run",
}


def _ambiguous(k: Known) -> Step:
    """The tool raised or timed out: treated exactly like a crash after sending."""
    err = k.error or {}
    if k.safety is Safety.UNSAFE:
        return MarkUnknown({"reason": "ambiguous failure of an unsafe tool", **err})
    if k.safety is Safety.LOOKUP:
        asked = _ask(k)
        if asked is not None:
            return asked
    if k.tries >= k.max_attempts:
        if k.safety is Safety.IDEMPOTENT:
            return MarkUnknown({"reason": "retries exhausted", **err})
        # read_only, or the lookup said it did not happen: certainly no effect
        return Complete(Outcome.FAILED, dict(err))
    return Dispatch(backoff=True)


def _ask(k: Known) -> Step | None:
    """A lookup tool's answer decides; None once the provider said "not found"."""
    match k.looked_up:
        case LookedUp.NOT_ASKED:
            return Lookup()
        case LookedUp.FOUND:
            return Complete(Outcome.SUCCEEDED)
        case LookedUp.FAILED:
            if k.lookups_failed < k.max_attempts:
                return Lookup(backoff=True)
            return MarkUnknown({"reason": "lookup failed", **(k.lookup_error or {})})
        case LookedUp.UNKNOWABLE:
            return MarkUnknown({"reason": f"the provider cannot tell: {k.unknowable}"})
        case LookedUp.NOT_FOUND:
            return None

"""What the executor keeps about a run it holds, and the small values of its loop."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from runledger.config import default
from runledger.db.rows import ClaimedJournal
from runledger.flows import Receipt
from runledger.model import ClaimedRun

if TYPE_CHECKING:
    from runledger.worker.journal import LocalJournal

T = TypeVar("T")


class Draining(Exception):
    """The worker is shutting down: stop at this step boundary and release the lease."""


class LocalLeaseExpired(Exception):
    """The lease may have expired by the local clock: start nothing more (self-fencing)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_turns: int = default("max_turns")
    max_calls: int = default("max_calls")
    max_stalled_claims: int = default("max_stalled_claims")
    tool_timeout: float = default("tool_timeout")
    policy_timeout: float = default("policy_timeout")
    policy_attempts: int = 3
    backoff: float = 0.2
    max_backoff: float = 5.0


@dataclass(slots=True)
class Vouch:
    """Until when (monotonic) the worker's listener session vouches for its leases: the
    send time of its last answered heartbeat plus its budget (docs/leases.md). Shared by
    every run the worker holds; ``inf`` where the session holds no lock."""

    until: float = math.inf


@dataclass(slots=True, kw_only=True)
class ActiveRun:
    """A run this worker holds: its lease and the local deadline that fences it; what the
    claim brought of its journal (``loaded``, until the executor unpacks it), the journal
    kept in memory, and a checkpoint not written yet (``checkpoint_due``: it goes with the
    next decision, or is written on its own before any other write that ends this
    holder's work on the run)."""

    claim: ClaimedRun
    deadline: float
    vouch: Vouch = field(default_factory=Vouch, repr=False)  # the listener's, shared
    draining: bool = False
    # a write that ends the lease (the final decision, finish_run, a release) is on its
    # way or done: a renewal that no longer finds the run is its end, not a lost lease
    ending: bool = False
    # why this worker fenced the run (stopped working on it at once), once it has
    fenced: str | None = None
    operation: str = "claim"
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    loaded: ClaimedJournal | None = field(default=None, repr=False)
    journal: LocalJournal | None = field(default=None, repr=False)
    state_version: int = 0
    checkpoint_due: dict[str, Any] | None = None
    # a failover affected the run: calls of this turn and later ones that were never
    # dispatched on this timeline may have been sent on the lost one (docs/failover.md)
    failover_turn: int | None = None
    # when each call in flight was dispatched (monotonic), for runledger_call_seconds
    sent_at: dict[str, float] = field(default_factory=dict, repr=False)
    # the spans of this holder's work (runledger.worker.tracing.RunTrace); None: no tracing
    trace: Any = field(default=None, repr=False)

    @property
    def run_id(self) -> str:
        return self.claim.run_id


def jsonable(value: Any) -> Any:
    """The tool's value as JSON; anything JSON cannot hold (objects, NaN, infinities,
    non-string keys) is stringified, not lost."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return jsonable(json.loads(json.dumps(value, default=str)))


def detached(coro: Coroutine[Any, Any, T]) -> tuple[asyncio.Task[T], asyncio.Future[T]]:
    """``coro`` in a task of its own (the context copied now), and the future its caller
    awaits for its outcome: ``asyncio.shield`` of the task, one turn of the event loop
    sooner, since the task sets the answer itself as ``coro`` ends (a shield's answer
    waits for the task's done callback, then for its own).

    A caller cancelled meanwhile stops waiting, and its answer is cancelled; the task
    goes on, and its outcome, the task's own, is for whoever tracks it (a write that may
    be refused, a tool's thread). While the answer is not cancelled it carries the
    task's outcome, so the task's exception counts as retrieved. A task cancelled before
    its first step (the loop shutting down) cancels the answer and closes ``coro``,
    which never ran."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[T] = loop.create_future()
    task = loop.create_task(_answering(coro, answer))

    def ended(task: asyncio.Task[T]) -> None:
        if task.cancelled():
            if not answer.done():
                answer.cancel()
            coro.close()  # a no-op once it ran; unstarted, closed without a warning
        elif not answer.cancelled():
            task.exception()  # the caller has it from the answer

    task.add_done_callback(ended)
    return task, answer


async def _answering(coro: Coroutine[Any, Any, T], answer: asyncio.Future[T]) -> T:
    try:
        value = await coro
    except GeneratorExit:  # closed (a pending task collected after its loop closed)
        raise
    except BaseException as exc:
        if not answer.done():
            if isinstance(exc, asyncio.CancelledError):
                answer.cancel()
            else:
                answer.set_exception(exc)
        raise
    if not answer.done():
        answer.set_result(value)
    return value


class Backoff:
    """Jittered exponential backoff between attempts of one step."""

    def __init__(self, limits: Limits) -> None:
        self.delay = limits.backoff
        self.cap = limits.max_backoff

    async def sleep(self) -> None:
        await asyncio.sleep(self.delay * (0.5 + random.random()))
        self.delay = min(self.delay * 2, self.cap)


def unpack(value: Any) -> tuple[Any, dict[str, Any] | None]:
    """A tool's return value -> (result, receipt)."""
    if isinstance(value, Receipt):
        receipt = jsonable(value.receipt) if value.receipt is not None else None
        return jsonable(value.result), receipt
    return jsonable(value), None


def error_of(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)[:2000]}


class PolicyFailed(Exception):
    """The policy raised on every attempt; the run fails as ``policy_error``."""


# -- pause reasons: each names the command that gets the run going again -----------------

RESOLVE = "applied|not_applied|abandoned"


def resolve_command(key: str) -> str:
    return f"`runledger resolve {key} {RESOLVE}`"


def unknown_call_reason(*keys: str) -> str:
    """The pause reason of calls that settled ``unknown`` (one, or several of a turn run
    in parallel): each full key, and the command."""
    if len(keys) == 1:
        return f"call {keys[0]} is unknown: reconcile it with {resolve_command(keys[0])}"
    listed = ", ".join(keys)
    return f"calls {listed} are unknown: reconcile each with {resolve_command('<key>')}"


MAX_PAUSE_REASON = 1000  # runledger._cap('reason'): finish_run refuses a longer one


def approval_commands(key: str) -> str:
    """The two lines a person chooses between for a call awaiting approval."""
    return f'`runledger approve {key}` or `runledger deny {key} --reason "..."`'


def awaiting_approval_reason(*keys: str) -> str:
    """The pause reason of calls that await a person's approval: each full key, and the
    two commands."""
    if len(keys) == 1:
        return f"call {keys[0]} awaits approval: {approval_commands(keys[0])}"
    listed = ", ".join(keys)
    return f"calls {listed} await approval: for each, {approval_commands('<key>')}"


def pause_reason(run_id: str, unknown: Sequence[str], awaiting: Sequence[str]) -> str:
    """Why a run pauses after a group of calls: the calls that settled ``unknown``, then
    those that await approval, each key whole and the commands -- or, past what
    ``finish_run`` stores, the counts and where to see the keys."""
    parts = []
    if unknown:
        parts.append(unknown_call_reason(*unknown))
    if awaiting:
        parts.append(awaiting_approval_reason(*awaiting))
    reason = "; ".join(parts)
    if len(reason) <= MAX_PAUSE_REASON:
        return reason
    counts = []
    if unknown:
        counts.append(f"{len(unknown)} call(s) are unknown ({resolve_command('<key>')})")
    if awaiting:
        counts.append(f"{len(awaiting)} call(s) await approval ({approval_commands('<key>')})")
    return f"{' and '.join(counts)}: `runledger status {run_id}` lists them"


def in_flight_reason(why: str, run_id: str, keys: Sequence[str], *, reserve: int = 0) -> str:
    """The pause reason of a run given up on with calls that may have taken effect (now
    ``unknown``): ``why``, every key whole (up to a bound, then a count and where to see
    them), and the command, in at most ``MAX_PAUSE_REASON - reserve`` characters (what
    ``finish_run`` stores, less what the caller appends). Resolving the last one requeues
    the run."""
    if len(keys) == 1:
        return f"{why}; call {keys[0]} may have taken effect and is unknown: reconcile it with " + (
            resolve_command(keys[0])
        )
    # keys named whole while the reason stays within what finish_run stores; the rest
    # are counted (the fixed words, the count and the status command take the remainder)
    fixed = len(
        f"{why}; calls  may have taken effect and are unknown: reconcile each with "
        f"{resolve_command('<key>')} and {len(keys)} more (`runledger status {run_id}` "
        "lists them)"
    )
    budget = MAX_PAUSE_REASON - reserve - fixed
    named: list[str] = []
    for key in keys:
        if named and sum(len(k) + 2 for k in named) + len(key) > budget:
            break
        named.append(key)
    listed = ", ".join(named)
    if len(named) < len(keys):
        listed += f" and {len(keys) - len(named)} more (`runledger status {run_id}` lists them)"
    return (
        f"{why}; calls {listed} may have taken effect and are unknown: reconcile each with "
        f"{resolve_command('<key>')}"
    )

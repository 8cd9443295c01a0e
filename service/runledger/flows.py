"""The public flow API: ``Flow``, tools with safety classes, the policy, contexts.

Tool and policy code never touches the database: it gets a context. A tool returns
its result (JSON) or a :class:`Receipt`; it raises :class:`NotApplied` only when the
effect certainly did not happen. Any other exception, or a timeout, is ambiguous and
handled like a crash after sending.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from runledger.clock import wall_now
from runledger.model import CALL_ID_RE, FLOW_NAME_RE, FLOW_VERSION_RE, Safety, flow_ref

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the policy decides on. ``call_id`` defaults to ``c<position>``.

    ``provider_id`` is the model's own id for this call (Anthropic ``tool_use.id``, OpenAI
    ``call_id``): it is kept with the turn only to map results back into the provider's
    messages, never used in an idempotency key (providers repeat ids across runs).

    ``approval=True``: a person must approve this call before it is sent (as for every
    call of a tool declared ``@flow.tool(..., approval=True)``); the run pauses until
    ``runledger approve KEY`` or ``runledger deny KEY --reason ...``.
    """

    tool: str
    args: dict[str, Any] = field(default_factory=dict)
    call_id: str | None = None
    provider_id: str | None = None
    approval: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What a policy may return instead of a bare list of :class:`ToolCall`.

    - ``calls``: the tool calls of this turn; none ends the run;
    - ``record``: the provider-native assistant message (text, reasoning blocks with their
      signatures, tool-call ids, usage), JSON, stored verbatim with the turn so that the
      next request can send it back exactly;
    - ``output``: when there are no calls, the run's result.
    """

    calls: Sequence[ToolCall] = ()
    record: dict[str, Any] | None = None
    output: Any = None


@dataclass(frozen=True, slots=True)
class Receipt:
    """A tool result plus the provider's receipt (ticket id, payment id, ...)."""

    result: Any = None
    receipt: dict[str, Any] | None = None


class NotApplied(Exception):
    """The effect certainly did not happen. ``retry=True``: try again later, same key."""

    def __init__(self, reason: str, retry: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry


class Unknowable(Exception):
    """Raised by a lookup: the provider cannot tell whether the key took effect, for
    instance because its record of the key is past the provider's retention window. The
    call becomes ``unknown`` at once, neither sent again nor asked again: a person
    decides, from the ``facts`` kept with it (what was asked, what was seen)."""

    def __init__(self, reason: str, **facts: Any) -> None:
        super().__init__(reason)
        self.reason = reason
        self.facts = facts


class InvalidDecision(Exception):
    """The policy asked for an unknown tool or arguments that do not fit its signature."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolContext:
    run_id: str
    flow: str
    turn: int
    call_id: str
    tool: str
    idempotency_key: str
    fencing_token: int
    attempt: int
    lease_deadline: Callable[[], float] = field(repr=False)
    # when this key was first sent, and when its current attempt was, by the database's
    # clock: a provider's lookup judges the key's age by the first (its idempotency records
    # expire), and whether a request may still be on its way by the second; compare them
    # with now(), never with this host's clock. None: not sent before (the tool, on its
    # first attempt).
    first_sent_at: dt.datetime | None = None
    sent_at: dt.datetime | None = None
    # what the tool or its lookup observed (ToolContext.observe)
    observed: list[dict[str, Any]] = field(default_factory=list, repr=False, compare=False)
    # the database's clock as the worker measures it (runledger.clock.DatabaseClock.now);
    # a context built by hand, without a worker, has this host's clock
    clock: Callable[[], dt.datetime] = field(default=wall_now, repr=False, compare=False)

    def observe(self, **facts: Any) -> None:
        """Keep facts about this send or lookup: what was asked, what the provider
        answered, its request id. They are journaled with the call if it becomes
        ``unknown``, for the person who decides it (``runledger unknown``, ``show``)."""
        self.observed.append(facts)

    def now(self) -> dt.datetime:
        """The database's clock now (UTC): what :attr:`sent_at` and :attr:`first_sent_at`
        are compared with. A worker measures it on its round trips to the database, so a
        host whose own clock is wrong still judges ages right; it gives the earliest the
        database's clock can be (its reading less half a round trip, milliseconds), so a
        wait until a time has passed never ends early."""
        return self.clock()

    def since_sent(self) -> dt.timedelta | None:
        """How long ago the current attempt was sent, by the database's clock (None: not
        sent before)."""
        return None if self.sent_at is None else self.clock() - self.sent_at

    def since_first_sent(self) -> dt.timedelta | None:
        """How long ago the key was first sent, by the database's clock (None: never)."""
        return None if self.first_sent_at is None else self.clock() - self.first_sent_at

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` value after which the lease may be gone (moves on renewal)."""
        return self.lease_deadline()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryCall:
    call_id: str
    tool: str
    args: dict[str, Any]
    status: str
    result: Any
    error: Any
    provider_id: str | None = None  # the model's id for the call (ToolCall.provider_id)
    # None: no approval needed; "approved"; "denied" (then status is "failed" and error
    # is {"reason": "denied", "note": <the person's reason>, "actor": <who>})
    approval: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryTurn:
    turn: int
    calls: tuple[HistoryCall, ...]
    record: dict[str, Any] | None = None  # the decision's provider-native message (Decision.record)


_TOOL_CONTEXT: contextvars.ContextVar[ToolContext] = contextvars.ContextVar("runledger_tool")

# json.dumps(value, allow_nan=False) without an encoder built per call
_encode_strict = json.JSONEncoder(allow_nan=False).encode


def tool_context() -> ToolContext:
    """The :class:`ToolContext` of the tool call running now (for tool code that is not
    handed a ``ctx``, e.g. a framework's tool function). Raises ``LookupError`` outside
    a runledger tool call."""
    try:
        return _TOOL_CONTEXT.get()
    except LookupError:
        raise LookupError("runledger.tool_context() called outside a runledger tool call") from None


@contextlib.contextmanager
def using_tool_context(ctx: ToolContext) -> Iterator[ToolContext]:
    """Make ``ctx`` what :func:`tool_context` returns inside the block (threads started
    with ``asyncio.to_thread`` inherit it)."""
    token = _TOOL_CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _TOOL_CONTEXT.reset(token)


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyContext:
    run_id: str
    flow: str
    input: dict[str, Any]
    turn: int


ToolFn = Callable[..., Any]
LookupFn = Callable[[ToolContext], Any]


class Tool(Generic[F]):
    """A registered tool; call ``.lookup`` to attach the provider lookup of a ``lookup`` tool."""

    def __init__(
        self,
        fn: F,
        *,
        name: str,
        safety: Safety,
        timeout: float | None,
        max_attempts: int,
        parallel: bool | None = None,
        approval: bool = False,
    ) -> None:
        self.fn = fn
        self.name = name
        self.safety = safety
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.parallel = parallel  # None: the flow's parallel_calls decides
        self.approval = approval  # every call waits for a person before it is sent
        self.lookup_fn: LookupFn | None = None
        self.signature = inspect.signature(fn)
        params = list(self.signature.parameters.values())
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(f"tool {name}: the first parameter must be the context (ctx)")
        # what check_args needs to accept args without binding them (the common case):
        # the names that may be given by keyword, those that must be, and whether any
        # other name is taken (**kwargs); binding only explains a refusal
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        rest = params[1:]
        self._any_name = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in rest)
        self._names = frozenset(p.name for p in rest if p.kind in keyword)
        self._required = frozenset(
            p.name for p in rest if p.kind in keyword and p.default is inspect.Parameter.empty
        )
        self._positional_only = any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in rest)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def lookup(self, fn: LookupFn) -> LookupFn:
        """Register ``fn(ctx) -> receipt dict | None``: did ``ctx.idempotency_key`` take effect?"""
        if self.safety is not Safety.LOOKUP:
            raise TypeError(f"tool {self.name} is {self.safety}; only lookup tools take a lookup")
        self.lookup_fn = fn
        return fn

    def check_args(self, args: dict[str, Any]) -> None:
        """Raise :class:`InvalidDecision` when ``args`` do not bind to the signature."""
        if (
            not self._positional_only
            and self._required.issubset(args)
            and (self._any_name or self._names.issuperset(args))
        ):
            return
        try:
            self.signature.bind(None, **args)
        except TypeError as exc:
            raise InvalidDecision(f"tool {self.name}: {exc}") from exc


class Flow:
    """A named, versioned agent: one policy plus its tools.

    ``parallel_calls=True`` lets the calls of one turn run at the same time (a tool's own
    ``parallel=`` overrides it). Each call is still dispatched (committed) before it is
    sent and completed as it returns; the next turn waits for all of them.
    """

    def __init__(
        self,
        name: str,
        version: str = "1",
        *,
        max_turns: int | None = None,
        max_calls: int | None = None,
        parallel_calls: bool = False,
    ) -> None:
        if not FLOW_NAME_RE.fullmatch(name):
            raise ValueError(f"invalid flow name {name!r}: 1-128 characters of [A-Za-z0-9._-]")
        if not FLOW_VERSION_RE.fullmatch(version):
            raise ValueError(
                f"invalid flow version {version!r}: 1-64 characters of [A-Za-z0-9._+-]"
            )
        self.name = name
        self.version = version
        self.max_turns = max_turns
        self.max_calls = max_calls
        self.parallel_calls = parallel_calls
        self.tools: dict[str, Tool[Any]] = {}
        self.policy_fn: Callable[..., Any] | None = None

    @property
    def ref(self) -> str:
        return flow_ref(self.name, self.version)

    def __repr__(self) -> str:
        return f"Flow({self.ref!r}, tools={sorted(self.tools)})"

    def tool(
        self,
        *,
        safety: Safety | str,
        name: str | None = None,
        timeout: float | None = None,
        max_attempts: int = 3,
        parallel: bool | None = None,
        approval: bool = False,
    ) -> Callable[[Callable[..., Any]], Tool[Any]]:
        """Register a tool: ``@flow.tool(safety="idempotent")``.

        ``timeout`` (seconds) bounds one attempt; a timeout is ambiguous. ``max_attempts``
        bounds repeats with the same key where the safety class allows them.
        ``parallel`` overrides the flow's ``parallel_calls`` for this tool: whether its
        calls may run at the same time as the neighbouring calls of their turn.
        ``approval=True``: every call of the tool is recorded awaiting a person's approval
        and is not sent until approved (``runledger approve KEY``); a denied call
        (``runledger deny KEY --reason ...``) is never sent and reaches the policy as a
        failed call whose error says ``denied``.
        """
        if not isinstance(approval, bool):
            raise TypeError(f"approval must be True or False, got {approval!r}")
        try:
            klass = Safety(safety)
        except ValueError:
            allowed = ", ".join(s.value for s in Safety)
            raise ValueError(
                f"unknown safety class {safety!r}; expected one of: {allowed}"
            ) from None
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if timeout is not None and not timeout >= 0:  # NaN too; 0 or None: the worker's
            raise ValueError(f"timeout must be a number of seconds, 0 or more, got {timeout!r}")

        def register(f: Callable[..., Any]) -> Tool[Any]:
            tool_name = name or f.__name__
            if tool_name in self.tools:
                raise ValueError(f"flow {self.ref} already has a tool named {tool_name}")
            t = Tool(
                f,
                name=tool_name,
                safety=klass,
                timeout=timeout,
                max_attempts=max_attempts,
                parallel=parallel,
                approval=approval,
            )
            self.tools[tool_name] = t
            return t

        return register

    def policy(self, fn: F) -> F:
        """Register the policy: ``fn(ctx, history) -> Decision | list[ToolCall]``; no calls
        end the run (a :class:`Decision`'s ``output`` is then the run's result)."""
        if self.policy_fn is not None:
            raise ValueError(f"flow {self.ref} already has a policy")
        self.policy_fn = fn
        return fn

    def runs_in_parallel(self, tool: str) -> bool:
        """Whether calls of ``tool`` may run concurrently with their neighbours in a turn:
        the tool's own ``parallel``, else the flow's ``parallel_calls`` (an unknown tool:
        never, so that it fails on its own)."""
        t = self.tools.get(tool)
        if t is None:
            return False
        return self.parallel_calls if t.parallel is None else t.parallel

    def validate(self) -> None:
        """Raise ``ValueError`` when the flow cannot run (no policy, lookup tool without lookup)."""
        if self.policy_fn is None:
            raise ValueError(f"flow {self.ref} has no policy")
        for t in self.tools.values():
            if t.safety is Safety.LOOKUP and t.lookup_fn is None:
                raise ValueError(f"tool {t.name} of {self.ref} is 'lookup' but has no @lookup")

    def normalize(self, decided: Decision | Sequence[ToolCall]) -> Recordable:
        """Check a decision (a :class:`Decision` or a bare list of :class:`ToolCall`) and
        turn it into what ``record_turn`` records.

        Call ids are runledger's: ``c<position>`` unless the policy gives a valid
        ``call_id``; a ``provider_id`` is kept beside the call, never used as its id. A call
        of a tool declared with ``approval=True``, or a ``ToolCall(..., approval=True)``,
        carries ``"approval": true``."""
        record: dict[str, Any] | None = None
        output: Any = None
        if isinstance(decided, Decision):
            record, output = decided.record, decided.output
            if record is not None and not isinstance(record, dict):
                raise InvalidDecision(f"the record must be a dict or None, got {type(record)}")
            _check_json("the record", record)
            _check_json("the output", output)
            decided = decided.calls
            if output is not None and decided:
                raise InvalidDecision("a decision with calls has no output (output ends the run)")
        if not isinstance(decided, list | tuple):
            raise InvalidDecision(
                f"the policy must return a Decision or a list of ToolCall, got {type(decided)}"
            )
        calls: list[dict[str, Any]] = []
        seen: set[str] = set()
        for position, call in enumerate(decided):
            if not isinstance(call, ToolCall):
                raise InvalidDecision(f"call {position} is {type(call).__name__}, not ToolCall")
            tool = self.tools.get(call.tool)
            if tool is None:
                raise InvalidDecision(f"unknown tool {call.tool!r} (flow {self.ref})")
            if not isinstance(call.args, dict):
                raise InvalidDecision(f"args of call {position} must be a dict")
            tool.check_args(call.args)
            _check_json_args(tool.name, call.args)
            call_id = call.call_id or f"c{position}"
            if not CALL_ID_RE.fullmatch(call_id) or call_id in seen:
                raise InvalidDecision(f"invalid or repeated call id {call_id!r}")
            seen.add(call_id)
            entry: dict[str, Any] = {"call_id": call_id, "tool": call.tool, "args": call.args}
            if call.provider_id is not None:
                pid = call.provider_id
                if not isinstance(pid, str) or not 0 < len(pid) <= MAX_PROVIDER_ID or "\0" in pid:
                    raise InvalidDecision(
                        f"provider id of call {position} must be 1-{MAX_PROVIDER_ID} characters"
                    )
                entry["provider_id"] = pid
            if not isinstance(call.approval, bool):
                raise InvalidDecision(f"approval of call {position} must be True or False")
            if call.approval or tool.approval:
                entry["approval"] = True  # recorded pending: sent only once a person approves
            calls.append(entry)
        return Recordable(calls=calls, record=record, output=output)


MAX_PROVIDER_ID = 200  # runledger._cap('provider_id')


@dataclass(frozen=True, slots=True, kw_only=True)
class Recordable:
    """A checked decision, as ``record_turn`` takes it: the calls payload (call ids
    assigned, ``provider_id`` where the model gave one), the record and the output."""

    calls: list[dict[str, Any]]
    record: dict[str, Any] | None = None
    output: Any = None


def _check_json(what: str, value: Any) -> None:
    try:
        text = _encode_strict(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidDecision(f"{what} is not JSON: {exc}") from exc
    if "\\u0000" in text:
        raise InvalidDecision(f"{what} contains a NUL character")


def _check_json_args(tool: str, args: dict[str, Any]) -> None:
    _check_json(f"tool {tool}: arguments", args)


async def _within(coro: Awaitable[Any], timeout: float) -> Any:
    """``coro`` cancelled in place after ``timeout`` s, and ``TimeoutError`` raised once it
    has unwound: what ``asyncio.timeout`` does, inline. Not ``wait_for``: in Python 3.11
    it runs the coroutine in a task of its own, one more task per tool call. Not the
    ``asyncio.timeout`` scope either: its object and its two coroutines (enter, exit)
    cost as much again as the timer (a few µs per call on the worker's hot path). The
    same rules: the timer cancels the task running this; only a plain ``CancelledError``
    (not a subclass) that the timer caused (the task's count of cancellations back to
    what it was on entry) becomes ``TimeoutError``, any other goes on as it is; the
    timer's cancellation is taken back whatever the coroutine made of it; a timeout of
    0 or less cancels at once, before the callbacks ready now."""
    task = asyncio.current_task()
    if task is None:  # not in a task: nothing to cancel in place
        async with asyncio.timeout(timeout):
            return await coro
    loop = asyncio.get_running_loop()
    before = task.cancelling()
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    timer = loop.call_soon(expire) if timeout <= 0 else loop.call_later(timeout, expire)
    try:
        return await coro
    except asyncio.CancelledError as exc:
        if fired:
            fired = False
            if task.uncancel() <= before and type(exc) is asyncio.CancelledError:
                raise TimeoutError from exc
        raise
    finally:
        timer.cancel()
        if fired:  # the timer's cancellation was swallowed, or became another error
            task.uncancel()


async def invoke(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float | None,
) -> Any:
    """Run a sync (in a thread) or async function with an optional timeout.

    Arguments travel as a tuple and a dict so that a tool's own parameters (``timeout``,
    ``fn``, ...) never collide with these."""
    kw = kwargs or {}
    if inspect.iscoroutinefunction(fn):
        coro: Awaitable[Any] = fn(*args, **kw)
        if timeout is None:
            return await coro
        return await _within(coro, timeout)
    # A thread cannot be interrupted. Giving up on it would let the runtime look the
    # effect up or send it again while the first attempt may still land, so a plain
    # ``def`` is always waited for; its timeout is only reported.
    thread = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kw))
    if timeout is not None:
        done, _ = await asyncio.wait({thread}, timeout=timeout)
        if not done:
            log.warning(
                "%s is past its timeout of %s s; a thread cannot be stopped: waiting for it "
                "(make it async, or honour ctx.deadline, to be interruptible)",
                getattr(fn, "__name__", fn),
                timeout,
            )
    return await thread

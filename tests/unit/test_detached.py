"""The two event-loop helpers of the worker's hot path, held to the library calls they
replace: ``runledger.worker.runs.detached`` to ``asyncio.shield`` of a task (the writes
and the tools), ``runledger.flows._within`` to an ``asyncio.timeout`` scope (every tool,
lookup and policy call with a timeout). Each outcome is compared with the library's own
in the same case; then what each saves is counted in turns of the event loop, on the
standard loop and on uvloop, the worker's default."""

from __future__ import annotations

import asyncio
import gc
import sys
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from runledger.flows import _within
from runledger.worker.runs import detached

Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a coroutine to its end on a new loop of the kind named, and fails on any
    error the loop reports (an exception of a task nobody retrieved among them)."""

    def on(main: Coroutine[Any, Any, Any]) -> Any:
        loop = uvloop.new_event_loop() if request.param == "uvloop" else asyncio.new_event_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: reported.append(context))
        try:
            value = loop.run_until_complete(main)
            loop.run_until_complete(asyncio.sleep(0))
            gc.collect()  # an exception never retrieved is reported when its task goes
            loop.run_until_complete(asyncio.sleep(0))
        finally:
            loop.close()
        assert reported == []
        return value

    return on


class Boom(Exception):
    pass


async def _value() -> str:
    await asyncio.sleep(0)
    return "value"


async def _fails() -> str:
    await asyncio.sleep(0)
    raise Boom("boom")


async def shielded(coro: Coroutine[Any, Any, Any]) -> tuple[asyncio.Task[Any], Awaitable[Any]]:
    task = asyncio.ensure_future(coro)
    return task, asyncio.shield(task)


async def detaching(coro: Coroutine[Any, Any, Any]) -> tuple[asyncio.Task[Any], Awaitable[Any]]:
    return detached(coro)


WAYS = {"shield": shielded, "detached": detaching}


@pytest.mark.parametrize("way", WAYS)
def test_the_caller_gets_the_value_or_the_exception(run: Run, way: str) -> None:
    async def main() -> list[str]:
        seen = []
        for make in (_value, _fails):
            task, answer = await WAYS[way](make())
            try:
                seen.append(await answer)
            except Boom as exc:
                seen.append(f"raised {exc}")
            assert task.done()
        return seen

    assert run(main()) == ["value", "raised boom"]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("ends", ["value", "raises"])
def test_a_cancelled_caller_stops_waiting_and_the_task_goes_on(
    run: Run, way: str, ends: str
) -> None:
    """As a fenced run's write: the caller raises CancelledError at once, the task ends
    later with its own outcome, for whoever tracks it."""

    async def main() -> tuple[bool, str]:
        release = asyncio.Event()

        async def work() -> str:
            await release.wait()
            if ends == "raises":
                raise Boom("late")
            return "late value"

        task: asyncio.Task[Any] | None = None

        async def caller() -> None:
            nonlocal task
            task, answer = await WAYS[way](work())
            await answer

        waiting = asyncio.ensure_future(caller())
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert task is not None
        running = not task.done()
        release.set()
        try:
            return running, await task
        except Boom as exc:
            return running, f"raised {exc}"

    expected = "late value" if ends == "value" else "raised late"
    assert run(main()) == (True, expected)


@pytest.mark.parametrize("way", WAYS)
def test_an_exception_answered_then_a_cancel_leaves_it_on_the_task(run: Run, way: str) -> None:
    """The work fails, then the caller is cancelled before it resumes: the caller raises
    CancelledError, and the task itself still carries the failure (a plain def tool's
    late result must see it, not a value of None)."""

    async def main() -> str:
        task: asyncio.Task[Any] | None = None
        answered = asyncio.Event()

        async def work() -> str:
            await asyncio.sleep(0)
            answered.set()
            raise Boom("failed first")

        async def caller() -> None:
            nonlocal task
            task, answer = await WAYS[way](work())
            await answer

        waiting = asyncio.ensure_future(caller())
        await answered.wait()
        await asyncio.sleep(0)  # the work has ended; its answer is on the way to the caller
        waiting.cancel()
        outcome = "cancelled"
        try:
            await waiting
        except asyncio.CancelledError:
            pass
        except Boom:
            outcome = "raised"
        assert task is not None and task.done()
        assert isinstance(task.exception(), Boom)
        return outcome

    assert run(main()) in ("cancelled", "raised")


@pytest.mark.parametrize("way", WAYS)
def test_a_task_cancelled_before_its_first_step_cancels_the_answer(run: Run, way: str) -> None:
    """As the loop's shutdown cancels every task: the caller is not left waiting, and the
    work, which never ran, is closed without a 'never awaited' warning."""

    async def main() -> str:
        task, answer = await WAYS[way](_value())
        task.cancel()
        try:
            return str(await asyncio.wait_for(answer, 5))
        except asyncio.CancelledError:
            return "cancelled"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited: a RuntimeWarning
        assert run(main()) == "cancelled"


@pytest.mark.parametrize("way", WAYS)
def test_a_task_still_pending_when_its_loop_closes_goes_quietly(way: str) -> None:
    """The loop closed under a pending task: collected, its coroutines are closed
    (GeneratorExit), and nothing may be set on the closed loop's futures meanwhile."""
    raised: list[BaseException | None] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: raised.append(u.exc_value)
    try:
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(lambda _, context: raised.append(context.get("exception")))

        async def caller() -> Any:
            _, answer = await WAYS[way](asyncio.sleep(10))
            return await answer

        waiting = loop.create_task(caller())
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
        del waiting
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [e for e in raised if e is not None] == []


def turns_to_resume(way: str) -> Callable[[], Coroutine[Any, Any, int]]:
    """Turns of the loop between the work's last step and its caller's next one."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        turns = 0
        counting = True

        def tick() -> None:
            nonlocal turns
            turns += 1
            if counting:
                loop.call_soon(tick)

        ended = 0

        async def work() -> None:
            nonlocal ended
            await asyncio.sleep(0)
            ended = turns

        _, answer = await WAYS[way](work())
        loop.call_soon(tick)
        await answer
        counting = False
        return turns - ended

    return main


def test_the_caller_resumes_one_turn_sooner_than_behind_a_shield(run: Run) -> None:
    assert run(turns_to_resume("shield")()) - run(turns_to_resume("detached")()) == 1


# -- _within and asyncio.timeout ------------------------------------------------------


async def _slow(log: list[str]) -> str:
    try:
        await asyncio.sleep(5)
    finally:
        log.append("unwound")
    return "slow"


async def _quick(log: list[str]) -> str:
    log.append("ran")
    return "quick"


def _on_cancel(then: str) -> Callable[[list[str]], Awaitable[str]]:
    """A work that waits and, cancelled, returns a value ("swallowed") or raises another
    error ("converted")."""

    async def work(log: list[str]) -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            log.append(then)
            if then == "converted":
                raise Boom("instead") from None
            return then
        return "slow"

    work.__name__ = f"_{then}"
    return work


_swallows, _converts = _on_cancel("swallowed"), _on_cancel("converted")


async def scoped(coro: Awaitable[Any], timeout: float) -> Any:
    async with asyncio.timeout(timeout):
        return await coro


LIMITS = {"asyncio.timeout": scoped, "_within": _within}


async def _yields_once(log: list[str]) -> str:
    await asyncio.sleep(0)
    log.append("yielded")
    return "yielded"


async def outcome(
    limit: str, work: Callable[[list[str]], Awaitable[Any]], timeout: float = 0.02
) -> tuple[Any, ...]:
    """What the caller sees (an exception's type and its cause's), what the work did
    before the caller saw it, and the task's count of cancellations afterwards."""
    log: list[str] = []
    task = asyncio.current_task()
    assert task is not None
    try:
        seen: Any = await LIMITS[limit](work(log), timeout)
    except BaseException as exc:
        seen = (type(exc).__name__, type(exc.__cause__).__name__)
    return seen, list(log), task.cancelling()


@pytest.mark.parametrize("work", [_slow, _quick, _swallows, _converts])
def test_within_ends_as_a_timeout_scope_does(run: Run, work: Any) -> None:
    async def main() -> list[tuple[Any, ...]]:
        return [await outcome(limit, work) for limit in LIMITS]

    by_scope, by_within = run(main())
    assert by_within == by_scope
    expected = {
        _slow: (("TimeoutError", "CancelledError"), ["unwound"], 0),
        _quick: ("quick", ["ran"], 0),
        _swallows: ("swallowed", ["swallowed"], 0),
        _converts: (("Boom", "NoneType"), ["converted"], 0),
    }[work]
    assert by_within == expected


@pytest.mark.parametrize("timeout", [0, -1])
def test_a_deadline_already_past_cancels_before_the_ready_callbacks(
    run: Run, timeout: float
) -> None:
    """A work that yields once: its next step is ready at once, but the scope's
    cancellation comes first."""

    async def main() -> list[tuple[Any, ...]]:
        return [await outcome(limit, _yields_once, timeout) for limit in LIMITS]

    by_scope, by_within = run(main())
    assert by_within == by_scope == (("TimeoutError", "CancelledError"), [], 0)


@pytest.mark.parametrize("limit", LIMITS)
def test_a_cancellation_from_outside_stays_a_cancellation(run: Run, limit: str) -> None:
    async def main() -> tuple[str, list[str]]:
        log: list[str] = []
        waiting = asyncio.ensure_future(LIMITS[limit](_slow(log), 5))
        await asyncio.sleep(0.01)
        waiting.cancel()
        try:
            await waiting
        except BaseException as exc:
            return type(exc).__name__, log
        return "returned", log

    assert run(main()) == ("CancelledError", ["unwound"])

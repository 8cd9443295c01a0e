"""``runledger.worker.runs.stepped``: how the worker awaits an async tool, in the run's own
task with a context of its own. Held to what a task of its own gave the tool (its
context, the value or the exception, a cancellation thrown in where it waits), and to
what it saves: a tool that does not wait is done without a turn of the event loop, where
a task of its own takes two. On the standard loop and on uvloop, the worker's default."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from runledger.worker.runs import detached, stepped

Run = Callable[[Coroutine[Any, Any, Any]], Any]

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_stepped", default="unset")


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    def on(main: Coroutine[Any, Any, Any]) -> Any:
        loop = uvloop.new_event_loop() if request.param == "uvloop" else asyncio.new_event_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: reported.append(context))
        try:
            return loop.run_until_complete(main)
        finally:
            loop.close()
            assert reported == []

    return on


class Boom(Exception):
    pass


async def _no_wait() -> str:
    return "done"


async def _waits(then: str = "value") -> str:
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    if then == "raise":
        raise Boom("boom")
    return then


async def _turns_taken(awaiting: Callable[[], Any]) -> int:
    """Turns of the event loop that pass while the caller awaits ``awaiting()``."""
    turns = 0
    stop = False

    def tick() -> None:
        nonlocal turns
        if not stop:
            turns += 1
            asyncio.get_running_loop().call_soon(tick)

    asyncio.get_running_loop().call_soon(tick)
    await asyncio.sleep(0)  # the ticker runs once: it counts from here
    before = turns
    await awaiting()
    stop = True
    return turns - before


def test_a_tool_that_does_not_wait_takes_no_turn_of_the_loop(run: Run) -> None:
    async def through_stepped() -> Any:
        return await stepped(contextvars.copy_context(), _no_wait())

    async def through_a_task() -> Any:
        return await detached(_no_wait())[1]

    assert run(_turns_taken(through_stepped)) == 0
    assert run(_turns_taken(through_a_task)) == 2  # the task's first step, then its answer


@pytest.mark.parametrize("then", ["value", "raise"])
def test_the_caller_gets_the_value_or_the_exception(run: Run, then: str) -> None:
    async def main() -> Any:
        try:
            return await stepped(contextvars.copy_context(), _waits(then))
        except Boom as exc:
            return exc

    got = run(main())
    if then == "raise":
        assert isinstance(got, Boom)
    else:
        assert got == "value"


def test_the_coroutine_runs_in_its_own_context_as_in_a_task_of_its_own(run: Run) -> None:
    seen: list[str] = []

    async def work() -> None:
        seen.append(VAR.get())  # what the context held when it was copied
        VAR.set("set by the tool")
        await asyncio.sleep(0)
        seen.append(VAR.get())  # its own setting, across a wait

    async def main() -> tuple[str, str]:
        VAR.set("the run's")
        context = contextvars.copy_context()
        VAR.set("changed by the run after the copy")
        await stepped(context, work())
        return VAR.get(), context[VAR]

    assert run(main()) == ("changed by the run after the copy", "set by the tool")
    assert seen == ["the run's", "set by the tool"]


def test_the_coroutine_runs_as_the_callers_task(run: Run) -> None:
    async def whose() -> asyncio.Task[Any] | None:
        await asyncio.sleep(0)
        return asyncio.current_task()

    async def main() -> bool:
        return await stepped(contextvars.copy_context(), whose()) is asyncio.current_task()

    assert run(main()) is True


def test_a_cancellation_of_the_task_is_thrown_in_where_the_coroutine_waits(run: Run) -> None:
    happened: list[str] = []

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            happened.append("cancelled where it waited")
            raise
        finally:
            happened.append("unwound")

    async def main() -> str:
        async def caller() -> None:
            await stepped(contextvars.copy_context(), work())

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "the caller is cancelled"
        return "the caller went on"

    assert run(main()) == "the caller is cancelled"
    assert happened == ["cancelled where it waited", "unwound"]


def test_a_wait_closed_before_it_is_resumed_closes_the_coroutine(run: Run) -> None:
    closed: list[str] = []

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            closed.append(VAR.get())

    async def main() -> None:
        context = contextvars.copy_context()
        context.run(VAR.set, "its own context")
        waiting = stepped(context, work())
        waiting.send(None)  # it waits, on the sleep's future
        waiting.close()  # never resumed: a task collected after its loop closed

    run(main())
    assert closed == ["its own context"]

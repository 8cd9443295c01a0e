"""Helpers for the integration tests: a real Worker running as an asyncio task in the
test's own event loop, flows defined by the tests, a fresh database per test.

Everything waits on a condition with a deadline (:func:`eventually`); nothing sleeps
and hopes. Reads go through one async connection (superuser, autocommit) so the
worker in the same loop keeps running while a test waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, LiteralString

import psycopg
import pytest_asyncio
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from runledger.flows import Flow
from runledger.worker.crash import CrashPoints
from runledger.worker.executor import Limits
from runledger.worker.process import Worker

# Fast retries so that backoff never dominates a test; everything else as shipped.
FAST = Limits(backoff=0.01, max_backoff=0.05)
DEADLINE = 15.0


async def eventually(
    predicate: Callable[[], Any],
    timeout: float = DEADLINE,
    interval: float = 0.02,
    what: str = "",
) -> Any:
    """Poll ``predicate`` (sync or async) until truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what or predicate} (last value {last!r})"
            )
        await asyncio.sleep(interval)


@dataclass
class Recorder:
    """What the flow code of a test saw: policy turns and histories, tool invocations."""

    policy_turns: list[int] = field(default_factory=list)
    histories: dict[int, list[Any]] = field(default_factory=dict)
    tool_calls: list[tuple[str, str, int, int]] = field(
        default_factory=list
    )  # tool,key,attempt,token
    lookups: list[str] = field(default_factory=list)
    threads: dict[str, set[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def policy(self, ctx: Any, history: list[Any]) -> None:
        with self.lock:
            self.policy_turns.append(ctx.turn)
            self.histories[ctx.turn] = list(history)

    def tool(self, ctx: Any) -> None:
        with self.lock:
            self.tool_calls.append((ctx.tool, ctx.idempotency_key, ctx.attempt, ctx.fencing_token))
            self.threads.setdefault(ctx.tool, set()).add(threading.get_ident())

    def calls_of(self, tool: str) -> list[tuple[str, str, int, int]]:
        return [c for c in self.tool_calls if c[0] == tool]


class Db:
    """Reads (and the few admin writes a test needs) over one async connection."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn

    async def rows(self, sql: LiteralString, *params: Any) -> list[dict[str, Any]]:
        cur = await self.conn.execute(sql, params)
        return await cur.fetchall() if cur.description else []

    async def run(self, run_id: str) -> dict[str, Any]:
        rows = await self.rows("SELECT * FROM runledger.runs WHERE run_id = %s", run_id)
        assert rows, f"no run {run_id}"
        return rows[0]

    async def calls(self, run_id: str) -> list[dict[str, Any]]:
        return await self.rows(
            "SELECT * FROM runledger.run_calls WHERE run_id = %s ORDER BY turn, position", run_id
        )

    async def turns(self, run_id: str) -> list[dict[str, Any]]:
        return await self.rows(
            "SELECT * FROM runledger.run_turns WHERE run_id = %s ORDER BY turn", run_id
        )

    async def events(self, run_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        return await self.rows(
            "SELECT * FROM runledger.run_events WHERE run_id = %s "
            "AND (%s::text IS NULL OR kind = %s) ORDER BY event_id",
            run_id,
            kind,
            kind,
        )

    async def kinds(self, run_id: str) -> list[str]:
        return [e["kind"] for e in await self.events(run_id)]

    async def ledger(self, run_id: str) -> list[dict[str, Any]]:
        return await self.rows(
            "SELECT * FROM runledger.effect_ledger WHERE run_id = %s ORDER BY turn, call_id",
            run_id,
        )

    async def submit(
        self,
        run_id: str,
        flow: Flow,
        input: dict[str, Any] | None = None,
        version: str | None = None,
    ) -> None:
        rows = await self.rows(
            "SELECT * FROM runledger.submit_run(%s, %s, %s, %s)",
            run_id,
            flow.name,
            version or flow.version,
            Jsonb(input or {}),
        )
        assert rows[0]["created"] is True

    async def wait_status(
        self, run_id: str, *statuses: str, timeout: float = DEADLINE
    ) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            r = await self.run(run_id)
            return r if r["status"] in statuses else None

        run: dict[str, Any] = await eventually(
            check, timeout=timeout, what=f"run {run_id} in {statuses}"
        )
        return run


@pytest_asyncio.fixture
async def db(database_url: str) -> AsyncIterator[Db]:
    conn = await psycopg.AsyncConnection.connect(
        database_url, autocommit=True, row_factory=dict_row
    )
    try:
        yield Db(conn)
    finally:
        await conn.close()


class RunningWorker:
    """A :class:`Worker` driven by a task of the test's loop."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.task: asyncio.Task[None] = asyncio.create_task(worker.run(), name=worker.worker_id)
        self._stop_requested = False

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    async def started(self) -> None:
        """Wait until the worker has registered (its store is open)."""
        await eventually(
            lambda: self.worker.store is not None or self.task.done(), what="worker start"
        )
        if self.task.done():
            self.task.result()  # surface a start failure

    def request_stop(self) -> None:
        # Worker.request_stop exits the process on its second call: call it once only.
        if not self._stop_requested:
            self._stop_requested = True
            self.worker.request_stop()

    async def stop(self, timeout: float = 20.0) -> None:
        self.request_stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except TimeoutError:
            # what the worker still waits on, for the failure's message
            stacks = "\n".join(_describe(t) for t in asyncio.all_tasks() if not t.done())
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
            raise AssertionError(
                f"worker {self.worker_id} did not stop within {timeout} s; tasks:\n{stacks}"
            ) from None


def _describe(task: asyncio.Task[Any]) -> str:
    frames = [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in task.get_stack()]
    coro = task.get_coro()
    while coro is not None and getattr(coro, "cr_await", None) is not None:
        coro = coro.cr_await  # the coroutine chain below the task's own frame
        frame = getattr(coro, "cr_frame", None)
        if frame is not None:
            frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
    return f"  {task.get_name()}: " + " -> ".join(frames)


StartWorker = Callable[..., Awaitable[RunningWorker]]


@pytest_asyncio.fixture
async def start_worker(database_url: str) -> AsyncIterator[StartWorker]:
    """``await start_worker(flow, ..., worker_id=..., limits=..., **worker_kwargs)``."""
    running: list[RunningWorker] = []

    async def start(
        *flows: Flow, worker_id: str | None = None, limits: Limits = FAST, **kwargs: Any
    ) -> RunningWorker:
        kwargs.setdefault("poll_seconds", 0.05)
        kwargs.setdefault("lease_seconds", 30.0)
        kwargs.setdefault("grace_seconds", 2.0)
        w = Worker(
            database_url=database_url,
            flows=list(flows),
            worker_id=worker_id or f"it-worker-{len(running) + 1}",
            limits=limits,
            crash=CrashPoints(None),
            **kwargs,
        )
        rw = RunningWorker(w)
        running.append(rw)
        await rw.started()
        return rw

    try:
        yield start
    finally:
        errors: list[BaseException] = []
        for rw in running:
            try:
                await rw.stop()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

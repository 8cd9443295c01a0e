"""The worker's internals are supervised, and its catch-all hands runs back.

- A lease keeper or listener that dies of an unexpected exception stops the whole
  worker (before, the task died silently and the worker went on without self-fencing):
  its runs are cancelled locally and handed back, nothing more is claimed, and
  ``Worker.run`` raises ``WorkerFailed``.
- An unexpected error inside the executor (a bug, the database gone) releases the
  lease at once instead of leaving the run stuck until the lease expires. (Once
  ``Store.release_lease(..., reason=, error=)`` is merged, also assert the
  ``lease_released`` event's detail ``{"reason": "worker_error", "error": ...}``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, LiteralString

import pytest
import pytest_asyncio

from runledger.flows import Flow, ToolCall
from runledger.worker import process
from runledger.worker.crash import CrashPoints
from runledger.worker.process import Worker, WorkerFailed
from tests.integration.conftest import FAST, Db, Recorder, StartWorker, eventually


def _gated_flow(rec: Recorder, gate: asyncio.Event, cancelled: list[str]) -> Flow:
    flow = Flow("supervised", "1")

    @flow.tool(safety="idempotent")
    async def act(ctx: Any) -> dict[str, Any]:
        rec.tool(ctx)
        try:
            if ctx.attempt == 1:
                await gate.wait()
        except asyncio.CancelledError:
            cancelled.append(ctx.idempotency_key)
            raise
        return {"attempt": ctx.attempt}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("act", {})]

    return flow


def _once(error: BaseException, then: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in that raises ``error`` on its first call, then behaves as ``then``."""
    calls = 0

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise error
        return then(*args, **kwargs)

    return stand_in


OwnWorker = Callable[[Flow], tuple[Worker, asyncio.Task[None]]]


@pytest_asyncio.fixture
async def own_worker(database_url: str) -> AsyncIterator[OwnWorker]:
    """A Worker run as a task that the test expects to fail (the harness's fixture
    would report its WorkerFailed at teardown)."""
    tasks: list[asyncio.Task[None]] = []

    def make(flow: Flow) -> tuple[Worker, asyncio.Task[None]]:
        w = Worker(
            database_url=database_url,
            flows=[flow],
            worker_id="doomed",
            limits=FAST,
            crash=CrashPoints(None),
            poll_seconds=0.05,
            lease_seconds=3.0,  # the keeper renews every second
            grace_seconds=2.0,
        )
        task = asyncio.create_task(w.run(), name="doomed")
        tasks.append(task)
        return w, task

    yield make
    for t in tasks:
        if not t.done():
            t.cancel()
        with contextlib.suppress(BaseException):
            await t


async def test_a_dead_lease_keeper_stops_the_worker_and_fences_its_runs(
    db: Db,
    own_worker: OwnWorker,
    start_worker: StartWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec, gate, cancelled = Recorder(), asyncio.Event(), []
    flow = _gated_flow(rec, gate, cancelled)
    w, task = own_worker(flow)
    await eventually(lambda: w.store is not None, what="worker start")
    await db.submit("sup-1", flow)
    await eventually(lambda: rec.calls_of("act"), what="the call in flight")

    assert w.store is not None
    store = w.store
    with caplog.at_level(logging.CRITICAL, logger="runledger.worker.process"):
        w.store.renew_leases = _once(  # type: ignore[method-assign]
            RuntimeError("bug in the keeper"), store.renew_leases
        )
        await eventually(task.done, what="the worker to stop")

    with pytest.raises(WorkerFailed) as failed:
        task.result()
    assert failed.value.task == "lease-keeper"
    assert isinstance(failed.value.error, RuntimeError)
    [line] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert "lease-keeper" in line.getMessage() and "bug in the keeper" in line.getMessage()

    # the run was fenced locally (its tool cancelled) and handed back, not advanced
    assert cancelled == ["sup-1:0:c0"]
    run = await db.run("sup-1")
    assert (run["status"], run["lease_id"], run["fencing_token"]) == ("queued", None, 1)
    [call] = await db.calls("sup-1")
    assert (call["status"], call["attempts"], call["completed_token"]) == ("dispatched", 1, None)
    assert await db.turns("sup-1") and len(await db.turns("sup-1")) == 1
    # and the worker is gone: it claims nothing more
    worker_row = await db.rows(
        "SELECT stopped_at FROM runledger.workers WHERE worker_id = 'doomed'"
    )
    assert worker_row[0]["stopped_at"] is not None

    # the next worker recovers the call in flight: same key, next attempt
    gate.set()
    await start_worker(flow)
    done = await db.wait_status("sup-1", "succeeded", "failed", "paused")
    assert done["status"] == "succeeded"
    assert rec.calls_of("act") == [("act", "sup-1:0:c0", 1, 1), ("act", "sup-1:0:c0", 2, 2)]
    [call] = await db.calls("sup-1")
    assert call["completed_by"] == "it-worker-1"


async def test_a_listener_bug_stops_the_worker(
    db: Db, own_worker: OwnWorker, start_worker: StartWorker
) -> None:
    rec, gate, cancelled = Recorder(), asyncio.Event(), []
    gate.set()
    flow = _gated_flow(rec, gate, cancelled)

    class Flows(dict[str, Flow]):
        def __contains__(self, key: object) -> bool:
            raise RuntimeError("bug in the listener")

    w, task = own_worker(flow)
    await eventually(lambda: w.store is not None, what="worker start")
    w.flows = Flows(w.flows)  # the listener checks each notification against it
    await db.submit("sup-2", flow)  # NOTIFY runledger_runs

    async def notified_and_stopped() -> bool:
        # a notification that reached the connection before the listener iterated may not
        # be delivered to it: notify again until the listener has seen one
        if not task.done():
            await db.rows("SELECT pg_notify('runledger_runs', 'any@1')")
        return task.done()

    await eventually(notified_and_stopped, interval=0.05, what="the worker to stop")
    with pytest.raises(WorkerFailed) as failed:
        task.result()
    assert failed.value.task == "listener"

    await start_worker(flow)
    done = await db.wait_status("sup-2", "succeeded", "failed", "paused")
    assert done["status"] == "succeeded"
    [call] = await db.calls("sup-2")
    assert call["completed_by"] == "it-worker-1"


async def test_an_unexpected_error_in_the_executor_releases_the_lease(
    db: Db, start_worker: StartWorker, caplog: pytest.LogCaptureFixture
) -> None:
    rec, gate, cancelled = Recorder(), asyncio.Event(), []
    gate.set()
    flow = _gated_flow(rec, gate, cancelled)
    rw = await start_worker(flow)  # leases of 30 s: an expired lease would time out here
    assert rw.worker.store is not None
    store = rw.worker.store
    # the tool's effect happened, then recording it fails with something unexpected (a
    # result committed alone goes through complete_checked)
    store.complete_checked = _once(  # type: ignore[method-assign]
        RuntimeError("database gone"), store.complete_checked
    )
    with caplog.at_level(logging.ERROR, logger="runledger.worker.executor"):
        await db.submit("sup-3", flow)
        done = await db.wait_status("sup-3", "succeeded", "failed", "paused")
    assert done["status"] == "succeeded"
    assert any(r.getMessage() == "run failed in the worker" for r in caplog.records)

    kinds = [(e["kind"], e["fencing_token"]) for e in await db.events("sup-3")]
    released = kinds.index(("lease_released", 1))
    assert kinds[released + 1] == ("claimed", 2)  # handed back, not taken over after expiry
    assert ("takeover", 2) not in kinds
    # the hand-back says why, so an operator sees the bug in the timeline
    event = (await db.events("sup-3", "lease_released"))[0]
    assert event["detail"]["reason"] == "worker_error"
    assert event["detail"]["error"]["type"] == "RuntimeError"
    assert "database gone" in event["detail"]["error"]["message"]
    # the tool had returned: its send was released with its result (revision 0031), and
    # the next holder journaled that result rather than send the call again
    [told] = await db.events("sup-3", "send_released")
    assert told["detail"]["ended"] == "returned" and told["detail"]["sender_token"] == 1
    assert rec.calls_of("act") == [("act", "sup-3:0:c0", 1, 1)]
    [call] = await db.calls("sup-3")
    assert (call["status"], call["attempts"], call["completed_token"]) == ("succeeded", 1, 2)
    assert call["result"] == told["detail"]["result"] == {"attempt": 1}


# -- the registration lives on the listener's session ---------------------------------

# Superuser-only test instrumentation: which backend ran register_worker, by pid.
NOTE_REGISTRATIONS: list[LiteralString] = [
    "CREATE TABLE public.registrations (n serial, pid int, worker_id text)",
    """CREATE FUNCTION public.note_registration() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
           IF strpos(current_query(), 'register_worker') > 0 THEN
               INSERT INTO public.registrations (pid, worker_id)
               VALUES (pg_backend_pid(), NEW.worker_id);
           END IF;
           RETURN NEW;
       END $$""",
    "CREATE TRIGGER note_registration AFTER INSERT OR UPDATE ON runledger.workers"
    " FOR EACH ROW EXECUTE FUNCTION public.note_registration()",
]
REGISTRATIONS: LiteralString = (
    "SELECT pid FROM public.registrations WHERE worker_id = %s ORDER BY n"
)
LISTENERS: LiteralString = (
    "SELECT pid FROM pg_stat_activity WHERE application_name = 'runledger-listener:' || %s"
)


async def test_the_worker_registers_on_its_listener_session_and_again_after_reconnecting(
    db: Db, start_worker: StartWorker
) -> None:
    for statement in NOTE_REGISTRATIONS:
        await db.rows(statement)
    rec, gate, cancelled = Recorder(), asyncio.Event(), []
    gate.set()
    flow = _gated_flow(rec, gate, cancelled)
    await start_worker(flow, worker_id="reg-1")

    [first] = [r["pid"] for r in await db.rows(LISTENERS, "reg-1")]
    # registered from the backend that LISTENs: the registration is that session's
    assert [r["pid"] for r in await db.rows(REGISTRATIONS, "reg-1")] == [first]

    await db.rows("SELECT pg_terminate_backend(%s)", first)

    async def reregistered() -> list[int]:
        pids = [r["pid"] for r in await db.rows(REGISTRATIONS, "reg-1")]
        return pids if len(pids) == 2 else []

    _, second = await eventually(reregistered, what="the registration on the new listener")
    assert second != first
    assert [r["pid"] for r in await db.rows(LISTENERS, "reg-1")] == [second]
    # and the worker goes on: woken by NOTIFY on its new session
    await db.submit("reg-run", flow)
    done = await db.wait_status("reg-run", "succeeded", "failed", "paused")
    assert done["status"] == "succeeded"


def _helper(name: str) -> asyncio.Task[Any]:
    """The task of this loop's worker that runs ``Worker._guard(name, ...)``."""
    for task in asyncio.all_tasks():
        frame = getattr(task.get_coro(), "cr_frame", None)
        guard = frame is not None and frame.f_code.co_name == "_guard"
        if guard and frame.f_locals["name"] == name:
            return task
    raise AssertionError(f"no {name} task")


@pytest.mark.parametrize(
    ("helper", "statement"),
    [("lease-keeper", "heartbeat_worker"), ("checkpointer", "checkpoint_events")],
)
async def test_a_helper_stops_when_cancelled_as_its_statement_returns(
    start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch, helper: str, statement: str
) -> None:
    """The lease keeper and the checkpointer loop until they are cancelled. On Python 3.11
    ``asyncio.wait_for`` returns the result of an operation that completed as its task
    was cancelled, swallowing the cancel: a helper that timed its statement with it went
    on forever when the worker's stop cancelled it right as the statement came back (CI
    saw a worker that did not stop). Here each statement cancels its helper as it
    returns: the helper must end."""
    monkeypatch.setattr(process, "CHECKPOINT_EVERY", 0.3)
    flow = Flow("kept", "1")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return []

    w = await start_worker(flow, worker_id="helped", lease_seconds=0.9)  # keeper every 0.3 s
    await w.started()
    task = _helper(helper)
    store = w.worker.store
    assert store is not None
    registry = store.registry  # heartbeat_worker, checkpoint_events
    real = getattr(registry, statement)
    returned: list[bool] = []

    async def cancels_the_helper(*args: Any, **kwargs: Any) -> Any:
        value = await real(*args, **kwargs)
        returned.append(True)
        task.cancel()  # the stop's cancel, arriving as the statement completes
        return value

    monkeypatch.setattr(registry, statement, cancels_the_helper)
    done, _ = await asyncio.wait({task}, timeout=10)
    assert task in done, f"{helper} went on after {len(returned)} cancelled statements"
    assert task.cancelled() and returned == [True]


@pytest.mark.parametrize(
    ("helper", "statement"),
    [("lease-keeper", "heartbeat_worker"), ("checkpointer", "checkpoint_events")],
)
async def test_a_helper_stops_when_a_callee_swallows_its_cancel(
    start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch, helper: str, statement: str
) -> None:
    """As Python 3.11's ``asyncio.wait_for`` does (psycopg_pool's ``getconn`` uses it), a
    callee that gets the cancel as its wait completes returns its result and drops the
    CancelledError: the request stays counted, and the helper must still end (CI saw a
    worker whose checkpointer went on after its stop)."""
    monkeypatch.setattr(process, "CHECKPOINT_EVERY", 0.3)
    flow = Flow("swallowed", "1")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return []

    w = await start_worker(flow, worker_id="swallowed", lease_seconds=0.9)
    await w.started()
    task = _helper(helper)
    store = w.worker.store
    assert store is not None
    registry = store.registry
    real = getattr(registry, statement)
    swallowed: list[bool] = []

    async def swallows_the_cancel(*args: Any, **kwargs: Any) -> Any:
        value = await real(*args, **kwargs)
        if not swallowed:
            task.cancel()  # the stop's cancel, arriving as the wait completes ...
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:  # ... and dropped, as wait_for does on 3.11
                swallowed.append(True)
        return value

    monkeypatch.setattr(registry, statement, swallows_the_cancel)
    done, _ = await asyncio.wait({task}, timeout=10)
    assert swallowed == [True]
    assert task in done, f"{helper} went on after its cancel was swallowed"
    assert task.cancelled()

"""A connection lost during COMMIT leaves the outcome unknown: the store reads the row
back and neither repeats a write that landed nor gives up on one that did not.

The fault is injected at the client boundary: the statement really runs on the real
database (``landed=True``, the COMMIT went through and only its acknowledgement was
lost) or is never sent (``landed=False``), then the client is told the connection
dropped. Every write method with every outcome word is one row of ``CASES``; each row
states what the method returns and what the tables show once it returned: the write
applied exactly once (one event, attempts counted once, the status the SQL function
leaves).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from runledger import errors
from runledger.db.execution import Executor
from runledger.db.store import Store
from runledger.model import ClaimedRun

Conn = psycopg.Connection[Any]
RUN = "amb-1"
KEY = "amb-1:0:c1"
LEASE = dt.timedelta(seconds=60)


class FlakyExecutor(Executor):
    """Fails the first statement that starts with ``prefix``: after running it
    (``landed=True``, a lost COMMIT acknowledgement) or before (``landed=False``).
    ``meanwhile`` runs between the failure and the store's next statement: another
    actor moving the row while the client did not know the outcome."""

    def __init__(
        self,
        pool: Any,
        prefix: str,
        landed: bool,
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(pool, backoff=0.01)
        self.prefix = prefix
        self.landed = landed
        self.meanwhile = meanwhile
        self.sent: list[str] = []

    async def rows(self, sql: Any, params: Sequence[Any]) -> list[dict[str, Any]]:
        text = str(sql)
        self.sent.append(text)
        if self.prefix and text.startswith(self.prefix):
            self.prefix = ""
            if self.landed:
                await super().rows(sql, params)
            if self.meanwhile is not None:
                self.meanwhile()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await super().rows(sql, params)


class FlakyStore(Store):
    """Both stores over a :class:`FlakyExecutor` on ``pool``."""

    def __init__(
        self,
        pool: Any,
        prefix: str,
        landed: bool,
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        self.flaky = FlakyExecutor(pool, prefix, landed, meanwhile)
        super().__init__(self.flaky)

    @property
    def sent(self) -> list[str]:
        return self.flaky.sent


# -- starting points ---------------------------------------------------------------------


async def leased(store: Store) -> ClaimedRun:
    await store.worker.submit_run(RUN, "demo", "1", {"x": 1})
    ((claim, _),) = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 1)
    return claim


async def planned(store: Store) -> ClaimedRun:
    claim = await leased(store)
    lease = (claim.run_id, claim.lease_id, claim.fencing_token)
    await store.worker.record_turn(*lease, 0, [{"call_id": "c1", "tool": "t", "args": {}}])
    return claim


async def dispatched(store: Store) -> ClaimedRun:
    claim = await planned(store)
    await store.worker.dispatch_call(claim.run_id, claim.lease_id, claim.fencing_token, KEY)
    return claim


NEXT = "amb-1:0:c2"


async def two_planned(store: Store) -> ClaimedRun:
    claim = await leased(store)
    lease = (claim.run_id, claim.lease_id, claim.fencing_token)
    calls = [{"call_id": "c1", "tool": "t", "args": {}}, {"call_id": "c2", "tool": "t"}]
    await store.worker.record_turn(*lease, 0, calls)
    await store.worker.dispatch_call(*lease, KEY)
    return claim


async def paused_unknown(store: Store) -> ClaimedRun:
    claim = await dispatched(store)
    lease = (claim.run_id, claim.lease_id, claim.fencing_token)
    await store.worker.complete_call(*lease, KEY, "unknown", {"error": "timeout"}, None)
    await store.worker.finish_run(*lease, "paused", None, "reconcile")
    return claim


async def finished(store: Store, status: str) -> ClaimedRun:
    claim = await leased(store)
    await store.worker.finish_run(
        claim.run_id, claim.lease_id, claim.fencing_token, status, None, "x"
    )
    return claim


async def failed(store: Store) -> ClaimedRun:
    return await finished(store, "failed")


async def paused(store: Store) -> ClaimedRun:
    return await finished(store, "paused")


async def succeeded(store: Store) -> ClaimedRun:
    return await finished(store, "succeeded")


async def nothing(store: Store) -> None:
    return None


# -- what the tables show ------------------------------------------------------------------


def call_row(conn: Conn, key: str = KEY) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT status, attempts, dispatched_token, completed_token, result, receipt, error,"
            " resolved_by, provider_id FROM runledger.run_calls WHERE idempotency_key = %s",
            (key,),
        )
        row = cur.fetchone()
    assert row is not None
    return row


DECISION_RECORD: dict[str, Any] = {
    "role": "assistant",
    "content": [{"type": "text", "text": "¿listo? ✓"}, {"type": "tool_use", "id": "toolu_1"}],
}


def turn_row(conn: Conn) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT calls, record, output FROM runledger.run_turns WHERE run_id = %s AND turn = 0",
            (RUN,),
        )
        row = cur.fetchone()
    assert row is not None
    return row


def run_row(conn: Conn) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT status, state_version, state, lease_id, result, error, pause_reason"
            " FROM runledger.runs WHERE run_id = %s",
            (RUN,),
        )
        row = cur.fetchone()
    assert row is not None
    return row


def event_counts(conn: Conn) -> dict[str, int]:
    rows = conn.execute(
        "SELECT kind, count(*) FROM runledger.run_events WHERE run_id = %s GROUP BY kind",
        (RUN,),
    ).fetchall()
    return {kind: n for kind, n in rows}


# -- the table -------------------------------------------------------------------------------

Act = Callable[[Store, Any], Awaitable[Any]]


def lease_of(c: ClaimedRun) -> tuple[str, Any, int]:
    return (c.run_id, c.lease_id, c.fencing_token)


@dataclass(frozen=True)
class Case:
    id: str
    function: str  # the statement the fault hits: "SELECT [* FROM ]runledger.<function>("
    setup: Callable[[Store], Awaitable[Any]]
    act: Act
    returns: Any = None
    call: dict[str, Any] = field(default_factory=dict)  # columns of the call row
    next_call: dict[str, Any] = field(default_factory=dict)  # columns of the call NEXT
    run: dict[str, Any] = field(default_factory=dict)  # columns of the run row
    turn: dict[str, Any] = field(default_factory=dict)  # columns of turn 0
    events: dict[str, int] = field(default_factory=dict)  # the events the write wrote
    runs: int | None = None  # rows left in runledger.runs
    repeatable: bool = False  # sent again without a read-back: a no-op by contract

    @property
    def prefix(self) -> str:
        if self.function in ROW_FUNCTIONS:
            return f"SELECT * FROM runledger.{self.function}("
        return f"SELECT runledger.{self.function}("


# functions that return a row, selected FROM
ROW_FUNCTIONS = frozenset({"record_turn_v4"})


def complete(outcome: str, result: Any, receipt: Any) -> Act:
    return lambda s, c: s.worker.complete_call(*lease_of(c), KEY, outcome, result, receipt)


def finish(status: str, result: Any, reason: str | None) -> Act:
    return lambda s, c: s.worker.finish_run(*lease_of(c), status, result, reason)


def resolve(resolution: str, receipt: Any) -> Act:
    return lambda s, c: s.operator.resolve_call(KEY, resolution, receipt, "alice", "checked")


CASES = [
    Case(
        "dispatch_call",
        "dispatch_call",
        planned,
        lambda s, c: s.worker.dispatch_call(*lease_of(c), KEY),
        returns=1,
        call={"status": "dispatched", "attempts": 1, "dispatched_token": 1},
        events={"call_dispatched": 1},
    ),
    Case(
        # the same lease sends an in-flight call again (an idempotent tool's retry)
        "dispatch_call-again",
        "dispatch_call",
        dispatched,
        lambda s, c: s.worker.dispatch_call(*lease_of(c), KEY, attempts_seen=1),
        returns=2,
        call={"status": "dispatched", "attempts": 2, "dispatched_token": 1},
        events={"call_dispatched": 1},
    ),
    Case(
        "complete_call-succeeded",
        "complete_call",
        dispatched,
        complete("succeeded", {"ok": 1}, {"id": 9}),
        call={
            "status": "succeeded",
            "attempts": 1,
            "completed_token": 1,
            "result": {"ok": 1},
            "receipt": {"id": 9},
            "error": None,
        },
        events={"call_succeeded": 1},
    ),
    Case(
        "complete_call-failed",
        "complete_call",
        dispatched,
        complete("failed", {"error": "refused"}, None),
        call={
            "status": "failed",
            "attempts": 1,
            "completed_token": 1,
            "error": {"error": "refused"},
        },
        events={"call_failed": 1},
    ),
    Case(
        "complete_call-unknown",
        "complete_call",
        dispatched,
        complete("unknown", {"error": "timeout"}, None),
        call={
            "status": "unknown",
            "attempts": 1,
            "completed_token": 1,
            "error": {"error": "timeout"},
        },
        events={"call_unknown": 1},
    ),
    Case(
        # not_applied puts the call back to planned: attempts and dispatch fields stay,
        # the completion fields are cleared
        "complete_call-not_applied",
        "complete_call",
        dispatched,
        complete("not_applied", {"reason": "declined"}, None),
        call={
            "status": "planned",
            "attempts": 1,
            "dispatched_token": 1,
            "completed_token": None,
            "receipt": None,
            "error": {"reason": "declined"},
        },
        events={"call_not_applied": 1},
    ),
    Case(
        "checkpoint",
        "checkpoint",
        leased,
        lambda s, c: s.worker.checkpoint(*lease_of(c), 0, {"turn": (1, 2)}),
        returns=1,
        run={"state_version": 1, "state": {"turn": [1, 2]}},
        events={"checkpoint": 1},
    ),
    Case(
        # the fast path (0008): the decision, the checkpoint before it, one transaction
        "record_turn-checkpoint",
        "record_turn_v4",
        leased,
        lambda s, c: s.worker.record_turn(
            *lease_of(c),
            0,
            [{"call_id": "c1", "tool": "t", "args": {}, "provider_id": "toolu_1"}],
            record=DECISION_RECORD,
            expected_version=0,
            state={"completed_turns": 0},
        ),
        returns=(1, ()),
        call={"status": "planned", "attempts": 0, "provider_id": "toolu_1"},
        run={"state_version": 1, "state": {"completed_turns": 0}, "status": "running"},
        turn={"record": DECISION_RECORD, "output": None},
        events={"checkpoint": 1, "turn_recorded": 1},
    ),
    Case(
        # 0009: the decision and the dispatch of its first calls, one transaction
        "record_turn_v4-dispatch",
        "record_turn_v4",
        leased,
        lambda s, c: s.worker.record_turn(
            *lease_of(c),
            0,
            [{"call_id": "c1", "tool": "t", "args": {}}],
            expected_version=0,
            state={"completed_turns": 0},
            dispatch=["c1"],
        ),
        returns=(1, (1,)),
        call={"status": "dispatched", "attempts": 1},
        run={"state_version": 1, "state": {"completed_turns": 0}, "status": "running"},
        events={"checkpoint": 1, "turn_recorded": 1, "call_dispatched": 1},
    ),
    Case(
        "record_turn-no-state",
        "record_turn_v4",
        leased,
        lambda s, c: s.worker.record_turn(
            *lease_of(c), 0, [{"call_id": "c1", "tool": "t"}], expected_version=0
        ),
        returns=(0, ()),
        call={"status": "planned", "attempts": 0},
        run={"state_version": 0, "state": None},
        events={"turn_recorded": 1},
    ),
    Case(
        # the final decision ends the run: sent again, it would meet a lease that is gone
        "record_turn-final",
        "record_turn_v4",
        leased,
        lambda s, c: s.worker.record_turn(
            *lease_of(c),
            0,
            [],
            record=DECISION_RECORD,
            output=["ok"],
            expected_version=0,
            state={"completed_turns": 0},
            finish=True,
        ),
        returns=(1, ()),
        run={"status": "succeeded", "lease_id": None, "result": ["ok"], "state_version": 1},
        turn={"calls": [], "record": DECISION_RECORD, "output": ["ok"]},
        events={"checkpoint": 1, "turn_recorded": 1, "run_succeeded": 1},
    ),
    Case(
        # a result and the next call's dispatch, one transaction
        "complete_call_v2-succeeded",
        "complete_call_v2",
        two_planned,
        lambda s, c: s.worker.complete_and_dispatch(
            *lease_of(c),
            KEY,
            "succeeded",
            {"ok": 1},
            {"id": 9},
            next_key=NEXT,
            next_attempts_seen=0,
        ),
        returns=1,
        call={
            "status": "succeeded",
            "attempts": 1,
            "completed_token": 1,
            "result": {"ok": 1},
            "receipt": {"id": 9},
        },
        next_call={"status": "dispatched", "attempts": 1, "dispatched_token": 1},
        events={"call_succeeded": 1, "call_dispatched": 1},
    ),
    Case(
        "complete_call_v2-failed",
        "complete_call_v2",
        two_planned,
        lambda s, c: s.worker.complete_and_dispatch(
            *lease_of(c),
            KEY,
            "failed",
            {"error": "refused"},
            None,
            next_key=NEXT,
            next_attempts_seen=0,
        ),
        returns=1,
        call={"status": "failed", "completed_token": 1, "error": {"error": "refused"}},
        next_call={"status": "dispatched", "attempts": 1, "dispatched_token": 1},
        events={"call_failed": 1, "call_dispatched": 1},
    ),
    Case(
        "finish_run-succeeded",
        "finish_run",
        leased,
        finish("succeeded", {"done": True}, None),
        run={"status": "succeeded", "lease_id": None, "result": {"done": True}},
        events={"run_succeeded": 1},
    ),
    Case(
        "finish_run-failed",
        "finish_run",
        leased,
        finish("failed", {"code": 3}, "boom"),
        run={"status": "failed", "lease_id": None, "error": {"reason": "boom", "code": 3}},
        events={"run_failed": 1},
    ),
    Case(
        "finish_run-paused",
        "finish_run",
        leased,
        finish("paused", None, "waiting"),
        run={"status": "paused", "lease_id": None, "pause_reason": "waiting"},
        events={"run_paused": 1},
    ),
    Case(
        "release_lease",
        "release_lease",
        leased,
        lambda s, c: s.worker.release_lease(*lease_of(c)),
        run={"status": "queued", "lease_id": None},
        events={"lease_released": 1},
    ),
    Case(
        "resolve_call-applied",
        "resolve_call",
        paused_unknown,
        resolve("applied", {"ticket": "T-1"}),
        call={"status": "succeeded", "receipt": {"ticket": "T-1"}, "resolved_by": "alice"},
        run={"status": "queued"},
        events={"call_resolved": 1, "run_requeued": 1},
    ),
    Case(
        # not_applied also returns the call to planned, to be dispatched again
        "resolve_call-not_applied",
        "resolve_call",
        paused_unknown,
        resolve("not_applied", None),
        call={"status": "planned", "attempts": 1, "resolved_by": "alice"},
        run={"status": "queued"},
        events={"call_resolved": 1, "run_requeued": 1},
    ),
    Case(
        "resolve_call-abandoned",
        "resolve_call",
        paused_unknown,
        resolve("abandoned", None),
        call={"status": "failed", "resolved_by": "alice"},
        run={"status": "queued"},
        events={"call_resolved": 1, "run_requeued": 1},
    ),
    Case(
        "retry_run-failed",
        "retry_run",
        failed,
        lambda s, c: s.operator.retry_run(RUN, "alice"),
        run={"status": "queued", "error": None},
        events={"run_requeued": 1},
    ),
    Case(
        "retry_run-paused",
        "retry_run",
        paused,
        lambda s, c: s.operator.retry_run(RUN, "alice"),
        run={"status": "queued", "pause_reason": None},
        events={"run_requeued": 1},
    ),
    Case(
        "cancel_run",
        "cancel_run",
        dispatched,
        lambda s, c: s.operator.cancel_run(RUN, "alice", "stop"),
        call={"status": "unknown"},
        run={"status": "cancelled", "lease_id": None},
        events={"run_cancelled": 1},
        repeatable=True,
    ),
    Case(
        # keep_events: the pruned run's events stay, so the count of them is checkable
        "prune_runs",
        "prune_runs",
        succeeded,
        lambda s, c: s.operator.prune_runs(dt.datetime.now(dt.UTC) + dt.timedelta(days=1), True),
        returns=1,
        runs=0,
    ),
]


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-sent"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_a_write_applies_once_after_a_lost_acknowledgement(
    store: Store, admin_conn: Conn, case: Case, landed: bool
) -> None:
    ctx = await case.setup(store)
    before = event_counts(admin_conn)
    flaky = FlakyStore(store.executor.pool, case.prefix, landed)

    assert await case.act(flaky, ctx) == case.returns

    sends = [s for s in flaky.sent if s.startswith(case.prefix)]
    # landed: read back, not sent again (a repeatable write is sent again, a no-op)
    assert len(sends) == (1 if landed and not case.repeatable else 2)
    if case.call:
        row = call_row(admin_conn)
        assert {k: row[k] for k in case.call} == case.call
    if case.next_call:
        row = call_row(admin_conn, NEXT)
        assert {k: row[k] for k in case.next_call} == case.next_call
    if case.run:
        row = run_row(admin_conn)
        assert {k: row[k] for k in case.run} == case.run
    if case.turn:
        row = turn_row(admin_conn)
        assert {k: row[k] for k in case.turn} == case.turn
    if case.runs is not None:
        assert admin_conn.execute("SELECT count(*) FROM runledger.runs").fetchone() == (case.runs,)
    after = event_counts(admin_conn)
    written = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert written == case.events  # exactly these events, each once


async def test_submit_run_creates_the_run_once_after_a_lost_acknowledgement(
    store: Store, admin_conn: Conn
) -> None:
    flaky = FlakyStore(store.executor.pool, "SELECT * FROM runledger.submit_run(", landed=True)
    submitted = await flaky.worker.submit_run(RUN, "demo", "1", {"x": 1})
    assert submitted.run_id == RUN
    assert admin_conn.execute("SELECT count(*) FROM runledger.runs").fetchone() == (1,)
    assert event_counts(admin_conn) == {"submitted": 1}


# -- another actor moves the row while the outcome is unknown --------------------------------


def sql(conn: Conn, statement: Any) -> Callable[[], object]:
    return lambda: conn.execute(statement)


async def test_a_finished_pause_counts_although_an_operator_requeued_the_run(
    store: Store, admin_conn: Conn
) -> None:
    claim = await leased(store)
    flaky = FlakyStore(
        store.executor.pool,
        "SELECT runledger.finish_run(",
        landed=True,
        meanwhile=sql(admin_conn, "SELECT runledger.retry_run('amb-1', 'op')"),
    )
    await flaky.worker.finish_run(*lease_of(claim), "paused", None, "waiting")  # no LeaseLost
    assert run_row(admin_conn)["status"] == "queued"
    assert event_counts(admin_conn)["run_paused"] == 1


async def test_a_release_that_did_not_land_is_not_mistaken_for_a_cancel(
    store: Store, admin_conn: Conn
) -> None:
    claim = await leased(store)
    flaky = FlakyStore(
        store.executor.pool,
        "SELECT runledger.release_lease(",
        landed=False,
        meanwhile=sql(admin_conn, "SELECT runledger.cancel_run('amb-1', 'op', NULL)"),
    )
    with pytest.raises(errors.LeaseLost):
        await flaky.worker.release_lease(*lease_of(claim))
    assert "lease_released" not in event_counts(admin_conn)


async def test_a_retry_that_did_not_land_is_not_mistaken_for_a_cancel(
    store: Store, admin_conn: Conn
) -> None:
    await paused(store)
    flaky = FlakyStore(
        store.executor.pool,
        "SELECT runledger.retry_run(",
        landed=False,
        meanwhile=sql(admin_conn, "SELECT runledger.cancel_run('amb-1', 'op', NULL)"),
    )
    with pytest.raises(errors.InvalidTransition):
        await flaky.operator.retry_run(RUN, "alice")
    assert "run_requeued" not in event_counts(admin_conn)

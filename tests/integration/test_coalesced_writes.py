"""Write coalescing (runledger.db.coalesce): the completions and decisions that several
runs send at the same moment share one statement and one commit, and each write still
gets its own answer.

Shared commits are read from the rows themselves: rows written by one transaction carry
its id (``xmin``). Every write goes through a store as a worker opens it
(``coalesce_writes``); the first of a burst finds nothing in flight and is sent alone,
the others queue behind it and go together. A burst is made deterministic with a lock:
the first write waits for a run row another connection holds until the others are
queued (on a loaded machine a write can otherwise come back before the next one is
even sent, and there is nothing to share).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
import pytest_asyncio

from runledger import errors
from runledger.db import coalesce
from runledger.db.execution import Executor
from runledger.db.store import Store
from runledger.model import ClaimedRun
from tests.integration.conftest import eventually

LEASE = dt.timedelta(seconds=60)
CALLS = [{"call_id": "c0", "tool": "t", "args": {}}, {"call_id": "c1", "tool": "t", "args": {}}]

Conn = psycopg.AsyncConnection[Any]


@pytest.fixture(autouse=True)
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write sent at once keeps its place in flight until it returns: on a loaded
    machine a plain write can take longer than SLOW_SECONDS, and the test's burst would
    split. The tests that are about the release set it back."""
    monkeypatch.setattr(coalesce, "SLOW_SECONDS", 60.0)


@pytest_asyncio.fixture
async def coalescing(database_url: str) -> Any:
    s = await Store.connect(database_url, max_size=8)
    s.worker.coalesce_writes()
    try:
        yield s
    finally:
        await s.close()


async def until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.005)


class Held:
    """A run row locked by another connection (``FOR UPDATE``) until ``release``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: Conn | None = None

    async def hold(self, run: ClaimedRun) -> Held:
        self.conn = await psycopg.AsyncConnection.connect(self.url)
        await self.conn.execute(
            "SELECT 1 FROM runledger.runs WHERE run_id = %s FOR UPDATE", (run.run_id,)
        )
        return self

    async def release(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await conn.rollback()
            await conn.close()


async def burst(url: str, coalescer: coalesce.Coalescer, first: ClaimedRun, *aws: Any) -> list[Any]:
    """Send ``aws`` at once: the first (a write of ``first``) is sent alone and waits
    for ``first``'s row, held here until the others are queued behind it."""
    held = await Held(url).hold(first)
    try:
        tasks = [asyncio.ensure_future(a) for a in aws]
        await until(lambda: coalescer.queued == len(tasks) - 1, "the others queued")
    finally:
        await held.release()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


async def claimed(store: Store, prefix: str, n: int) -> list[ClaimedRun]:
    for i in range(n):
        await store.worker.submit_run(f"{prefix}-{i}", "demo", "1", {})
    runs = [run for run, _ in await store.worker.claim_runs("w1", ["demo@1"], LEASE, n)]
    return sorted(runs, key=lambda c: c.run_id)


async def decided(
    store: Store, url: str, runs: Sequence[ClaimedRun]
) -> list[tuple[int, tuple[int, ...]]]:
    """Each run's first decision, two calls, c0 dispatched with it: one burst."""
    _, decisions = store.worker.coalescers
    return await burst(
        url,
        decisions,
        runs[0],
        *(
            store.worker.record_turn(
                c.run_id,
                c.lease_id,
                c.fencing_token,
                0,
                CALLS,
                expected_version=c.state_version,
                dispatch=["c0"],
            )
            for c in runs
        ),
    )


async def decided_runs(
    store: Store, url: str, prefix: str, n: int
) -> tuple[list[ClaimedRun], coalesce.Coalescer]:
    """``n`` runs claimed and decided, with the store's completions coalescer."""
    runs = await claimed(store, prefix, n)
    await decided(store, url, runs)
    completions, _ = store.worker.coalescers
    return runs, completions


def advance(store: Store, c: ClaimedRun, *, token: int | None = None) -> Any:
    """c0's result and c1's dispatch (complete_call_v2)."""
    return store.worker.complete_and_dispatch(
        c.run_id,
        c.lease_id,
        c.fencing_token if token is None else token,
        f"{c.run_id}:0:c0",
        "succeeded",
        {"ok": True},
        None,
        next_key=f"{c.run_id}:0:c1",
        next_attempts_seen=0,
    )


async def xmins(conn: Conn, prefix: str, call_id: str) -> dict[str, int]:
    cur = await conn.execute(
        "SELECT run_id, xmin::text::bigint FROM runledger.run_calls "
        "WHERE run_id LIKE %s AND call_id = %s",
        (f"{prefix}-%", call_id),
    )
    return {r: x for r, x in await cur.fetchall()}


async def calls(conn: Conn, prefix: str) -> list[tuple[str, str, str, int]]:
    cur = await conn.execute(
        "SELECT run_id, call_id, status, attempts FROM runledger.run_calls "
        "WHERE run_id LIKE %s ORDER BY run_id, call_id",
        (f"{prefix}-%",),
    )
    return list(await cur.fetchall())


async def event_counts(conn: Conn, prefix: str) -> dict[tuple[str, str], int]:
    cur = await conn.execute(
        "SELECT run_id, kind, count(*) FROM runledger.run_events WHERE run_id LIKE %s "
        "AND kind LIKE 'call_%%' GROUP BY 1, 2",
        (f"{prefix}-%",),
    )
    return {(r, k): n for r, k, n in await cur.fetchall()}


@pytest_asyncio.fixture
async def reader(database_url: str) -> Any:
    conn = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


async def test_writes_sent_together_share_one_commit(
    coalescing: Store, reader: Conn, database_url: str
) -> None:
    runs = await claimed(coalescing, "co", 4)
    completions, decisions = coalescing.worker.coalescers
    assert await decided(coalescing, database_url, runs) == [(0, (1,))] * 4
    first = await xmins(reader, "co", "c0")
    assert first[runs[0].run_id] not in {first[c.run_id] for c in runs[1:]}
    assert len({first[c.run_id] for c in runs[1:]}) == 1  # the three queued: one commit

    assert (
        await burst(database_url, completions, runs[0], *(advance(coalescing, c) for c in runs))
        == [1] * 4
    )
    # a complete_call_v2 writes both rows: this call's result, the next one's dispatch
    done, sent = await xmins(reader, "co", "c0"), await xmins(reader, "co", "c1")
    assert done == sent
    assert len({done[c.run_id] for c in runs[1:]}) == 1
    assert done[runs[0].run_id] != done[runs[1].run_id]

    # the last call of a turn: complete_call, coalesced as well
    await burst(
        database_url,
        completions,
        runs[0],
        *(
            coalescing.worker.complete_checked(
                c.run_id,
                c.lease_id,
                c.fencing_token,
                coalescing.worker.completion(f"{c.run_id}:0:c1", "succeeded", {"i": 1}, None),
            )
            for c in runs
        ),
    )
    last = await xmins(reader, "co", "c1")
    assert len({last[c.run_id] for c in runs[1:]}) == 1

    assert [(c.batches, c.batched, c.failed) for c in (completions, decisions)] == [
        (2, 6, 0),
        (1, 3, 0),
    ]
    # each write applied once: every call succeeded at its first attempt, one event each
    assert await calls(reader, "co") == [
        (c.run_id, call, "succeeded", 1) for c in runs for call in ("c0", "c1")
    ]
    assert set((await event_counts(reader, "co")).values()) == {2}


# JSON whose text needs the escapes of an array element: quotes, backslashes, braces,
# commas, spaces, the word NULL, non-ASCII
AWKWARD = [
    {"q": 'say "hi"', "b": "C:\\dir\\", "both": '\\"', "br": "{a,b} NULL", "u": "é ✓ \n"},
    ["NULL", "", " ", '"', "\\", None],
    'a "string" \\ with {braces}, commas',
    None,
]


async def journal_awkward(store: Store, url: str, prefix: str) -> list[tuple[Any, ...]]:
    """A decision and a completion of each AWKWARD value (args, record, state, result,
    receipt) for one run each, sent at once, and what the tables hold of them."""
    runs = await claimed(store, prefix, len(AWKWARD) + 1)
    values: list[Any] = [{"first": True}, *AWKWARD]
    objects = [v if isinstance(v, dict) else {"v": v} for v in values]

    async def together(coalescer: coalesce.Coalescer | None, aws: list[Any]) -> None:
        if coalescer is None:  # no coalescing: one after the other
            for a in aws:
                await a
        else:
            await burst(url, coalescer, runs[0], *aws)

    completions, decisions = store.worker.coalescers or (None, None)
    await together(
        decisions,
        [
            store.worker.record_turn(
                c.run_id,
                c.lease_id,
                c.fencing_token,
                0,
                [{"call_id": "c0", "tool": "t", "args": {"v": v}}],
                record=o,
                expected_version=c.state_version,
                state=o,
                dispatch=["c0"],
            )
            for c, v, o in zip(runs, values, objects, strict=True)
        ],
    )
    await together(
        completions,
        [
            store.worker.complete_checked(
                c.run_id,
                c.lease_id,
                c.fencing_token,
                store.worker.completion(f"{c.run_id}:0:c0", "succeeded", v, o),
            )
            for c, v, o in zip(runs, values, objects, strict=True)
        ],
    )
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT c.result, c.result IS NULL, c.receipt, c.args, t.calls, t.record, r.state "
            "FROM runledger.run_calls c JOIN runledger.run_turns t USING (run_id, turn) "
            "JOIN runledger.runs r USING (run_id) WHERE c.run_id LIKE %s ORDER BY c.run_id",
            (f"{prefix}-%",),
        )
        return list(await cur.fetchall())


async def test_json_values_in_a_batch_arrive_as_sent(coalescing: Store, database_url: str) -> None:
    batched = await journal_awkward(coalescing, database_url, "cj")
    completions, decisions = coalescing.worker.coalescers
    assert (decisions.batches, decisions.batched) == (1, len(AWKWARD))
    assert (completions.batches, completions.batched) == (1, len(AWKWARD))
    assert [r[0] for r in batched] == [{"first": True}, *AWKWARD]
    plain = await Store.connect(database_url, max_size=2)
    try:
        alone = await journal_awkward(plain, database_url, "ck")
    finally:
        await plain.close()
    assert batched == alone  # the same values as written one by one, SQL NULL included


async def test_a_refused_write_in_a_batch_is_refused_alone(
    coalescing: Store, reader: Conn, database_url: str
) -> None:
    runs, completions = await decided_runs(coalescing, database_url, "cr", 3)
    # the first is sent alone; the stale one (a token that is not its lease's) and the
    # live one after it are a batch, which the refusal rolls back
    results = await burst(
        database_url,
        completions,
        runs[0],
        advance(coalescing, runs[0]),
        advance(coalescing, runs[1], token=runs[1].fencing_token + 1),
        advance(coalescing, runs[2]),
    )
    assert results[0] == 1 and results[2] == 1
    assert isinstance(results[1], errors.LeaseLost)
    assert (completions.batches, completions.failed) == (0, 1)
    assert await calls(reader, "cr") == [
        (runs[0].run_id, "c0", "succeeded", 1),
        (runs[0].run_id, "c1", "dispatched", 1),
        (runs[1].run_id, "c0", "dispatched", 1),  # untouched
        (runs[1].run_id, "c1", "planned", 0),
        (runs[2].run_id, "c0", "succeeded", 1),
        (runs[2].run_id, "c1", "dispatched", 1),
    ]


async def test_a_locked_run_does_not_hold_up_the_others(
    coalescing: Store, reader: Conn, database_url: str
) -> None:
    runs, completions = await decided_runs(coalescing, database_url, "cl", 3)
    first, other = await Held(database_url).hold(runs[0]), await Held(database_url).hold(runs[1])
    try:
        tasks = [asyncio.ensure_future(advance(coalescing, c)) for c in runs]
        await until(lambda: completions.queued == 2, "two queued behind the first")
        await first.release()
        # the batch of the locked run and the third gives up on the lock (LOCK_TIMEOUT);
        # the third lands alone while the locked one waits by itself
        assert await asyncio.wait_for(tasks[0], 10) == 1
        assert await asyncio.wait_for(tasks[2], 10) == 1
        assert not tasks[1].done()
        assert completions.failed == 1
    finally:
        await first.release()
        await other.release()
    assert await asyncio.wait_for(tasks[1], 10) == 1
    assert [s for _, c, s, _ in await calls(reader, "cl") if c == "c0"] == ["succeeded"] * 3


async def waiting_batches(conn: Conn) -> bool:
    """A batch statement of completions waits for a lock (pg_stat_activity)."""
    cur = await conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE 'SELECT q.o, q.attempt%%'"
    )
    row = await cur.fetchone()
    return row is not None and row[0] == 1


async def test_closing_the_store_lets_a_batch_in_flight_land(
    database_url: str, reader: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coalesce, "LOCK_TIMEOUT", "30s")  # the batch waits for the lock
    store = await Store.connect(database_url, max_size=8)
    store.worker.coalesce_writes()
    closing: asyncio.Future[None] | None = None
    try:
        runs, completions = await decided_runs(store, database_url, "cc", 3)
        first = await Held(database_url).hold(runs[0])
        other = await Held(database_url).hold(runs[1])
        try:
            tasks = [asyncio.ensure_future(advance(store, c)) for c in runs]
            await until(lambda: completions.queued == 2, "two queued behind the first")
            await first.release()
            assert await asyncio.wait_for(tasks[0], 10) == 1
            # the batch of the other two is in flight, waiting for the held run
            await eventually(lambda: waiting_batches(reader), timeout=10, what="the batch waiting")
            closing = asyncio.ensure_future(store.close())
            done, _ = await asyncio.wait({closing}, timeout=0.5)
            assert not done, "the store closed with a batch in flight"
        finally:
            await first.release()
            await other.release()
        await asyncio.wait_for(closing, 10)
        # answered by the database before the pool closed, each applied once
        assert all(t.done() for t in tasks)
        assert [t.result() for t in tasks[1:]] == [1, 1]
        assert (completions.batches, completions.batched, completions.failed) == (1, 2, 0)
        assert not completions._senders
        assert [s for _, c, s, _ in await calls(reader, "cc") if c == "c0"] == ["succeeded"] * 3
    finally:
        if closing is None:
            await store.close()


async def test_a_write_sent_at_once_that_waits_for_a_lock_gives_up_its_place(
    coalescing: Store, reader: Conn, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs, completions = await decided_runs(coalescing, database_url, "cs", 3)
    monkeypatch.setattr(coalesce, "SLOW_SECONDS", 0.2)
    held = await Held(database_url).hold(runs[0])
    try:
        # one step of the loop: the first is sent at once and waits for the held row,
        # the two others queue behind it
        tasks = [asyncio.ensure_future(advance(coalescing, c)) for c in runs]
        # they go together once the first has waited SLOW_SECONDS
        assert await asyncio.wait_for(asyncio.gather(*tasks[1:]), 10) == [1, 1]
        assert not tasks[0].done()
    finally:
        await held.release()
    assert await asyncio.wait_for(tasks[0], 10) == 1
    assert (completions.batches, completions.batched, completions.failed) == (1, 2, 0)
    moved = await xmins(reader, "cs", "c0")
    assert moved[runs[1].run_id] == moved[runs[2].run_id] != moved[runs[0].run_id]


async def test_a_write_past_the_slow_limit_gives_its_place_to_the_next_write_at_once(
    coalescing: Store, reader: Conn, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No write waits queued in the meantime, so no timer gives the place back: the next
    write that wants it finds the first has held it past SLOW_SECONDS, and is sent at
    once, alone, rather than queued for a batch."""
    runs, completions = await decided_runs(coalescing, database_url, "cg", 2)
    monkeypatch.setattr(coalesce, "SLOW_SECONDS", 0.2)
    batches: list[int] = []  # batch statements of any size, a batch of one included
    send_batch = completions._send_batch

    async def counted(writes: list[Any]) -> None:
        batches.append(len(writes))
        await send_batch(writes)

    monkeypatch.setattr(completions, "_send_batch", counted)
    held = await Held(database_url).hold(runs[0])
    try:
        first = asyncio.ensure_future(advance(coalescing, runs[0]))
        await until(lambda: completions._busy == 1, "the first sent at once")
        await asyncio.sleep(0.3)  # the first write is past SLOW_SECONDS, still waiting
        assert not first.done()
        assert await asyncio.wait_for(advance(coalescing, runs[1]), 10) == 1
        assert not first.done()
        assert completions.queued == 0
    finally:
        await held.release()
    assert await asyncio.wait_for(first, 10) == 1
    assert batches == []  # the second went alone, not queued for a batch of one
    assert (completions.batches, completions.batched, completions.failed) == (0, 0, 0)
    moved = await xmins(reader, "cg", "c0")
    assert moved[runs[0].run_id] != moved[runs[1].run_id]


async def test_a_write_sent_at_once_sets_no_timer(
    coalescing: Store, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The place of a write sent at once is checked when another write wants it; a timer
    is set only once a write waits queued (the test before this one's release)."""
    runs, completions = await decided_runs(coalescing, database_url, "ct", 1)
    loop = asyncio.get_running_loop()
    timers: list[str] = []  # the coalescer's: the pool may set its own

    def counting(real: Any) -> Any:
        def call(when: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
            name = getattr(callback, "__qualname__", "")
            if name.startswith(coalesce.Coalescer.__name__):
                timers.append(name)
            return real(when, callback, *args, **kwargs)

        return call

    for name in ("call_later", "call_at"):
        monkeypatch.setattr(loop, name, counting(getattr(loop, name)))
    assert await advance(coalescing, runs[0]) == 1
    assert timers == []
    assert completions._busy == 0 and not completions._alone_since


class LosesBatchesExecutor(Executor):
    """Fails the first batch statement as a dropped connection: after it ran
    (``landed``: only the COMMIT's acknowledgement was lost) or before it was sent."""

    landed: bool | None = True

    async def rows(self, sql: Any, params: Sequence[Any]) -> list[dict[str, Any]]:
        if str(sql).startswith("SELECT q.o, q.attempt") and self.landed is not None:
            landed, self.landed = self.landed, None
            if landed:
                await super().rows(sql, params)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await super().rows(sql, params)


@pytest.mark.parametrize("landed", [True, False], ids=["commit-landed", "never-sent"])
async def test_a_batch_lost_in_flight_is_read_back(
    database_url: str, reader: Conn, landed: bool
) -> None:
    plain = await Store.connect(database_url, max_size=8)
    losing = LosesBatchesExecutor(plain.executor.pool, backoff=0.01)
    losing.landed = landed
    store = Store(losing)
    store.worker.coalesce_writes()
    try:
        prefix = f"cb{int(landed)}"
        runs, completions = await decided_runs(store, database_url, prefix, 3)
        assert (
            await burst(database_url, completions, runs[0], *(advance(store, c) for c in runs))
            == [1] * 3
        )
        assert losing.landed is None  # the batch was lost
        assert completions.failed == 1
        # applied exactly once either way: one result, one dispatch of the next call
        assert await calls(reader, prefix) == [
            (c.run_id, call, status, 1)
            for c in runs
            for call, status in (("c0", "succeeded"), ("c1", "dispatched"))
        ]
        # c0 dispatched with the decision; c0's result and c1's dispatch once each
        assert await event_counts(reader, prefix) == {
            (c.run_id, kind): n
            for c in runs
            for kind, n in (("call_dispatched", 2), ("call_succeeded", 1))
        }
    finally:
        await store.close()

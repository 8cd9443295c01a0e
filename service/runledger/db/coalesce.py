"""Write coalescing: the journal writes of several runs in one statement, one commit.

A worker drives many runs at once, and each of their writes is a transaction of its own:
on PostgreSQL most of a small write's cost is the statement and the transaction around
the function (parse and bind, executor start, the snapshot, the commit and its WAL
flush), not the function's body. So the writes that are ready at the same moment go
together: while one write of a kind (the completions, the decisions) is in flight, the
writes of that kind that other runs send meanwhile wait in a queue, and when it returns
they go as one statement, each run's function called in turn, in run id order. A write
that finds nothing in flight is sent at once, as before: a lone run (one worker,
concurrency 1) waits for nobody. Like PostgreSQL's group commit, the batch grows with
the load and costs no waiting when there is none.

Nothing of the protocol changes. Each write is the same contract function with the same
arguments, checks and lease check; what the runs share is only the transaction, and a
caller returns once the commit that holds its write is done, before its run's next step.

A batch is all or nothing, so a batch that fails is never a verdict on its writes: each
is then sent again alone by its own caller, through the store's usual path (its own
statement on the caller's connection, retries and SQLSTATE mapping), and gets its own
answer (a refused write its own ``LeaseLost``, the others their results). When the
connection was lost with the batch in flight (its commit may have landed), each write's
read-back is asked first, after the usual backoff, as for any write.
The batch waits at most ``LOCK_TIMEOUT`` for a lock (``SET LOCAL`` for its transaction):
a run locked by someone else (an operator's transaction, a renewal behind a lock) must
not hold up the other runs' writes, so the batch gives up and its writes go alone, the
locked one waiting by itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, LiteralString, TypeVar, cast

import psycopg
from psycopg.types.json import Jsonb, JsonbDumper

from runledger.db import wire
from runledger.db.execution import Executor
from runledger.db.rows import Row
from runledger.db.sqlstate import is_connection_error

log = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_MAX = 64  # writes per statement
LOCK_TIMEOUT = "200ms"  # a batch's longest wait for a lock before its writes go alone
SLOW_SECONDS = 0.2  # a write sent at once keeps its place in flight this long at most
CLOSE_SECONDS = 5.0  # how long closing the store waits for the batches in flight

# One statement per kind. The writes are the rows of unnest(); each row calls the
# function the write would have called alone, once, in run id order by the database's
# collation (the inner ORDER BY: PostgreSQL computes a volatile output column after the
# sort), the order renew_leases locks runs in, so the two never deadlock. The rows come
# back with their ordinal (o). lock_timeout is set for the statement's transaction before
# any function runs: the subquery's WHERE needs its row.
COMPLETIONS = wire.Prepared(
    "complete_many",
    "SELECT q.o, q.attempt FROM (SELECT u.o, CASE WHEN u.nk IS NULL THEN"
    " (SELECT NULL::int FROM runledger.complete_call(u.r, u.l, u.t, u.k, u.oc, u.res, u.rec))"
    " ELSE runledger.complete_call_v2(u.r, u.l, u.t, u.k, u.oc, u.res, u.rec, u.nk) END"
    " AS attempt"
    " FROM (SELECT pg_catalog.set_config('lock_timeout', $9::text, true) AS g) s,"
    " ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::uuid[]),"
    " pg_catalog.unnest($3::bigint[]), pg_catalog.unnest($4::text[]),"
    " pg_catalog.unnest($5::text[]), pg_catalog.unnest($6::jsonb[]),"
    " pg_catalog.unnest($7::jsonb[]), pg_catalog.unnest($8::text[]))"
    " WITH ORDINALITY AS u(r, l, t, k, oc, res, rec, nk, o)"
    " WHERE s.g IS NOT NULL ORDER BY u.r, u.o OFFSET 0) q ORDER BY q.o",
    9,
)
DECISIONS = wire.Prepared(
    "record_turn_many",
    "SELECT q.o, (q.x).state_version, (q.x).attempts FROM (SELECT u.o,"
    " runledger.record_turn_v4(u.r, u.l, u.t, u.n, u.c, u.rec, u.out, u.v, u.st, u.fin,"
    " ARRAY(SELECT pg_catalog.jsonb_array_elements_text(u.d))) AS x"
    " FROM (SELECT pg_catalog.set_config('lock_timeout', $12::text, true) AS g) s,"
    " ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::uuid[]),"
    " pg_catalog.unnest($3::bigint[]), pg_catalog.unnest($4::int[]),"
    " pg_catalog.unnest($5::jsonb[]), pg_catalog.unnest($6::jsonb[]),"
    " pg_catalog.unnest($7::jsonb[]), pg_catalog.unnest($8::bigint[]),"
    " pg_catalog.unnest($9::jsonb[]), pg_catalog.unnest($10::boolean[]),"
    " pg_catalog.unnest($11::jsonb[]))"
    " WITH ORDINALITY AS u(r, l, t, n, c, rec, out, v, st, fin, d, o)"
    " WHERE s.g IS NOT NULL ORDER BY u.r, u.o OFFSET 0) q ORDER BY q.o",
    12,
)


# what a write's future holds when its batch failed: the caller sends it alone
_ALONE = object()  # the batch was rolled back: it did not land
_AMBIGUOUS = object()  # the connection was lost with the batch in flight: it may have


@dataclass(slots=True)
class Write(Generic[T]):
    """One write: its batch row (the columns of its kind's statement), and what the
    store's own path needs to send it alone."""

    run_id: str
    row: tuple[Any, ...]
    sql: LiteralString | wire.Prepared  # the statement it is alone
    params: Sequence[Any]
    result: Callable[[list[Row]], T]
    landed: Callable[[], Awaitable[T | None]]
    fields: dict[str, Any]
    # its value, an error, or _ALONE / _AMBIGUOUS
    done: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Coalescer:
    """The writes of one kind (one batch statement) of one store: at most ``in_flight``
    statements of the kind out at a time, the writes sent meanwhile queued for the
    next batch."""

    def __init__(
        self, executor: Executor, kind: str, batch: wire.Prepared, *, in_flight: int = 1
    ) -> None:
        self.executor = executor
        self.kind = kind  # completions, decisions: the metrics' label
        self.batch = batch
        self.in_flight = in_flight
        self._queue: list[Write[Any]] = []
        self._busy = 0  # statements of this kind in flight (alone or batches)
        # the writes sent at once that hold a place in flight: a number of the write's
        # own (never reused, unlike id(): a timer may outlive its write) -> the loop's
        # time it was sent; a place held SLOW_SECONDS is given back
        self._alone_since: dict[int, float] = {}
        self._numbers = itertools.count()
        self._slow_timer: asyncio.TimerHandle | None = None
        self._senders: set[asyncio.Task[None]] = set()
        self.batches = 0  # statements of more than one write, for tests and metrics
        self.batched = 0  # writes sent in them
        self.failed = 0  # batches that failed, their writes sent alone

    @property
    def queued(self) -> int:
        """Writes waiting for the next batch."""
        return len(self._queue)

    async def send(self, write: Write[T]) -> T:
        loop = asyncio.get_running_loop()
        if self._alone_since and self._busy >= self.in_flight:
            self._give_back_slow(loop.time())
        if self._busy < self.in_flight and not self._queue:
            # room in flight: send it now, in the caller's context (its pinned
            # connection), exactly as without coalescing
            self._busy += 1
            # a write that waits (a lock another transaction holds) gives up its place
            # after SLOW_SECONDS: the other runs' writes do not wait behind it. Checked
            # when another write wants the place, and by one timer while writes are
            # queued: no timer per write
            key = next(self._numbers)
            self._alone_since[key] = loop.time()
            try:
                return await self._alone(write)
            finally:
                if self._alone_since.pop(key, None) is not None:
                    self._busy -= 1
                    self._start_sender()
        self._queue.append(write)
        self._start_sender()
        try:
            outcome = await asyncio.shield(write.done)
        except asyncio.CancelledError:
            if write in self._queue:  # not sent yet: it never will be
                self._queue.remove(write)
            raise
        if outcome is _ALONE or outcome is _AMBIGUOUS:
            # the batch failed: this write goes alone, from the caller's own task (its
            # pinned connection, no lock timeout), and gets its own answer
            if outcome is _AMBIGUOUS:
                # as Executor.execute does after a lost connection: wait, then read it back
                await asyncio.sleep(self.executor.backoff * (0.5 + random.random()))
                value = await write.landed()
                if value is not None:
                    log.info("the write landed before the connection dropped", extra=write.fields)
                    return value
            return await self._alone(write)
        return cast(T, outcome)

    async def _alone(self, write: Write[T]) -> T:
        return await self.executor.execute(
            write.sql, write.params, write.fields, write.result, write.landed
        )

    def _give_back_slow(self, now: float) -> None:
        """The places of the writes sent at once SLOW_SECONDS ago or more, given back."""
        for key, since in list(self._alone_since.items()):
            if now - since >= SLOW_SECONDS:
                del self._alone_since[key]
                self._busy -= 1

    def _slow_over(self, key: int) -> None:
        """The timer of the oldest write sent at once: its place is given back now."""
        self._slow_timer = None
        if self._alone_since.pop(key, None) is not None:
            self._busy -= 1
        self._start_sender()

    def _start_sender(self) -> None:
        if self._queue and self._busy >= self.in_flight and self._alone_since:
            loop = asyncio.get_running_loop()
            self._give_back_slow(loop.time())
            if self._busy >= self.in_flight and self._alone_since and self._slow_timer is None:
                # the queue waits for a write sent at once: until its place is given back
                key, first = min(self._alone_since.items(), key=lambda kv: kv[1])
                self._slow_timer = loop.call_at(first + SLOW_SECONDS, self._slow_over, key)
        if self._queue and self._busy < self.in_flight:
            self._busy += 1
            # a context of its own: not the pinned connection of whoever started it
            task = asyncio.get_running_loop().create_task(
                self._drain(), name="runledger-coalescer", context=contextvars.Context()
            )
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)

    async def _drain(self) -> None:
        """Send batches until the queue is empty, on one connection of the pool."""
        try:
            async with self.executor.pinned():
                while self._queue:
                    writes = self._queue[:BATCH_MAX]
                    del self._queue[:BATCH_MAX]
                    # one write too: the batch statement waits for a lock no longer than
                    # LOCK_TIMEOUT, then the write waits alone, off this connection
                    await self._send_batch(writes)
        finally:
            self._busy -= 1
        self._start_sender()  # queued in the last instant

    async def _send_batch(self, writes: list[Write[Any]]) -> None:
        columns = [_column(c) for c in zip(*(w.row for w in writes), strict=True)]
        try:
            # the sender's connection (its context pins nothing of a run's)
            rows = await self.executor.rows(self.batch, [*columns, LOCK_TIMEOUT])
            by_ordinal = {int(r["o"]): r for r in rows}
            if len(by_ordinal) != len(writes):
                raise RuntimeError(f"{len(rows)} rows for a batch of {len(writes)} writes")
        except psycopg.Error as exc:
            # an error with no SQLSTATE can come after the commit (reading the reply)
            ambiguous = is_connection_error(exc) or exc.sqlstate is None
            self.failed += 1
            log.info(
                "a batch of writes failed: each is sent alone",
                extra={
                    "writes": len(writes),
                    "sqlstate": exc.sqlstate,
                    "ambiguous": ambiguous,
                    "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                },
            )
            for w in writes:
                _settle(w, _AMBIGUOUS if ambiguous else _ALONE)
            return
        except BaseException as exc:
            # not an answer of the database (cancelled, a reply this code cannot read):
            # each write may have landed; its caller reads it back
            for w in writes:
                _settle(w, _AMBIGUOUS)
            if not isinstance(exc, Exception):
                raise
            log.exception("a batch of writes got no usable answer: each is read back")
            return
        if len(writes) > 1:
            self.batches += 1
            self.batched += len(writes)
        for i, w in enumerate(writes, start=1):
            try:
                value = w.result([by_ordinal[i]])
            except Exception as exc:  # a reply this write cannot read: its caller's error
                if not w.done.done():
                    w.done.set_exception(exc)
                continue
            _settle(w, value)

    async def close(self) -> None:
        """The store is closing: what is still queued fails, and the batches in flight
        finish first, while the pool is open, so that their writes get the database's
        answer (not a closed pool's) and no sender outlives the store. Waits at most
        ``CLOSE_SECONDS``; ``asyncio.wait`` does not cancel a batch when the closing
        caller is cancelled itself."""
        queued, self._queue = self._queue, []
        for w in queued:
            if not w.done.done():
                w.done.set_exception(RuntimeError("the store is closed"))
                w.done.exception()  # retrieved: a cancelled caller never looks
        if self._senders:
            _, late = await asyncio.wait(set(self._senders), timeout=CLOSE_SECONDS)
            if late:
                log.warning(
                    "closing the store with a batch of writes still in flight",
                    extra={"kind": self.kind, "seconds": CLOSE_SECONDS},
                )


_JSONB = JsonbDumper(Jsonb)  # the text psycopg sends for a Jsonb parameter


def _column(values: tuple[Any, ...]) -> list[Any] | str:
    """One column of a batch, as its statement's array parameter. A column of JSON values
    goes as the array's text, built here: psycopg's list dumper escapes each element's
    quotes with a regular-expression substitution, a tenth of the worker's CPU per call
    at 32 concurrent runs; the same text costs two ``str.replace`` here."""
    if not any(isinstance(v, Jsonb) for v in values):
        return list(values)
    return "{" + ",".join("NULL" if v is None else f'"{_element(v)}"' for v in values) + "}"


def _element(value: Jsonb) -> str:
    text = bytes(_JSONB.dump(value)).decode()  # type: ignore[arg-type]
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _settle(write: Write[Any], value: Any) -> None:
    if not write.done.done():
        write.done.set_result(value)

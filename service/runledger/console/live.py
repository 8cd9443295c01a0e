"""Live updates: one ``LISTEN runledger_events`` connection per console process, fanned
out to every open server-sent-events stream.

Revision 0015 sends, at commit, ``NOTIFY runledger_events '<event_id> <run_id> <kind>'``
for each event an operator watches (not the per-call and per-turn ones). A stream sends
``event: change`` with ``{"event_id", "run_id", "kind"}`` for each (only its run's, when
it follows one run); the page then fetches its fresh fragment. When the listening
connection is lost the hub reconnects with backoff and sends ``event: resync`` to every
stream (what was committed meanwhile was never heard: refetch), and a stream that falls
behind by more than its queue gets a ``resync`` instead of the events it missed.

On a hot standby there is nothing to listen to: PostgreSQL does not replicate NOTIFY,
and refuses LISTEN during recovery. The hub sees that when it connects (the server's
``in_hot_standby``, or ``pg_is_in_recovery()``) and sends ``event: replica`` (``{"poll":
seconds}``) instead of ``ready``: the header says "read replica: no live updates" and the
page fetches itself every ``poll`` seconds. The hub asks again every
:data:`REPLICA_RECHECK` s; once the server was promoted it listens, and the streams get
``ready`` and ``resync``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from runledger.db.connecting import connect_timeout_param
from runledger.db.event_log import EVENTS_CHANNEL, listen_for_events
from runledger.db.server import in_recovery

log = logging.getLogger(__name__)

CHANNEL = EVENTS_CHANNEL
KEEPALIVE_SECONDS = 15.0
QUEUE_SIZE = 256
MAX_BACKOFF = 10.0
REPLICA_POLL_SECONDS = 5  # a page on a standby fetches itself this often instead
REPLICA_RECHECK = 10.0  # s: how often a console on a standby asks whether it was promoted
REPLICA_TEXT = "read replica: no live updates"  # the header's live-update state there


@dataclass(frozen=True, slots=True)
class Change:
    event_id: int
    run_id: str
    kind: str


def parse(payload: str) -> Change | None:
    parts = payload.split(" ")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return Change(int(parts[0]), parts[1], parts[2])


@dataclass(eq=False)
class Subscriber:
    run_id: str | None
    queue: asyncio.Queue[Change | str] = field(
        default_factory=lambda: asyncio.Queue(maxsize=QUEUE_SIZE)
    )
    behind: bool = False

    def offer(self, item: Change | str) -> None:
        if isinstance(item, Change) and self.run_id is not None and item.run_id != self.run_id:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.behind = True


class Hub:
    def __init__(self, url: str, connect_timeout: float) -> None:
        self.url = url
        self.connect_timeout = connect_timeout
        self.listening = asyncio.Event()
        self.replica = asyncio.Event()  # the database is a standby: no live updates
        self._subscribers: set[Subscriber] = set()
        self._task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        self.heard = 0  # notifications received, for tests and logs

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._listen(), name="runledger-console-listen")

    def close_streams(self) -> None:
        """End every stream now (the server is shutting down: it waits for open
        responses, and a stream never ends by itself). Call it on the loop."""
        self.closing = True
        for sub in list(self._subscribers):
            _drain(sub.queue)
            sub.offer("closing")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sub in list(self._subscribers):
            sub.offer("closing")

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def _broadcast(self, item: Change | str) -> None:
        for sub in list(self._subscribers):
            sub.offer(item)

    async def _listen(self) -> None:
        delay = 0.25
        lost = False
        while True:
            standby = False
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.url,
                    autocommit=True,
                    application_name="runledger-console-listen",
                    connect_timeout=connect_timeout_param(self.connect_timeout),
                )
                async with conn:
                    standby = await in_recovery(conn)
                    if not standby:
                        await listen_for_events(conn)
                        self._listening_again(lost)
                        delay, lost = 0.25, False
                        async for note in conn.notifies():
                            change = parse(note.payload)
                            if change is not None:
                                self.heard += 1
                                self._broadcast(change)
            except asyncio.CancelledError:
                raise
            except (psycopg.Error, OSError) as exc:
                if not lost:
                    log.warning(
                        "console: lost LISTEN %s (%s); reconnecting",
                        CHANNEL,
                        " ".join(str(exc).split())[:200],
                    )
                    self._broadcast("offline")
                self.listening.clear()
                self.replica.clear()
                lost = True
            if standby:
                self._on_standby()
                delay, lost = 0.25, False
                await asyncio.sleep(REPLICA_RECHECK)
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)

    def _listening_again(self, lost: bool) -> None:
        promoted = self.replica.is_set()
        self.replica.clear()
        self.listening.set()
        if lost:
            log.warning("console: listening on %s again", CHANNEL)
        elif promoted:
            log.info("console: the database was promoted: live updates on")
        if lost or promoted:
            self._broadcast("resync")  # what was committed meanwhile: refetch

    def _on_standby(self) -> None:
        """The database is a standby: no notification will come (NOTIFY is not replicated,
        LISTEN is refused in recovery); the streams say so, and the pages poll."""
        self.listening.clear()
        if not self.replica.is_set():
            log.info(
                "console: the database is a standby (in recovery): no live updates; pages "
                "poll every %d s",
                REPLICA_POLL_SECONDS,
            )
            self.replica.set()
            self._broadcast("replica")

    async def _first_state(self) -> str:
        """What a new stream says first: ``ready`` once listening, ``replica`` once the
        database is known to be a standby, ``offline`` when neither within 15 s."""
        states = {
            asyncio.ensure_future(self.listening.wait()): "ready",
            asyncio.ensure_future(self.replica.wait()): "replica",
        }
        try:
            done, _ = await asyncio.wait(
                states, timeout=KEEPALIVE_SECONDS, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiting in states:
                waiting.cancel()
        if self.replica.is_set():
            return "replica"
        return "ready" if done else "offline"

    async def stream(self, run_id: str | None) -> AsyncIterator[str]:
        """The text of one SSE stream: ``ready`` once listening (``replica`` on a
        standby), then ``change`` (and ``resync``/``offline``/``replica``) events, with a
        comment every 15 s to keep proxies open."""
        if self.closing:
            return
        sub = Subscriber(run_id)
        self._subscribers.add(sub)
        replica = {"run_id": run_id, "poll": REPLICA_POLL_SECONDS}
        try:
            yield "retry: 2000\n\n"
            first = await self._first_state()
            if first == "ready":
                yield _event("ready", {"run_id": run_id})
            elif first == "replica":
                _drain(sub.queue)  # the same news, queued while it was found out
                yield _event("replica", replica)
            else:
                yield _event("offline", {})
            while not self.closing:
                if sub.behind:
                    sub.behind = False
                    _drain(sub.queue)
                    yield _event("resync", {})
                    continue
                try:
                    item = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if item == "closing":
                    return
                if isinstance(item, Change):
                    yield _event(
                        "change",
                        {"event_id": item.event_id, "run_id": item.run_id, "kind": item.kind},
                    )
                elif item == "resync":
                    yield _event("ready", {"run_id": run_id})
                    yield _event("resync", {})
                elif item == "replica":
                    yield _event("replica", replica)
                else:
                    yield _event(item, {})
        finally:
            self._subscribers.discard(sub)


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def _drain(queue: asyncio.Queue[Any]) -> None:
    while not queue.empty():
        queue.get_nowait()

"""The console's reads: the CLI's own queries (:mod:`runledger.db.inspect`,
:mod:`runledger.db.event_log`) on a few kept read-only connections, run in threads so the
event loop never waits on the database.

Each connection is one of :func:`runledger.db.inspect.read_connection` (read-only
session, safe JSON decoding, never prepared), kept open between requests. A driver error
goes back into that context manager, which turns it into the same one-line runledger
error the CLI prints (a lost connection: ``DatabaseUnavailable``) and closes the
connection; a kept connection that the server dropped meanwhile is replaced once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import psycopg

from runledger.db import inspect
from runledger.db.sqlstate import is_connection_error

T = TypeVar("T")
Conn = psycopg.Connection[dict[str, Any]]


class Reader:
    def __init__(self, url: str, connect_timeout: float, *, keep: int = 4) -> None:
        self.url = url
        self.connect_timeout = connect_timeout
        self.keep = keep
        self._idle: list[tuple[AbstractContextManager[Conn], Conn]] = []
        self._lock = threading.Lock()
        self._closed = False

    async def __call__(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(self.run, fn, *args, **kwargs)

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        kept = self._take()
        if kept is not None:
            try:
                return self._use(kept, fn, args, kwargs)
            except _Dropped:
                pass  # the server dropped a kept connection: once more on a new one
        fresh = self._open()
        try:
            return self._use(fresh, fn, args, kwargs)
        except _Dropped as dropped:
            raise dropped.error from None

    def _use(
        self,
        entry: tuple[AbstractContextManager[Conn], Conn],
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        cm, conn = entry
        try:
            result = fn(conn, *args, **kwargs)
        except psycopg.Error as exc:
            dropped = is_connection_error(exc) or conn.closed
            try:  # read_connection maps it to a runledger error and closes the connection
                cm.__exit__(type(exc), exc, exc.__traceback__)
            except Exception as mapped:
                if dropped:
                    raise _Dropped(mapped) from None
                raise mapped from None
            raise
        except BaseException:
            self._give(entry)
            raise
        self._give(entry)
        return result

    def _open(self) -> tuple[AbstractContextManager[Conn], Conn]:
        cm = inspect.read_connection(self.url, self.connect_timeout)
        conn = cm.__enter__()
        return cm, conn

    def _take(self) -> tuple[AbstractContextManager[Conn], Conn] | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _give(self, entry: tuple[AbstractContextManager[Conn], Conn]) -> None:
        cm, conn = entry
        healthy = (
            not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        )
        with self._lock:
            if healthy and not self._closed and len(self._idle) < self.keep:
                self._idle.append(entry)
                return
        cm.__exit__(None, None, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for cm, _ in idle:
            cm.__exit__(None, None, None)


class _Dropped(Exception):
    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error

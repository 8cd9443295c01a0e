"""The wait loop of ``runledger.db.wire`` against libpq's contract, without a server: a
stand-in connection whose reply sits in libpq's own buffer, not on the socket, as the
rest of a TLS record larger than libpq's buffer does. The loop must read it before it
waits for the socket, or it waits forever; on a plain connection it waits first. (The
statements themselves are tested against a real server in tests/contract/test_wire.py.)"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from runledger.db import wire


class _Transport:
    """A libpq connection as the wait loop sees it. ``split``: the socket turns readable
    once, with the result, and the end of the reply is then already in the library's
    buffer (the socket stays quiet), as with TLS; otherwise the whole reply comes in that
    one read, as on a plain connection."""

    def __init__(self, *, ssl: bool, split: bool) -> None:
        self.ssl_in_use = ssl
        self.used_gssapi = False
        self.split = split
        self._ours, self._theirs = socket.socketpair()
        self._ours.setblocking(False)
        self.socket = self._ours.fileno()
        self.reads = 0  # consume_input calls
        self.parts_in = 0  # parts of the reply libpq has read and parsed
        self.results = ["the result"]

    def send_reply(self) -> None:
        self._theirs.send(b"x")

    def flush(self) -> int:
        return 0

    def consume_input(self) -> None:
        self.reads += 1
        try:
            got = self._ours.recv(16)
        except BlockingIOError:
            got = b""
        if got:
            self.parts_in = 1 if self.split else 2
        elif self.parts_in == 1:
            self.parts_in = 2  # what the library had buffered

    def is_busy(self) -> bool:
        # the result is whole with the first part; the reply ends with the second
        return self.parts_in == 0 or (not self.results and self.parts_in < 2)

    def get_result(self) -> Any:
        return self.results.pop() if self.results else None

    def close(self) -> None:
        self._ours.close()
        self._theirs.close()


async def _wait_for(transport: _Transport) -> Any:
    waiting = asyncio.ensure_future(wire._wait(transport))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    transport.send_reply()
    return await asyncio.wait_for(waiting, timeout=5.0)


def test_an_encrypted_replys_end_in_the_librarys_buffer_is_read_without_a_wait() -> None:
    transport = _Transport(ssl=True, split=True)
    try:
        assert asyncio.run(_wait_for(transport)) == "the result"
        assert transport.parts_in == 2
    finally:
        transport.close()


def test_a_plain_reply_is_read_once_the_socket_is_readable() -> None:
    transport = _Transport(ssl=False, split=False)
    try:
        assert asyncio.run(_wait_for(transport)) == "the result"
        assert transport.reads == 1  # not also before the reply and after its result
    finally:
        transport.close()

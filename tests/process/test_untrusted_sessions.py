"""A worker that reaches PostgreSQL through a proxy (a pooler in session mode, HAProxy,
...) cannot trust a session lock: the server's session lives as long as the proxy's
connection, not the worker's. It sees that (the server sees another client port than
its socket has), says so once, and registers without a lock: its runs are taken over on
lease expiry only, never early."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

from runledger.testing import wait_for
from tests.process.conftest import events, submit, wait_status

pytestmark = pytest.mark.process


@contextlib.contextmanager
def tcp_proxy(host: str, port: int) -> Iterator[int]:
    """A plain TCP proxy on a free loopback port to ``host:port``; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    sockets: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection((host, port))
            sockets.extend((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()


def test_a_worker_behind_a_proxy_falls_back_to_lease_expiry(
    workers: Any, provider: Any, admin_conn: Any, db_clock: Any
) -> None:
    info = conninfo_to_dict(workers.database_url)
    with tcp_proxy(str(info["host"]), int(str(info["port"]))) as port:
        direct = workers.database_url
        workers.database_url = direct.replace(f":{info['port']}/", f":{port}/", 1)
        (w0,) = workers.start(1)
        workers.database_url = direct
        submit(admin_conn, "proxied", [[{"tool": "ticket", "args": {"gate": "g"}}]])
        provider.client.wait_for_held("g")
        row = admin_conn.execute(
            "SELECT w.session_lock, r.lease_lock FROM runledger.workers w"
            " JOIN runledger.runs r ON r.lease_owner = w.worker_id WHERE r.run_id = 'proxied'"
        ).fetchone()
        assert row == (None, None)
        log = workers.log(w0)
        assert log.count("no session lock") == 1 and "proxy" in log, log[-2000:]
        workers.start(1)  # w1, direct: it holds a lock, and sees no ended session
        wait_for(
            lambda: admin_conn.execute(
                "SELECT 1 FROM runledger.workers WHERE worker_id = 'w1'"
                " AND session_lock IS NOT NULL"
            ).fetchone(),
            what="w1 registered with a session lock",
        )
        workers.kill(w0)  # its session, through the proxy, is the proxy's to end
        db_clock.advance(31)  # past the default 30 s lease
        takeover = wait_for(
            lambda: events(admin_conn, "proxied", "takeover"), what="takeover on expiry"
        )[0]
        assert takeover["detail"]["holder"] == "expired"
        assert takeover["actor"] == "w1"
        provider.client.open_gate("g")
        wait_status(admin_conn, "proxied", ("succeeded",))
        assert len(provider.client.effects("proxied:0:c0")) == 1

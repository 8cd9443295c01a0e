"""A worker whose host clock is wrong judges every time by the database's clock.

A charge is in flight when its worker is SIGKILLed; the payments API commits it
:data:`ARRIVAL` seconds after it received it. Another worker, whose host clock is five
minutes fast, five minutes slow, or stepped back five minutes while it waits, takes the
run over and looks the charge up as docs/providers.md says: it waits until the send can
no longer land (``LANDING`` seconds after it, by the database's clock), then reads. Its
clock is moved for real, by libfaketime (Debian's ``faketime``) preloaded into the worker
process; its monotonic clock is left alone, as an NTP step or a wrong timezone leaves it.

Compared with its own clock, the fast host found the send long gone, read at once, found
nothing and charged again; the slow one waited five minutes more than the bound. Each
must find the one charge after a wait no longer than the bound plus a second.
"""

from __future__ import annotations

import contextlib
import glob
import json
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from runledger.testing import WorkerPool, wait_for
from tests.process.conftest import (
    call_rows,
    events,
    listening_backend,
    submit,
    wait_status,
)

pytestmark = pytest.mark.process

ARRIVAL = 3.0  # s after it is received that the API commits a charge
LANDING = 6.0  # the lookup's bound: the API commits a charge within this, or never
SKEW = 300.0


def _libfaketime() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        pytest.fail(
            "libfaketime is missing: install Debian's faketime package (scripts/test installs it)"
        )
    return found[0]


class Payments:
    """A payments API in a thread: ``POST /charges`` commits the charge ARRIVAL s after it
    came in (the client may be gone by then); ``GET /charges?key=K&waited=W`` answers it
    once committed, and keeps how long the lookup said it waited."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posts: dict[str, int] = {}
        self.charges: dict[str, list[dict[str, Any]]] = {}
        self.lookups: list[dict[str, Any]] = []
        self.received = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):  # its sender may have been killed
                    self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = body["key"]
                with api.lock:
                    api.posts[key] = api.posts.get(key, 0) + 1
                api.received.set()
                time.sleep(ARRIVAL)  # on its way: a lookup meanwhile finds nothing
                charge = {"id": f"ch_{key}_{len(api.charges.get(key, []))}", "key": key}
                with api.lock:
                    api.charges.setdefault(key, []).append(charge)
                self._answer(charge)

            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                key = query["key"][0]
                with api.lock:
                    found = list(api.charges.get(key, []))
                    api.lookups.append(
                        {"key": key, "waited": float(query["waited"][0]), "found": bool(found)}
                    )
                self._answer(found[0] if found else {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def payments() -> Iterator[Payments]:
    api = Payments()
    try:
        yield api
    finally:
        api.close()


def _cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runledger", *args, "--database-url", database_url],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("clock", ["ahead", "behind", "stepped"])
def test_a_skewed_host_waits_out_the_landing_by_the_database_clock(
    clock: str,
    payments: Payments,
    runledger_workers: WorkerPool,
    admin_conn: Any,
    database_url: str,
    lease_args: list[str],
    tmp_path: Path,
) -> None:
    workers = runledger_workers
    workers.flows = ["tests.process.clock_flows:flow"]
    env = {"PAYMENTS_URL": payments.url, "PAYMENTS_LANDING": str(LANDING)}
    spec = tmp_path / "faketime"
    spec.write_text({"ahead": "+5m", "behind": "-5m", "stepped": "+0"}[clock] + "\n")
    skewed_env = {
        **env,
        "LD_PRELOAD": _libfaketime(),
        "FAKETIME_TIMESTAMP_FILE": str(spec),
        "FAKETIME_CACHE_DURATION": "1",  # a step is seen within a second
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # as a wrong or stepped wall clock leaves it
    }
    run_id = f"skew-{clock}"
    key = f"{run_id}:0:c0"

    # the skewed worker starts first and is frozen while the other one takes the run
    (skewed,) = workers.start(1, env=skewed_env, args=lease_args)
    wait_for(lambda: listening_backend(admin_conn, workers.worker_id(skewed)), timeout=60)
    workers.stop(skewed)
    (sender,) = workers.start(1, env=env, args=lease_args)
    submit(admin_conn, run_id, [[{"tool": "charge", "args": {"amount": 100}}]], flow="clock")
    assert payments.received.wait(60), workers.log(sender)
    workers.kill(sender)  # the charge is on its way: it commits ARRIVAL s later
    workers.cont(skewed)

    if clock == "stepped":
        # once the skewed worker has taken the call over and begun its lookup, its wall
        # clock steps back five minutes (its monotonic clock does not move)
        wait_for(
            lambda: events(admin_conn, run_id, "send_released"),
            timeout=30,
            what="the takeover of the call",
        )
        spec.write_text("-5m\n")

    final = wait_status(admin_conn, run_id, ("succeeded", "paused", "failed"), timeout=60)
    calls = call_rows(admin_conn, run_id)
    log = workers.log(skewed)
    assert final["status"] == "succeeded", (final, calls, log)
    assert payments.posts == {key: 1}, (payments.posts, payments.lookups, log)  # sent once
    assert [len(c) for c in payments.charges.values()] == [1]
    assert calls[0]["status"] == "succeeded"
    assert calls[0]["completed_by"] == workers.worker_id(skewed)
    assert calls[0]["result"]["id"] == f"ch_{key}_0"  # found by the lookup
    # the lookup waited out the landing bound by the database's clock, no longer
    first = payments.lookups[0]
    assert first["found"] and first["waited"] > 0, (payments.lookups, log)
    assert all(lk["waited"] <= LANDING + 1.0 for lk in payments.lookups), payments.lookups

    if clock != "ahead":
        return
    # the worker says how far its host's clock is off; `workers` and doctor warn
    wait_for(
        lambda: admin_conn.execute(
            "SELECT abs(extract(epoch FROM clock_offset) - %s) < 30 FROM runledger.workers"
            " WHERE worker_id = %s",
            (SKEW, workers.worker_id(skewed)),
        ).fetchone()[0],
        timeout=30,
        what="the skewed worker's clock offset",
    )
    listed = _cli(database_url, "workers", "--json")
    assert listed.returncode == 0, listed.stderr
    offsets = {
        w["worker_id"]: w["clock_offset_seconds"] for w in json.loads(listed.stdout)["workers"]
    }
    assert abs(offsets[workers.worker_id(skewed)] - SKEW) < 30, offsets
    shown = _cli(database_url, "workers")
    assert f"warning: {workers.worker_id(skewed)}'s host clock" in shown.stdout, shown.stdout
    assert "ahead of the database's" in shown.stdout
    doctor = _cli(database_url, "doctor", "--json")
    checks = {c["check"]: c for c in json.loads(doctor.stdout)}
    assert checks["worker clocks"]["status"] == "warn", checks["worker clocks"]
    assert workers.worker_id(skewed) in checks["worker clocks"]["detail"]
    assert doctor.returncode == 1

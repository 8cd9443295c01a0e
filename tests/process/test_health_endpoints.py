"""``runledger worker --http-port``: /livez, /readyz and /metrics scraped from a real
worker process, and its JSON lifecycle lines."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runledger.db import migrate
from runledger.testing import wait_for
from tests.process.conftest import LEASE, events, run_row, submit, wait_status

pytestmark = pytest.mark.process

FLOW = "scripted@1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def answers(port: int, path: str) -> tuple[int, str] | None:
    try:
        return get(port, path)
    except OSError:
        return None


def samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = get(port, "/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_metrics_readyz_and_json_lines_of_a_real_worker(
    workers: Any, provider: Any, admin_conn: Any, lease_args: list[str]
) -> None:
    port = free_port()
    args = [
        *lease_args,
        "--concurrency",
        "1",
        "--http-port",
        str(port),
        "--http-host",
        "127.0.0.1",
        "--log-json",
        "--grace-seconds",
        "60",
    ]
    (w0,) = workers.start(1, args=args)
    assert wait_for(lambda: answers(port, "/livez"), what="/livez answering") == (200, "ok\n")
    assert wait_for(lambda: answers(port, "/readyz"), what="/readyz") == (200, "ok\n")

    submit(admin_conn, "m-ok", [[{"tool": "ticket"}]])
    wait_status(admin_conn, "m-ok", ("succeeded",))
    # one slot: the gated run holds it, the next one waits queued
    submit(admin_conn, "m-gated", [[{"tool": "ticket", "args": {"gate": "g1"}}]])
    wait_for(lambda: provider.client.effects("m-gated:0:c0"), what="the gated call in flight")
    submit(admin_conn, "m-queued", [[{"tool": "ticket"}]])

    found = wait_for(
        lambda: (
            (m := samples(port))
            and value(m, "runledger_calls_total", flow=FLOW, tool="ticket", outcome="succeeded")
            == 1
            and m
        ),
        what="the first run's call counted",
    )
    assert value(found, "runledger_runs_claimed_total", flow=FLOW) == 2
    assert value(found, "runledger_runs_finished_total", flow=FLOW, status="succeeded") == 1
    assert value(found, "runledger_runs_finished_total", flow=FLOW, status="failed") == 0
    assert value(found, "runledger_runs_active") == 1
    assert value(found, "runledger_queue_depth", flow=FLOW, status="running") == 1
    assert value(found, "runledger_queue_depth", flow=FLOW, status="queued") == 1
    assert value(found, "runledger_claim_seconds_count") >= 2
    assert value(found, "runledger_call_seconds_count", tool="ticket") == 1
    assert value(found, "runledger_stale_writes_refused_total") == 0
    assert value(found, "runledger_leases_lost_total") == 0
    assert ("runledger_lease_renewals_total", ()) in found
    # one slot: each write finds nothing of its kind in flight and goes alone
    for kind in ("completions", "decisions"):
        for name in ("write_batches", "batched_writes", "write_batches_failed"):
            assert found[(f"runledger_{name}_total", (("kind", kind),))] == 0

    # a schema behind this code's head: not ready (put back afterwards)
    (head,) = admin_conn.execute("SELECT version_num FROM runledger.alembic_version").fetchone()
    assert head == migrate.head()
    admin_conn.execute("UPDATE runledger.alembic_version SET version_num = '0001'")
    try:
        status, body = get(port, "/readyz")
        assert status == 503 and "schema revision 0001" in body, body
    finally:
        admin_conn.execute("UPDATE runledger.alembic_version SET version_num = %s", (head,))
    assert get(port, "/readyz") == (200, "ok\n")

    # SIGTERM: draining (the gated call holds the drain), so not ready, still live
    workers.terminate(w0)
    status, body = wait_for(
        lambda: (r := answers(port, "/readyz")) and r[0] == 503 and r,
        what="/readyz 503 while draining",
    )
    assert body == "not ready: draining\n"
    assert get(port, "/livez") == (200, "ok\n")
    provider.client.open_gate("g1")
    assert workers.wait(w0, timeout=60) == 0, workers.log(w0)
    assert answers(port, "/livez") is None  # the server stopped with the worker
    assert run_row(admin_conn, "m-queued")["status"] == "queued"

    lines = json_lines(workers.log(w0))
    me = {"worker_id": "w0"}

    def lifecycle(msg: str, run_id: str) -> list[dict[str, Any]]:
        return [x for x in lines if x["msg"] == msg and x.get("run_id") == run_id]

    for run_id in ("m-ok", "m-gated"):
        (claimed,) = lifecycle("claimed run", run_id)
        assert claimed.items() >= {**me, "fencing_token": 1}.items()
        (dispatched,) = lifecycle("call dispatched", run_id)
        assert dispatched.items() >= {**me, "fencing_token": 1, "call": f"{run_id}:0:c0"}.items()
        (completed,) = lifecycle("call completed", run_id)
        assert (
            completed.items()
            >= {
                **me,
                "fencing_token": 1,
                "call": f"{run_id}:0:c0",
                "outcome": "succeeded",
            }.items()
        )
    (finished,) = lifecycle("run finished", "m-ok")
    assert finished.items() >= {**me, "fencing_token": 1, "status": "succeeded"}.items()
    (released,) = lifecycle("run released", "m-gated")
    assert released.items() >= {**me, "fencing_token": 1}.items()
    (listening,) = [x for x in lines if x["msg"] == "health endpoints listening"]
    assert listening["http_port"] == port


def test_http_port_in_use_is_one_line(workers: Any, lease_args: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (w0,) = workers.start(
            1, args=[*lease_args, "--http-port", str(port), "--http-host", "127.0.0.1"]
        )
        assert workers.wait(w0, timeout=60) == 2, workers.log(w0)
    assert f"--http-port {port} on 127.0.0.1" in workers.log(w0)


def test_takeovers_are_counted_by_why_the_run_could_be_taken(
    workers: Any, provider: Any, admin_conn: Any, db_clock: Any, lease_args: list[str]
) -> None:
    # a frozen worker keeps its session: its run is taken when the lease expires
    frozen = free_port()
    (w0,) = workers.start(
        1, args=[*lease_args, "--http-port", str(frozen), "--http-host", "127.0.0.1"]
    )
    submit(admin_conn, "t-expired", [[{"tool": "ticket", "args": {"gate": "ga"}}]])
    provider.client.wait_for_held("ga")
    assert get(frozen, "/livez") == (200, "ok\n")
    workers.stop(w0)
    # its event loop cannot answer: /livez does not either (the kernel still accepts)
    with pytest.raises(TimeoutError):
        get(frozen, "/livez", timeout=1.0)
    db_clock.advance(LEASE + 1)
    port = free_port()
    http = ["--http-port", str(port), "--http-host", "127.0.0.1", "--concurrency", "1"]
    (w1,) = workers.start(1, args=[*lease_args, *http])
    wait_for(lambda: run_row(admin_conn, "t-expired")["fencing_token"] == 2, what="w1's takeover")

    # a killed worker's session ends: its run is taken at once (w1's one slot is busy
    # until the gate opens, so w2 claims it; w2's lease is the default 30 s)
    (w2,) = workers.start(1)
    submit(admin_conn, "t-session", [[{"tool": "ticket", "args": {"gate": "gb"}}]])
    wait_for(lambda: run_row(admin_conn, "t-session")["lease_owner"] == "w2", what="w2's claim")
    workers.kill(w2)
    provider.client.open_gate("ga")
    wait_status(admin_conn, "t-expired", ("succeeded",))
    wait_for(lambda: run_row(admin_conn, "t-session")["lease_owner"] == "w1", what="w1 takes it")
    provider.client.open_gate("gb")
    wait_status(admin_conn, "t-session", ("succeeded",))

    found = wait_for(
        lambda: (
            (m := samples(port))
            and value(m, "runledger_takeovers_total", flow=FLOW, holder="session_ended") == 1
            and m
        ),
        what="the second takeover counted",
    )
    assert value(found, "runledger_takeovers_total", flow=FLOW, holder="expired") == 1
    assert value(found, "runledger_takeovers_total", flow=FLOW, holder="unknown") == 0
    assert value(found, "runledger_runs_claimed_total", flow=FLOW) == 2
    assert value(found, "runledger_runs_finished_total", flow=FLOW, status="succeeded") == 2
    assert value(found, "runledger_queue_depth", flow=FLOW, status="running") == 0
    (takeover,) = [e for e in events(admin_conn, "t-session", "takeover") if e["actor"] == "w1"]
    assert takeover["detail"]["holder"] == "session_ended"
    workers.terminate(w1)
    assert workers.wait(w1) == 0, workers.log(w1)

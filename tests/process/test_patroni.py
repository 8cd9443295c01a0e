"""Failovers under Patroni with ``synchronous_mode``: a 3-node cluster and etcd
(:mod:`tests.process.patroni`), three workers on the multi-host URL, 60 runs of the demo's
``scripted`` flow, and one fault mid-run:

- ``switchover``: ``patronictl switchover`` to the synchronous standby;
- ``kill``: SIGKILL of the leader's Patroni and its postmaster (a crash of the node);
- ``cut``: the leader's network link goes down (it runs in a network namespace).

Beside the workers a **commit witness** commits an incrementing counter in a loop
(``synchronous_commit`` on) and remembers every value the server acknowledged. After the
fault, acknowledged values missing on the new primary are **commits lost**: with
``synchronous_mode`` there must be none. The test asserts that, no fencing token granted
twice, no effect sent twice, every succeeded call's effect at the provider, every run
``succeeded`` or ``paused`` (each paused run at an ``unknown`` call of the unsafe tool),
the workers alive; and that runledger knew the promotion lost nothing (the timeline is
recorded lossless, from the synchronous standby its claims had seen): no run is doubted
(none in ``runledger.failover_runs``), an unsafe call pauses only when its tool was cut
off mid-request, and ``runledger audit`` passes. The workers get the plain multi-host
URL: a cut leader fails their pooled connections by runledger's own TCP settings. It
measures the paused runs, the runs in ``runledger.failover_runs``,
and how long after the fault the new primary accepted writes and the workers made
progress on it; one line per fault, and a JSON line appended to
``$RUNLEDGER_PATRONI_RESULTS`` when set.

``runledger doctor --json`` on the multi-host URL calls the replication ``ok`` before each
fault: one synchronous and one asynchronous standby.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger.db import migrate
from runledger.testing import ProviderProcess, WorkerPool, wait_for
from tests.process.patroni import PatroniCluster, patroni_cluster

pytestmark = [pytest.mark.process, pytest.mark.slow]

RUNS = 60
WORKERS = 3
PLAN = [  # as test_failover's: ticket idempotent, charge a lookup, email unsafe
    [{"tool": "ticket"}, {"tool": "charge", "args": {"amount": 3}}],
    [{"tool": "email"}],
    [{"tool": "charge", "args": {"amount": 2}}, {"tool": "ticket", "args": {"title": "b"}}],
]
PROGRESS = 10  # runs with a succeeded call before the fault
ROOT = Path(__file__).resolve().parents[2]
# libpq's TCP timeouts for the commit witness (the test's own client): a statement in
# flight to a primary cut off without a reset would wait for the kernel to give up
# retransmitting (tcp_retries2, about 15 min). The workers get the plain URL: runledger
# sets these on its pooled connections itself (runledger.db.connecting.POOL_TCP).
TCP_TIMEOUTS = (
    "keepalives=1&keepalives_idle=2&keepalives_interval=1&keepalives_count=3&tcp_user_timeout=5000"
)


def _count(conn: psycopg.Connection[Any], sql: str, params: Any = None) -> int:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0] or 0)


def _grants(conn: psycopg.Connection[Any]) -> set[tuple[str, int, str]]:
    """(run, token, lease id) of every claim the database remembers."""
    rows = conn.execute(
        "SELECT run_id, fencing_token, detail->>'lease_id' FROM runledger.run_events "
        "WHERE kind IN ('claimed', 'takeover')"
    ).fetchall()
    return {(r[0], int(r[1]), str(r[2])) for r in rows}


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Witness:
    """Commits 1, 2, 3, ... into ``witness`` (one row each, autocommit) through the
    multi-host URL until stopped, never with a ``statement_timeout`` (a commit cancelled
    while it waits for the synchronous standby is acknowledged with a warning, though the
    standby may not have it), reconnecting after an error; ``acked`` holds the values
    whose commit the server acknowledged. A value whose commit failed is not retried (it
    may or may not be there: it was never acknowledged)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.acked: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="witness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        n = 0
        conn: psycopg.Connection[Any] | None = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                n += 1
                conn.execute("INSERT INTO witness (n) VALUES (%s)", (n,))
                self.acked.append(n)
                self._stop.wait(0.05)
            except psycopg.Error as exc:
                self.errors.append(f"{n}: {type(exc).__name__}: {str(exc).strip()[:200]}")
                if conn is not None:
                    conn.close()
                conn = None
                self._stop.wait(0.1)
        if conn is not None:
            conn.close()


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runledger", *args, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])},
        check=False,
    )


def _settled(url: str) -> bool:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            n = _count(
                conn,
                "SELECT count(*) FROM runledger.runs WHERE status IN ('succeeded', 'paused')",
            )
    except psycopg.Error:
        return False
    return n == RUNS


def _statuses(url: str) -> Any:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            return conn.execute(
                "SELECT status, lease_owner, count(*) FROM runledger.runs GROUP BY 1, 2"
            ).fetchall()
    except psycopg.Error as exc:
        return exc


def _fault(cluster: PatroniCluster, fault: str) -> str:
    """Apply ``fault`` to the leader; the old leader's name."""
    if fault == "switchover":
        old, sync = cluster.leader(), cluster.sync_standby()
        assert old is not None and sync is not None
        cluster.switchover(sync)
        return old
    if fault == "kill":
        return cluster.kill_leader()
    if fault == "cut":
        return cluster.cut_leader()
    raise ValueError(fault)


def scenario(cluster: PatroniCluster, provider: ProviderProcess, fault: str) -> dict[str, Any]:
    """Play the runs with ``fault`` mid-way; the measurements, and what the test checks."""
    with cluster.connect() as admin:
        admin.execute("CREATE DATABASE patroni")
    url = cluster.url("patroni")
    migrate.upgrade(url)
    out: dict[str, Any] = {
        "fault": fault,
        "standbys": sorted(cluster.roles().items(), key=lambda nr: nr[1], reverse=True),
        "doctor": _cli(url, "doctor", "--json"),
    }
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE witness (n bigint PRIMARY KEY, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp(), "
            "port integer NOT NULL DEFAULT inet_server_port())"
        )
        for n in range(RUNS):
            conn.execute(
                "SELECT * FROM runledger.submit_run(%s, 'scripted', '1', %s)",
                (f"pt-{n:02d}", Jsonb({"plan": PLAN})),
            )
    # about 2 s a run and 12 runs at a time: the runs take about 10 s, and a switchover
    # (2-5 s, the old primary working meanwhile) still finds unfinished runs
    provider.client.configure(latency=0.3)
    witness = Witness(f"{url}&{TCP_TIMEOUTS}")
    pool = WorkerPool(
        url,
        ["runledger.demo.flows:flows"],
        env={
            "RUNLEDGER_PROVIDER_URL": provider.url,
            "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
        },
        # the default lease: it outlasts the failover, so the runs the workers held at the
        # fault are handed back by them, not left to the end of their leases
        args=["--poll-seconds", "0.2", "--lease-seconds", "30", "--concurrency", "4"],
        cwd=str(ROOT),
    )
    try:
        witness.start()
        pool.start(WORKERS)
        with psycopg.connect(url, autocommit=True) as old:
            wait_for(
                lambda: (
                    _count(old, "SELECT count(*) FROM runledger.workers") == WORKERS
                    and _count(
                        old,
                        "SELECT count(DISTINCT run_id) FROM runledger.run_events "
                        "WHERE kind = 'call_succeeded'",
                    )
                    >= PROGRESS
                ),
                timeout=60,
                what="every worker registered and making progress",
            )
            old_grants = _grants(old)
            out["finished_before"] = _count(
                old, "SELECT count(*) FROM runledger.runs WHERE status IN ('succeeded', 'paused')"
            )
        t_fault = _now()
        old_leader = _fault(cluster, fault)
        new_leader = cluster.new_leader(old_leader, timeout=60)
        out["leaders"] = (old_leader, new_leader)
        try:
            wait_for(lambda: _settled(url), timeout=120, interval=0.3, what="every run settled")
        except AssertionError:
            print(f"\nnot settled: {_statuses(url)}, roles {cluster.roles()}")
            for i in range(WORKERS):
                lines = [
                    line
                    for line in pool.log(i).splitlines()
                    if line and not line.startswith((" ", "Traceback", "The above"))
                ]
                print(f"--- worker {i} (alive {pool.alive(i)}) ---\n" + "\n".join(lines[-60:]))
            raise
        witness.stop()
        out["workers_alive"] = [pool.alive(i) for i in range(WORKERS)]
        out["worker_logs"] = [pool.log(i)[-2000:] for i in range(WORKERS)]
    finally:
        witness.stop()
        pool.close()

    new_port = cluster.port_of(new_leader)
    with psycopg.connect(cluster.member_url(new_leader, "patroni"), autocommit=True) as new:
        survived = {int(r[0]) for r in new.execute("SELECT n FROM witness")}
        first_write = new.execute(
            "SELECT min(at) FROM witness WHERE port = %s AND at > %s", (new_port, t_fault)
        ).fetchone()
        # events the workers wrote on the new primary: after the failover was detected
        # there (the newest timeline's last surviving event)
        detected = new.execute(
            "SELECT max(seen_at) FROM runledger.timelines WHERE position > 1"
        ).fetchone()
        assert detected is not None
        after = new.execute(
            "SELECT min(at) FILTER (WHERE kind IN ('claimed', 'takeover')), "
            "min(at) FILTER (WHERE kind = 'call_succeeded') FROM runledger.run_events "
            "WHERE at > %s AND event_id > (SELECT last_event_id FROM runledger.timelines "
            "ORDER BY position DESC LIMIT 1)",
            (t_fault,),
        ).fetchone()
        assert after is not None and first_write is not None
        lease_ids: dict[tuple[str, int], set[str]] = defaultdict(set)
        for run_id, token, lease_id in old_grants | _grants(new):
            lease_ids[(run_id, token)].add(lease_id)
        out["statuses"] = dict(
            Counter(r[0] for r in new.execute("SELECT status FROM runledger.runs"))
        )
        out["pause_reasons"] = dict(
            Counter(
                re.sub(r"pt-\d+:\d+:c\d+", "<call>", r[0] or "")
                for r in new.execute(
                    "SELECT pause_reason FROM runledger.runs WHERE status = 'paused'"
                )
            )
        )
        out["paused_without_unknown_email"] = [
            r[0]
            for r in new.execute(
                "SELECT run_id FROM runledger.runs r WHERE status = 'paused' AND NOT EXISTS "
                "(SELECT 1 FROM runledger.run_calls c WHERE c.run_id = r.run_id "
                "AND c.status = 'unknown' AND c.tool = 'email')"
            )
        ]
        # how the workers let go of their runs and took them back, after the fault
        out["events_after"] = dict(
            new.execute(
                "SELECT kind, count(*) FROM runledger.run_events WHERE at > %s AND kind IN "
                "('failover_detected', 'stale_write_rejected', 'renewal_failed', "
                "'lease_released', 'takeover') GROUP BY kind ORDER BY kind",
                (t_fault,),
            ).fetchall()
        )
        out["unknown_reasons"] = dict(
            Counter(
                str(r[0])
                for r in new.execute(
                    "SELECT error->>'reason' FROM runledger.run_calls WHERE status = 'unknown'"
                )
            )
        )
        out["unknown"] = new.execute(
            "SELECT tool, count(*) FROM runledger.run_calls WHERE status = 'unknown' GROUP BY tool"
        ).fetchall()
        out["calls"] = new.execute(
            "SELECT idempotency_key, tool, status FROM runledger.run_calls"
        ).fetchall()
        # the runs held at the fault: handed back by their fenced holders once the new
        # primary took writes, or taken over when their leases ended; when the last of
        # them was claimed again
        out["handed_back"] = _count(
            new,
            "SELECT count(*) FROM runledger.run_events WHERE kind = 'lease_released' "
            "AND detail->>'reason' = 'fenced after a failover' AND at > %s",
            (t_fault,),
        )
        resumed = new.execute(
            "SELECT max(first) FROM (SELECT e.run_id, min(e.at) AS first "
            "FROM runledger.run_events e WHERE e.kind IN ('claimed', 'takeover') AND e.at > %s "
            "AND e.run_id IN (SELECT run_id FROM runledger.run_events WHERE at > %s AND "
            "(kind = 'takeover' OR (kind = 'lease_released' "
            "AND detail->>'reason' = 'fenced after a failover'))) GROUP BY e.run_id) x",
            (t_fault, t_fault),
        ).fetchone()
        assert resumed is not None
        out["failover_runs"] = _count(
            new, "SELECT count(DISTINCT run_id) FROM runledger.failover_runs"
        )
        out["timelines"] = _count(new, "SELECT count(*) FROM runledger.timelines")
        out["lossless"] = [
            (r[0], r[1])
            for r in new.execute(
                "SELECT lossless, evidence->'commit_guarantee'->>'synchronous_standby_names' "
                "FROM runledger.timelines WHERE position > 1 ORDER BY position"
            )
        ]
    out["audit"] = _cli(url, "audit", "--json")

    def since(t: dt.datetime | None) -> float | None:
        return None if t is None else round((t - t_fault).total_seconds(), 2)

    effects = Counter(e["key"] for e in provider.client.effects())
    out.update(
        commits_acked=len(witness.acked),
        commits_lost=len(set(witness.acked) - survived),
        witness_errors=witness.errors[:5],
        tokens_granted_twice=sum(1 for ids in lease_ids.values() if len(ids) > 1),
        effects_sent_twice=sum(1 for n in effects.values() if n > 1),
        effects=effects,
        paused=out["statuses"].get("paused", 0),
        writes_s=since(first_write[0]),
        detected_s=since(detected[0]),
        claim_s=since(after[0]),
        progress_s=since(after[1]),
        held_resumed_s=since(resumed[0]),
    )
    return out


MEASURED = (
    "fault",
    "leaders",
    "commits_acked",
    "commits_lost",
    "paused",
    "failover_runs",
    "finished_before",
    "tokens_granted_twice",
    "effects_sent_twice",
    "writes_s",
    "detected_s",
    "claim_s",
    "progress_s",
    "handed_back",
    "held_resumed_s",
    "events_after",
    "pause_reasons",
    "unknown_reasons",
    "lossless",
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["switchover", "kill", "cut"])
def test_a_patroni_failover_loses_no_commit_and_sends_nothing_twice(
    fault: str, provider: ProviderProcess
) -> None:
    with patroni_cluster() as cluster:
        out = scenario(cluster, provider, fault)
        measured = {k: out[k] for k in MEASURED}
        print("\npatroni " + " ".join(f"{k}={v}" for k, v in measured.items()))
        if path := os.environ.get("RUNLEDGER_PATRONI_RESULTS"):
            with open(path, "a") as f:
                f.write(json.dumps(measured, default=list) + "\n")

        # doctor on the multi-host URL before the fault: healthy, one sync and one async
        assert out["doctor"].returncode == 0, out["doctor"].stdout + out["doctor"].stderr
        checks = {r["check"]: r for r in json.loads(out["doctor"].stdout)}
        repl = checks["replication"]
        assert repl["status"] == "ok"
        # [(name, 'sync_standby'), (name, 'replica'), (name, 'leader')]
        (sync, _), (other, _), _ = out["standbys"]
        assert repl["data"]["synchronous"] == [f"{sync} (sync)"]
        assert repl["data"]["asynchronous"] == [f"{other} (async)"]

        # synchronous_mode: no acknowledged commit is lost
        assert out["commits_acked"] > 0
        assert out["commits_lost"] == 0, out["witness_errors"]
        # the workers followed the new primary by themselves, and made progress there (the
        # fault came mid-way: runs were left for it)
        assert out["workers_alive"] == [True] * WORKERS, out["worker_logs"]
        assert out["claim_s"] is not None and out["progress_s"] is not None, out["statuses"]
        # no token twice, no effect twice; every succeeded call has its effect
        assert out["tokens_granted_twice"] == 0
        assert out["effects_sent_twice"] == 0, {k: n for k, n in out["effects"].items() if n > 1}
        for key, tool, status in out["calls"]:
            if status == "succeeded" and tool != "read":
                assert out["effects"][key] == 1, f"succeeded call {key} without its effect"
        # every run settled; a paused one waits at an unknown call of the unsafe tool
        assert set(out["statuses"]) <= {"succeeded", "paused"}, out["statuses"]
        assert sum(out["statuses"].values()) == RUNS
        assert {tool for tool, _ in out["unknown"]} <= {"email"}
        assert out["paused_without_unknown_email"] == []
        # the promotion lost nothing, and runledger knew it from its witness: the claims
        # had seen every commit wait for the synchronous standby. Nothing was doubted: no
        # run listed as suspect, no pause for a timeline a failover lost; a run pauses only
        # at an unsafe call whose tool was cut off mid-request (its sender said so).
        assert out["lossless"] == [(True, sync)], out["lossless"]
        assert out["failover_runs"] == 0
        genuine = "in flight when its worker lost the run: its tool was cancelled; unsafe to repeat"
        assert set(out["unknown_reasons"]) <= {genuine}, out["unknown_reasons"]
        # the runs the workers held at the fault were handed back by their fenced holders
        # (release_stale_lease), not left to their leases' end
        assert out["handed_back"] > 0, out["events_after"]
        # and the audit, which saw every acknowledged commit, passes
        assert out["audit"].returncode == 0, out["audit"].stdout

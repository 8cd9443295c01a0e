"""A real network partition: a worker in its own network namespace loses its link mid-call.

The cut-off worker fences itself (its listener heartbeat goes unanswered), the server
drops its listener session later (the session's keepalives), which frees its session lock,
and another worker takes its runs over before their 30 s leases expire. When the link
heals, the cut-off worker's late writes are refused; no idempotent or lookup effect
happens twice, and the unsafe call becomes ``unknown``. docs/leases.md has the argument.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from runledger.testing import ProviderProcess, WorkerPool, wait_for
from runledger.testing.postgres import Databases, Server, private_cluster
from tests.conftest import DEMO_FLOWS
from tests.process.conftest import call_rows, events, submit, wait_status
from tests.process.netns import Namespace, NamespacedPool, namespace

pytestmark = [pytest.mark.process, pytest.mark.slow]

# one run per safety class that has an effect; each call held at its gate
RUNS = {
    "part-ticket": ("ticket", "idempotent"),
    "part-charge": ("charge", "lookup"),
    "part-email": ("email", "unsafe"),
}


@pytest.fixture(scope="module")
def netns() -> Iterator[Namespace]:
    with namespace() as ns:
        yield ns


@pytest.fixture(scope="module")
def cluster(netns: Namespace) -> Iterator[Server]:
    """A cluster of its own, listening on the loopback and on the host's end of the veth
    pair, trusting the pair's /30; commits durable (synchronous_commit=on)."""
    subnet = netns.host_addr.rsplit(".", 1)[0] + f".{int(netns.host_addr.rsplit('.', 1)[1]) - 1}"
    server = private_cluster(
        listen=("127.0.0.1", netns.host_addr),
        hba=(f"host all all {subnet}/30 trust",),
        settings={"synchronous_commit": "on"},
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def url(cluster: Server) -> Iterator[str]:
    dbs = Databases(cluster)
    dbs.ensure_template()
    url = dbs.create("rl_part")
    try:
        yield url
    finally:
        dbs.drop(url)


def _on(url: str, host: str) -> str:
    return url.replace("@127.0.0.1:", f"@{host}:", 1)


def _now(conn: psycopg.Connection[Any]) -> dt.datetime:
    row = conn.execute("SELECT runledger.now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


@pytest.mark.timeout(240)
def test_a_partitioned_worker_fences_itself_and_its_late_writes_are_refused(
    netns: Namespace, url: str, request: pytest.FixtureRequest
) -> None:
    provider = ProviderProcess(host=netns.host_addr)  # reachable from both sides
    request.addfinalizer(provider.stop)
    env = {"RUNLEDGER_PROVIDER_URL": provider.url}
    # default lease (30 s): a takeover within the test is the session lock's, not expiry's
    args = ["--poll-seconds", "0.2", "--concurrency", "4"]
    cut_off = NamespacedPool(
        _on(url, netns.host_addr), DEMO_FLOWS, env=env, args=args, netns=netns.name, id_prefix="cut"
    )
    request.addfinalizer(cut_off.close)
    others = WorkerPool(url, DEMO_FLOWS, env=env, args=args)
    request.addfinalizer(others.close)

    with psycopg.connect(url, autocommit=True) as admin:
        for run_id, (tool, _) in RUNS.items():
            submit(admin, run_id, [[{"tool": tool, "args": {"gate": f"{run_id}-gate"}}]])
        (c0,) = cut_off.start(1)
        for run_id in RUNS:  # every call in flight at the provider, sent by the cut-off worker
            provider.client.wait_for_held(f"{run_id}-gate", timeout=60)
        held = {r: events(admin, r, "claimed")[-1] for r in RUNS}
        assert {e["actor"] for e in held.values()} == {"cut0"}
        (w0,) = others.start(1)
        wait_for(
            lambda: admin.execute(
                "SELECT 1 FROM runledger.workers"
                " WHERE worker_id = 'w0' AND session_lock IS NOT NULL"
            ).fetchone(),
            what="w0 registered with a session lock",
        )

        t_cut = _now(admin)
        netns.cut()
        wait_for(
            lambda: "fencing every run" in cut_off.log(c0),
            timeout=30,
            what="the cut-off worker fences itself",
        )
        t_fenced = _now(admin)

        def taken() -> list[dict[str, Any]]:
            found = [events(admin, r, "takeover") for r in RUNS]
            return [e[0] for e in found] if all(found) else []

        takeovers = wait_for(taken, timeout=60, what="every run taken over")
        taken_at = [
            admin.execute(
                "SELECT at FROM runledger.lease_history WHERE run_id = %s AND kind = 'takeover'",
                (r,),
            ).fetchone()[0]  # type: ignore[index]
            for r in RUNS
        ]
        for e in takeovers:
            assert e["actor"] == "w0" and e["detail"]["previous_owner"] == "cut0"
            assert e["detail"]["holder"] == "session_ended"  # before the lease expired
        # the worker stopped every run before any was taken over
        assert t_fenced <= min(taken_at)
        wait_status(admin, "part-email", ("paused",))  # unsafe, in flight: unknown
        wait_status(admin, "part-charge", ("succeeded",))  # lookup: found, not sent again

        netns.heal()
        t_healed = _now(admin)
        for run_id in RUNS:
            provider.client.open_gate(f"{run_id}-gate")
        wait_status(admin, "part-ticket", ("succeeded",))

        def refused() -> list[dict[str, Any]]:
            rows = [
                e
                for r in RUNS
                for e in events(admin, r, "stale_write_rejected")
                if e["actor"] == "cut0"
            ]
            return rows if len(rows) >= len(RUNS) else []

        stale = wait_for(refused, timeout=60, what="the cut-off worker's late writes refused")
        last = admin.execute(
            "SELECT max(at) FROM runledger.run_events"
            " WHERE kind = 'stale_write_rejected' AND actor = 'cut0'"
        ).fetchone()
        assert last is not None
        t_refused: dt.datetime = last[0]
        for e in stale:
            assert e["detail"]["stale_token"] < e["detail"]["current_token"]
        # the cut-off worker survived the partition and registered again
        wait_for(
            lambda: admin.execute(
                "SELECT 1 FROM runledger.workers w JOIN pg_stat_activity a ON a.pid = w.session_pid"
                " WHERE w.worker_id = 'cut0'"
            ).fetchone(),
            timeout=60,
            what="cut0 registered again after the heal",
        )
        assert cut_off.alive(c0) and others.alive(w0)

        effects = Counter(e["key"] for e in provider.client.effects())
        assert effects == {f"{r}:0:c0": 1 for r in RUNS}, effects
        calls = {r: call_rows(admin, r)[0] for r in RUNS}
        assert calls["part-ticket"]["status"] == "succeeded"
        assert calls["part-ticket"]["completed_by"] == "w0"
        assert calls["part-charge"]["status"] == "succeeded"
        assert calls["part-email"]["status"] == "unknown"
        # nothing of the cut-off worker landed under its old leases after the takeover
        late = admin.execute(
            "SELECT count(*) FROM runledger.run_events WHERE actor = 'cut0' AND at > %s"
            " AND kind NOT IN ('stale_write_rejected', 'claimed', 'takeover')",
            (min(taken_at),),
        ).fetchone()
        assert late is not None and late[0] == 0

    def s(t: dt.datetime) -> str:
        return f"{(t - t_cut).total_seconds():+.2f} s"

    print(
        "\npartition timeline (database clock, from the cut):"
        f"\n  cut            {s(t_cut)}"
        f"\n  cut0 fenced    {s(t_fenced)} (seen in its log)"
        f"\n  takeovers      {', '.join(s(t) for t in sorted(taken_at))} (holder session_ended)"
        f"\n  healed         {s(t_healed)}"
        f"\n  late writes refused by {s(t_refused)}"
    )

"""``runledger_workers``: the user's flows, the provider's URL, and the worker holding a run."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger.testing import ProviderProcess, WorkerPool


def test_without_flows_starting_says_what_to_do(runledger_workers: WorkerPool) -> None:
    assert runledger_workers.flows == []
    with pytest.raises(ValueError, match="runledger_flows"):
        runledger_workers.start(1)
    assert runledger_workers.procs == []


def test_provider_url_only_with_the_provider(runledger_workers: WorkerPool) -> None:
    assert "RUNLEDGER_PROVIDER_URL" not in runledger_workers.env
    assert __file__.rsplit("/", 1)[0] in runledger_workers.env["PYTHONPATH"].split(":")


def test_provider_url_with_the_provider(
    runledger_workers: WorkerPool, runledger_provider: ProviderProcess
) -> None:
    assert runledger_workers.env["RUNLEDGER_PROVIDER_URL"] == runledger_provider.url


@pytest.mark.process
def test_holder_is_the_worker_whose_id_holds_the_lease(
    workers: WorkerPool, provider: ProviderProcess, admin_conn: psycopg.Connection[Any]
) -> None:
    admin_conn.execute(
        "SELECT * FROM runledger.submit_run('held', 'scripted', '1', %s)",
        (Jsonb({"plan": [[{"tool": "ticket", "args": {"gate": "g1"}}]]}),),
    )
    # without session locks: the dead worker's run stays its own until the lease expires
    workers.start(2, args=["--no-session-locks"])
    provider.client.wait_for_held("g1")
    row = admin_conn.execute("SELECT lease_owner FROM runledger.runs WHERE run_id = 'held'")
    (owner,) = row.fetchone() or (None,)
    i = workers.holder("held")
    assert workers.worker_id(i) == owner
    assert workers.holder("held", admin_conn) == i  # a connection works as well as the URL
    assert workers.kill_holder("held", workers.database_url) == i
    assert not workers.alive(i)
    assert workers.alive(1 - i)
    # the dead worker still owns the lease, but a dead process is no holder
    with pytest.raises(AssertionError, match="a live worker of this pool holding run held"):
        workers.holder("held", timeout=0.3)
    provider.client.open_gate("g1")

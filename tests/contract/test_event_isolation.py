"""A run's event chain is extended in READ COMMITTED transactions only (revision 0023).

``_event`` locks the run's last event, then checks in its INSERT's snapshot that no newer
event exists. Under REPEATABLE READ or SERIALIZABLE that snapshot is the transaction's
first: an event committed since is not seen, and the new event chained to the same one
(a fork, which ``runledger audit`` reports as a broken chain). The writers of
``stale_write_rejected`` and ``renewal_failed`` do not lock the run, so nothing else
stops them. Such a write is now refused with RL006; a run's first event, a submit in the
caller's own transaction (transactional enqueue), is written under any isolation.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from .helpers import (
    Lease,
    chain_links,
    count,
    events,
    refused,
    report_stale_write,
    scalar,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]

LEVELS = ("REPEATABLE READ", "SERIALIZABLE")


def _behind_a_newer_event(worker: Conn, worker2: Conn, admin: Conn, level: str) -> Lease:
    """A claimed run, a transaction of ``worker2`` at ``level`` that has taken its first
    snapshot, and then an event of the run committed by a writer that does not lock it."""
    lease = submit_and_claim(worker)
    before = len(events(admin, lease.run_id))
    worker2.autocommit = False
    worker2.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")  # type: ignore[arg-type]
    assert scalar(worker2, "SELECT count(*) FROM runledger.runs") == 1  # the snapshot
    report_stale_write(worker, lease, "complete_call")
    assert len(events(admin, lease.run_id)) == before + 1
    return lease


@pytest.mark.parametrize("level", LEVELS)
def test_a_chain_is_not_extended_from_a_snapshot_older_than_its_last_event(
    worker: Conn, worker2: Conn, admin_conn: Conn, level: str
) -> None:
    lease = _behind_a_newer_event(worker, worker2, admin_conn, level)
    written = len(events(admin_conn, lease.run_id))
    with refused(admin_conn, "RL006") as caught:
        report_stale_write(worker2, lease, "dispatch_call")
    worker2.rollback()
    assert "READ COMMITTED" in str(caught.value), caught.value
    assert level in str(caught.value), caught.value
    # the chain has no fork: every event links to the one before it
    assert chain_links(admin_conn, lease.run_id) == [True] * written


@pytest.mark.parametrize("level", ("READ COMMITTED", "READ UNCOMMITTED"))
def test_the_same_write_in_read_committed_chains_to_the_newest_event(
    worker: Conn, worker2: Conn, admin_conn: Conn, level: str
) -> None:
    # READ UNCOMMITTED runs as READ COMMITTED in PostgreSQL: a snapshot per statement
    lease = _behind_a_newer_event(worker, worker2, admin_conn, level)
    written = len(events(admin_conn, lease.run_id))
    report_stale_write(worker2, lease, "dispatch_call")
    worker2.commit()
    assert chain_links(admin_conn, lease.run_id) == [True] * (written + 1)


@pytest.mark.parametrize("level", LEVELS)
def test_a_submit_in_the_callers_own_transaction_works_under_any_isolation(
    worker: Conn, admin_conn: Conn, level: str
) -> None:
    worker.autocommit = False
    worker.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")  # type: ignore[arg-type]
    submit(worker, "enqueued-with-the-order")
    worker.commit()
    assert count(admin_conn, "runs") == 1
    assert [e["kind"] for e in events(admin_conn, "enqueued-with-the-order")] == ["submitted"]
    assert chain_links(admin_conn, "enqueued-with-the-order") == [True]


@pytest.mark.parametrize("level", LEVELS)
def test_a_resubmit_of_an_existing_run_writes_no_event_and_is_not_refused(
    worker: Conn, admin_conn: Conn, level: str
) -> None:
    submit(worker, "submitted-twice")
    worker.autocommit = False
    worker.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")  # type: ignore[arg-type]
    assert submit(worker, "submitted-twice") == ("submitted-twice", False)
    worker.commit()
    assert [e["kind"] for e in events(admin_conn, "submitted-twice")] == ["submitted"]

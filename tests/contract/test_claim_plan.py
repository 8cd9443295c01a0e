"""The claim's plan stays on its indexes on a table the planner knows nothing about yet
(revision 0022).

A backlog submitted in one burst into a fresh database is claimed before autovacuum has
analyzed ``runs``. The claim's generic plan (revision 0020) was then built from no
statistics. The planner re-checked the candidates through a bitmap of every claimable
row filtered by id (33 ms a claim at 20,000 queued runs, against 1 ms), or, with bitmap
scans off, through the whole of a partial index it took for small. Each claim read the
whole backlog until the next analyze. The claim statement now plans without sequential
or bitmap scans and states its claimable condition so that no partial index matches it:
the candidates are fetched by primary key.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from .helpers import FLOW, FLOW_REF, LEASE_SECONDS, VERSION, scalar, submit

Conn = psycopg.Connection[Any]

BACKLOG = 3000


# rows of runs read in the current transaction: by sequential scans (returned), bitmap
# scans (fetched, counted for the table) and index scans (fetched, counted for the index)
READ = """
SELECT pg_stat_get_xact_tuples_returned(c.oid) + pg_stat_get_xact_tuples_fetched(c.oid)
       + (SELECT coalesce(sum(pg_stat_get_xact_tuples_fetched(i.indexrelid)), 0)
          FROM pg_index i WHERE i.indrelid = c.oid)
FROM pg_class c WHERE c.oid = 'runledger.runs'::regclass
"""


def _fetched(worker: Conn, worker_id: str) -> tuple[int, int]:
    """(runs claimed, rows of runs read) by one claim of one run."""
    with worker.transaction():
        before = scalar(worker, READ)
        claimed = len(
            worker.execute(
                "SELECT * FROM runledger.claim_runs_v4(%s, %s, make_interval(secs => %s), 1)",
                (worker_id, [FLOW_REF], LEASE_SECONDS),
            ).fetchall()
        )
        after = scalar(worker, READ)
    return claimed, int(after - before)


@pytest.mark.parametrize("analyzed_empty", [False, True], ids=["never-analyzed", "analyzed-empty"])
def test_a_claim_from_an_unanalyzed_backlog_reads_a_bounded_number_of_rows(
    admin_conn: Conn, worker: Conn, analyzed_empty: bool
) -> None:
    # the test's own database: no analyze of runs may happen while the test runs
    admin_conn.execute("ALTER TABLE runledger.runs SET (autovacuum_enabled = false)")
    if analyzed_empty:
        # statistics that say the table is empty (then the bitmap is off the table, and
        # before the CASE the whole of ix_runs_claimable looked cheap)
        admin_conn.execute("ANALYZE runledger.runs")
        assert (
            scalar(
                admin_conn, "SELECT reltuples FROM pg_class WHERE oid = 'runledger.runs'::regclass"
            )
            == 0
        )
    else:
        assert scalar(
            admin_conn,
            "SELECT coalesce(last_analyze, last_autoanalyze) IS NULL FROM pg_stat_user_tables"
            " WHERE relid = 'runledger.runs'::regclass",
        )
    for i in range(0, BACKLOG, 1000):
        admin_conn.execute(
            "SELECT count(*) FROM generate_series(%s::int, %s::int) i,"
            " LATERAL runledger.submit_run('plan-' || i, %s, %s, '{}'::jsonb) s",
            (i + 1, i + 1000, FLOW, VERSION),
        )
    submit(admin_conn, "plan-last")
    # the first claim of the session plans the statement; the next ones reuse the plan
    reads = [_fetched(worker, "w-plan") for _ in range(3)]
    assert [n for n, _ in reads] == [1, 1, 1]
    # what a claim of one run may read of runs: up to 4 x 1 + 32 rows from each of the
    # three index-ordered scans, as many candidates by primary key, and the claimed row
    # (73 here). The bitmap plan, and the scan of the partial index, read every queued
    # row (over 3,000).
    assert max(r for _, r in reads) < 200, reads


BURST = 100_000


def test_a_claim_from_a_large_unanalyzed_burst_reads_a_bounded_number_of_rows(
    admin_conn: Conn, worker: Conn
) -> None:
    """Revision 0030: from about 100,000 queued runs on, the generic plan built without
    statistics read the expired and orphaned leases through ix_runs_claimable by flow,
    filtering every queued run of the flow at each claim (100,073 rows read here; 1.1 s a
    claim at a million). Their scans now go through their own indexes."""
    admin_conn.execute("ALTER TABLE runledger.runs SET (autovacuum_enabled = false)")
    # a burst written straight into the table (the claim reads runs only): submit_run's
    # events would take ten times as long for the same plan
    admin_conn.execute(
        "INSERT INTO runledger.runs (run_id, flow, flow_version, input, available_at,"
        " created_at, updated_at)"
        " SELECT 'burst-' || i, %s, %s, '{}'::jsonb, now(), now(), now()"
        " FROM generate_series(1, %s) i",
        (FLOW, VERSION, BURST),
    )
    assert scalar(
        admin_conn,
        "SELECT coalesce(last_analyze, last_autoanalyze) IS NULL FROM pg_stat_user_tables"
        " WHERE relid = 'runledger.runs'::regclass",
    )
    reads = [_fetched(worker, "w-burst") for _ in range(3)]
    assert [n for n, _ in reads] == [1, 1, 1]
    assert max(r for _, r in reads) < 200, reads

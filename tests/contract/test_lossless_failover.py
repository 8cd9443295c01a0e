"""A failover that could lose no acknowledged commit doubts nothing (revision 0.2).

Every claim keeps ``runledger.commit_guarantees``, the witness of how the claiming
session's commits are acknowledged (its ``synchronous_commit``, the server's
``synchronous_standby_names``). The claim that detects a failover reads the witness's
last row first: synchronous, the failover is lossless (the leases held end, nothing is
marked, no run is listed as suspect); else it is recovered as before
(tests/contract/test_failover.py). The test server has no standby, so a synchronous
witness row is written here by the owner, as the claims of a synchronous cluster would
have written it; a real one is in tests/process/test_patroni.py.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest

from .conftest import Connect
from .helpers import (
    call,
    call_row,
    dispatch,
    events,
    key,
    paused_awaiting_approval,
    record_v2,
    rows,
    run_row,
    scalar,
    sqlstate,
    submit,
    submit_and_claim,
)
from .test_failover import claim_v4, pretend_last_seen, timeline

Conn = psycopg.Connection[Any]


@pytest.fixture
def admin(connect: Connect) -> Conn:
    return connect("admin")


def witness(admin: Conn) -> list[dict[str, Any]]:
    return rows(
        admin,
        "SELECT position, synchronous_commit, synchronous_standby_names, timeline, seen_by "
        "FROM runledger.commit_guarantees ORDER BY position",
    )


def pretend_synchronous(admin: Conn, names: str = "n2", commit: str = "on") -> None:
    """The workers' claims last saw their commits wait for the standbys ``names``."""
    admin.execute(
        "INSERT INTO runledger.commit_guarantees (position, synchronous_commit, "
        "synchronous_standby_names, timeline, seen_at, seen_by) "
        "SELECT coalesce(max(position), 0) + 1, %s, %s, runledger._timeline(), now(), 'w1' "
        "FROM runledger.commit_guarantees",
        (commit, names),
    )


@pytest.mark.parametrize(
    ("commit", "names", "synchronous"),
    [
        ("on", "n2", True),
        ("remote_apply", '"n2"', True),
        ("remote_write", "n2", True),
        ("on", "FIRST 2 (n2, n3)", True),
        ("on", "2 (n2, n3)", True),
        ("on", "any 2 (n2,n3)", True),
        ("on", "", False),  # no synchronous standby
        ("on", "*", False),  # any standby: the promoted one may lack a commit
        ("on", "n2, n3", False),  # FIRST 1: n3 is only a candidate
        ("on", "ANY 1 (n2, n3)", False),  # a quorum of one: either may lack a commit
        ("on", "FIRST 1 (n2, n3)", False),
        ("local", "n2", False),  # the commit does not wait for the standby
        ("off", "n2", False),
    ],
)
def test_synchronous_means_every_listed_standby_confirms(
    admin: Conn, commit: str, names: str, synchronous: bool
) -> None:
    assert scalar(admin, "SELECT runledger._synchronous(%s, %s)", (commit, names)) is synchronous


def test_the_claims_keep_the_witness_and_add_a_row_only_on_a_change(
    worker: Conn, admin: Conn
) -> None:
    assert witness(admin) == []  # installed: nothing seen yet
    setting = scalar(worker, "SELECT current_setting('synchronous_commit')")
    other = "local" if setting != "local" else "on"
    claim_v4(worker, "w1")
    claim_v4(worker, "w1")
    first = {
        "position": 1,
        "synchronous_commit": setting,
        "synchronous_standby_names": "",  # the test server has no standby
        "timeline": timeline(admin),
        "seen_by": "w1",
    }
    assert witness(admin) == [first]
    # a worker whose sessions commit otherwise: seen, and then the first one again
    worker.execute(f"SET synchronous_commit = {other}")
    claim_v4(worker, "w2")
    claim_v4(worker, "w2")
    worker.execute(f"SET synchronous_commit = {setting}")
    claim_v4(worker, "w1")
    assert [(w["position"], w["synchronous_commit"], w["seen_by"]) for w in witness(admin)] == [
        (1, setting, "w1"),
        (2, other, "w2"),
        (3, setting, "w1"),
    ]


def test_the_witness_is_append_only(worker: Conn, admin: Conn) -> None:
    claim_v4(worker, "w1")
    with sqlstate("RL007"):
        admin.execute("UPDATE runledger.commit_guarantees SET synchronous_standby_names = 'n2'")
    with sqlstate("RL007"):
        admin.execute("DELETE FROM runledger.commit_guarantees")
    with sqlstate("42501"):  # a worker reads it, and writes it only through a claim
        worker.execute(
            "INSERT INTO runledger.commit_guarantees VALUES (9, 'on', 'n2', 1, now(), 'x')"
        )


def test_a_lossless_failover_ends_the_leases_and_doubts_nothing(worker: Conn, admin: Conn) -> None:
    now = timeline(admin)
    held = submit_and_claim(worker, "held", lease_seconds=3600)
    record_v2(worker, held, 0, [call("c1"), call("c2")])
    assert dispatch(worker, held, key("held", 0, "c2")) == 1
    paused = submit_and_claim(worker, "paused")
    paused_awaiting_approval(worker, paused)
    submit(worker, "queued")
    pretend_synchronous(admin, "n2")
    pretend_last_seen(admin, now + 1)

    claimed = claim_v4(worker, "w2")

    (seen,) = rows(admin, "SELECT * FROM runledger.timelines WHERE position = 3")
    assert (seen["timeline"], seen["previous_timeline"], seen["lossless"]) == (now, now + 1, True)
    assert seen["affected_runs"] == 1  # the run holding a lease
    evidence = seen["evidence"]["commit_guarantee"]
    assert (evidence["synchronous_commit"], evidence["synchronous_standby_names"]) == ("on", "n2")
    assert rows(admin, "SELECT * FROM runledger.failover_runs") == []
    # nothing marked: the planned call is planned, the dispatched one as its holder left it
    assert call_row(admin, key("held", 0, "c1"))["status"] == "planned"
    c2 = call_row(admin, key("held", 0, "c2"))
    assert (c2["status"], c2["dispatched_by"], c2["attempts"]) == ("dispatched", "w1", 1)
    # the queued run is claimed at once; the held one once its lease ends (10 s at most)
    assert [r["run_id"] for r in claimed] == ["queued"]
    assert claimed[0]["failover_turn"] is None
    held_row = run_row(admin, "held")
    assert held_row["lease_lock"] is None
    left = held_row["lease_expires_at"] - scalar(admin, "SELECT runledger.now()")
    assert dt.timedelta(seconds=9) < left <= dt.timedelta(seconds=10)
    assert run_row(admin, "paused")["status"] == "paused"
    (event,) = events(admin, "held", "failover_detected")
    assert (event["detail"]["lossless"], event["detail"]["suspect_from_turn"]) == (True, None)
    assert events(admin, "paused", "failover_detected") == []
    assert events(admin, "queued", "failover_detected") == []
    # (the old holder's writes are refused by the token floor of a real promotion,
    # tests/process/test_failover.py); its run is taken over with nothing doubted
    admin.execute("UPDATE runledger.settings SET clock_offset = clock_offset + interval '11 s'")
    (taken,) = claim_v4(worker, "w2")
    assert (taken["run_id"], taken["takeover"], taken["failover_turn"]) == ("held", True, None)
    # the claim noted this timeline's guarantee after the detection had read the old one
    assert [w["synchronous_standby_names"] for w in witness(admin)][-2:] == ["n2", ""]


def test_a_failover_without_a_synchronous_witness_is_recovered_as_lossy(
    worker: Conn, admin: Conn
) -> None:
    held = submit_and_claim(worker, "held", lease_seconds=3600)
    record_v2(worker, held, 0, [call("c1")])
    submit(worker, "queued")
    pretend_synchronous(admin, "ANY 1 (n2, n3)")  # a quorum of one: not every standby
    pretend_last_seen(admin, timeline(admin) + 1)
    claim_v4(worker, "w2")
    (seen,) = rows(
        admin,
        "SELECT lossless, evidence, affected_runs FROM runledger.timelines WHERE position = 3",
    )
    assert seen["lossless"] is False and seen["affected_runs"] == 2
    assert seen["evidence"]["commit_guarantee"]["synchronous_standby_names"] == "ANY 1 (n2, n3)"
    assert {r["run_id"] for r in rows(admin, "SELECT run_id FROM runledger.failover_runs")} == {
        "held",
        "queued",
    }
    assert call_row(admin, key("held", 0, "c1"))["dispatched_by"] == "failover"
    (event,) = events(admin, "held", "failover_detected")
    assert event["detail"]["lossless"] is False


def test_no_witness_at_all_is_no_evidence(worker: Conn, admin: Conn) -> None:
    submit_and_claim(worker, "held", lease_seconds=3600)
    admin.execute(
        "ALTER TABLE runledger.commit_guarantees DISABLE TRIGGER tg_commit_guarantees_guard"
    )
    admin.execute("DELETE FROM runledger.commit_guarantees")
    admin.execute(
        "ALTER TABLE runledger.commit_guarantees ENABLE ALWAYS TRIGGER tg_commit_guarantees_guard"
    )
    pretend_last_seen(admin, timeline(admin) + 1)
    claim_v4(worker, "w2")
    (seen,) = rows(admin, "SELECT lossless, evidence FROM runledger.timelines WHERE position = 3")
    assert seen == {"lossless": False, "evidence": {"commit_guarantee": None}}
    assert scalar(admin, "SELECT count(*) FROM runledger.failover_runs") == 1


# -- release_stale_lease: a fenced holder hands back a lease a failover made stale ------------

STALE_LEASE = "00000000-0000-4000-8000-000000000001"


def stale_lease(admin: Conn, run_id: str, owner: str = "w1") -> None:
    """A run held under token 0, at this timeline's floor (0 on timeline 1): to the
    database, a lease granted before a failover, as the old holder of a promoted
    database's run holds it (tests/process/test_patroni.py has the real one)."""
    admin.execute(
        "UPDATE runledger.runs SET status = 'running', lease_owner = %s, lease_id = %s, "
        "lease_expires_at = now() + interval '10 s', stalled_claims = 1 WHERE run_id = %s",
        (owner, STALE_LEASE, run_id),
    )


def release_stale(conn: Conn, run_id: str, token: int = 0, owner: str = "w1") -> bool:
    return bool(
        scalar(
            conn,
            "SELECT runledger.release_stale_lease(%s, %s, %s, %s)",
            (run_id, STALE_LEASE, token, owner),
        )
    )


def test_its_holder_hands_back_a_stale_lease_and_the_run_is_claimed_at_once(
    worker: Conn, admin: Conn
) -> None:
    submit(worker, "stale")
    stale_lease(admin, "stale")
    assert release_stale(worker, "stale") is True
    row = run_row(admin, "stale")
    assert (row["status"], row["lease_id"], row["lease_owner"], row["stalled_claims"]) == (
        "queued",
        None,
        None,
        0,
    )
    (event,) = events(admin, "stale", "lease_released")
    assert (event["actor"], event["fencing_token"]) == ("w1", 0)
    assert event["detail"] == {"reason": "fenced after a failover"}
    (taken,) = claim_v4(worker, "w2")
    assert (taken["run_id"], taken["takeover"], taken["fencing_token"]) == ("stale", False, 1)


@pytest.mark.parametrize(
    ("case", "token", "owner"),
    [
        ("another worker", 0, "w2"),
        ("another token", 5, "w1"),
    ],
)
def test_nothing_but_its_holders_stale_lease_is_handed_back(
    worker: Conn, admin: Conn, case: str, token: int, owner: str
) -> None:
    submit(worker, "stale")
    stale_lease(admin, "stale")
    before = run_row(admin, "stale")
    assert release_stale(worker, "stale", token, owner) is False, case
    assert run_row(admin, "stale") == before
    assert events(admin, "stale", "lease_released") == []


def test_a_lease_of_this_timeline_is_not_handed_back_so(worker: Conn, admin: Conn) -> None:
    """A lease granted on this timeline still works: release_lease is for that."""
    lease = submit_and_claim(worker, "fresh")
    before = run_row(admin, "fresh")
    held = scalar(
        worker,
        "SELECT runledger.release_stale_lease(%s, %s, %s, %s)",
        ("fresh", lease.lease_id, lease.token, lease.worker_id),
    )
    assert held is False
    assert run_row(admin, "fresh") == before


def test_an_expired_stale_lease_is_left_to_its_takeover(worker: Conn, admin: Conn) -> None:
    submit(worker, "stale")
    stale_lease(admin, "stale")
    admin.execute("UPDATE runledger.settings SET clock_offset = clock_offset + interval '11 s'")
    assert release_stale(worker, "stale") is False
    assert run_row(admin, "stale")["status"] == "running"


def test_bad_arguments_are_refused(worker: Conn) -> None:
    with sqlstate("RL006"):
        release_stale(worker, "any", owner="")
    with sqlstate("RL003"):
        release_stale(worker, "no-such-run")

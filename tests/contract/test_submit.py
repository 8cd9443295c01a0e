"""submit_run: idempotent resubmission, conflicts, bad input, NOTIFY."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import psycopg
import pytest

from runledger import errors
from runledger.testing import DbClock

from .helpers import (
    FLOW_REF,
    claim,
    count,
    events,
    one,
    refused,
    run_row,
    set_payload_cap,
    sqlstate,
    submit,
    unchanged,
)

Conn = psycopg.Connection[Any]


def test_submit_creates_a_queued_run_and_one_event(worker: Conn, admin_conn: Conn) -> None:
    assert submit(worker, "r1", {"title": "hello"}, priority=5) == ("r1", True)

    run = run_row(admin_conn, "r1")
    assert (run["flow"], run["flow_version"], run["status"]) == ("demo", "1", "queued")
    assert run["input"] == {"title": "hello"}
    assert (run["state"], run["state_version"], run["fencing_token"]) == (None, 0, 0)
    assert (run["lease_id"], run["lease_owner"], run["lease_expires_at"]) == (None, None, None)
    assert run["priority"] == 5
    assert run["available_at"] == run["created_at"]
    [ev] = events(admin_conn, "r1")
    assert ev["kind"] == "submitted"
    assert ev["detail"] == {"flow": "demo", "flow_version": "1", "priority": 5}


def test_resubmitting_the_same_run_is_a_no_op(worker: Conn, admin_conn: Conn) -> None:
    submit(worker, "r1", {"a": 1, "b": [1, 2]})

    with unchanged(admin_conn):
        # Same JSON value, keys in another order: jsonb compares values, not text.
        assert submit(worker, "r1", {"b": [1, 2], "a": 1}) == ("r1", False)
        assert submit(worker, "r1", {"a": 1, "b": [1, 2]}) == ("r1", False)


def test_resubmitting_a_claimed_run_does_not_touch_it(worker: Conn, admin_conn: Conn) -> None:
    submit(worker, "r1", {"a": 1})
    [lease] = claim(worker)

    with unchanged(admin_conn):
        assert submit(worker, "r1", {"a": 1}) == ("r1", False)
    assert run_row(admin_conn, "r1")["lease_id"] == lease.lease_id


CONFLICTS = [
    ("other input", "demo", "1", {"a": 2}, "with another input"),
    ("other version", "demo", "2", {"a": 1}, "submitted demo@2"),
    ("other flow", "other", "1", {"a": 1}, "submitted other@1"),
    ("empty input", "demo", "1", {}, "with another input"),
]


def test_resubmitting_with_anything_different_is_a_conflict(worker: Conn, admin_conn: Conn) -> None:
    submit(worker, "r1", {"a": 1})

    for case, flow, version, input, says in CONFLICTS:
        with refused(admin_conn, "RL005", case) as info:
            submit(worker, "r1", input, flow=flow, version=version)
        assert "r1" in info.value.diag.message_primary, case
        assert "existing run r1 is demo@1" in info.value.diag.message_detail, case
        assert says in info.value.diag.message_detail, case


async def test_store_maps_run_conflict(store: Any, admin_conn: Conn) -> None:
    first = await store.worker.submit_run("r1", "demo", "1", {"a": 1})
    again = await store.worker.submit_run("r1", "demo", "1", {"a": 1})
    assert (first.created, again.created) == (True, False)

    with unchanged(admin_conn), pytest.raises(errors.RunConflict) as info:
        await store.worker.submit_run("r1", "demo", "2", {"a": 1})
    assert info.value.run_id == "r1"


# -- run ids ------------------------------------------------------------------------------

BAD_RUN_IDS = {
    "empty": "",
    "129 chars": "a" * 129,
    "leading dash": "-abc",
    "leading dot": ".abc",
    "space": "a b",
    "slash": "a/b",
    "newline at end": "abc\n",
    "non-ascii": "r\u00e9sum\u00e9",
}


def test_a_bad_run_id_is_refused_and_nothing_is_written(worker: Conn, admin_conn: Conn) -> None:
    for case, run_id in BAD_RUN_IDS.items():
        with refused(admin_conn, "RL006", case) as info:
            submit(worker, run_id)
        assert "invalid run id" in info.value.diag.message_primary, case
    with refused(admin_conn, "RL006", "NULL"):
        worker.execute("SELECT * FROM runledger.submit_run(NULL, 'demo', '1', '{}'::jsonb)")


def test_every_allowed_run_id_shape_is_accepted(worker: Conn, admin_conn: Conn) -> None:
    good = ["a" * 128, "0", "A.b_c:d@e-f", "tenant-1:job@2024-01-01"]
    for run_id in good:
        assert submit(worker, run_id) == (run_id, True), run_id
    assert count(admin_conn, "runs") == len(good)


def test_a_bad_flow_name_or_version_is_refused(worker: Conn, admin_conn: Conn) -> None:
    bad = [
        ("", "1"),
        ("de mo", "1"),
        ("demo@1", "1"),
        ("-demo", "1"),
        ("demo", ""),
        ("demo", "1 0"),
        ("demo", "@1"),
        ("demo", "v" * 65),
    ]
    for flow, version in bad:
        with refused(admin_conn, "RL006", (flow, version)):
            submit(worker, "r1", flow=flow, version=version)


# -- input --------------------------------------------------------------------------------


def test_input_that_is_not_an_object_is_refused(worker: Conn, admin_conn: Conn) -> None:
    for literal in ["[]", "[1, 2]", '"text"', "42", "null", "true"]:
        with refused(admin_conn, "RL006", literal) as info:
            worker.execute(
                "SELECT * FROM runledger.submit_run('r1', 'demo', '1', %s::jsonb)", (literal,)
            )
        assert "input must be a JSON object" in info.value.diag.message_primary, literal
    with refused(admin_conn, "RL006", "SQL NULL"):
        worker.execute("SELECT * FROM runledger.submit_run('r1', 'demo', '1', NULL)")


def _object_of_size(size: int) -> dict[str, str]:
    """An object whose jsonb text form is exactly ``size`` bytes: {"pad": "..."}."""
    overhead = len('{"pad": ""}')
    value = {"pad": "x" * (size - overhead)}
    assert len(json.dumps(value).encode()) == size
    return value


def test_input_at_the_payload_cap_is_accepted_and_one_byte_over_is_refused(
    worker: Conn, admin_conn: Conn
) -> None:
    set_payload_cap(admin_conn, 2048)

    assert submit(worker, "fits", _object_of_size(2048)) == ("fits", True)
    with refused(admin_conn, "RL006") as info:
        submit(worker, "over", _object_of_size(2049))
    assert "2049 bytes" in info.value.diag.message_primary
    assert "2048" in info.value.diag.message_primary


def test_multibyte_input_is_measured_in_bytes(worker: Conn, admin_conn: Conn) -> None:
    set_payload_cap(admin_conn, 2048)
    # 700 three-byte characters: 700 characters, 2100 bytes.
    with refused(admin_conn, "RL006"):
        submit(worker, "wide", {"s": "\u20ac" * 700})


async def test_default_cap_refuses_an_input_over_one_mebibyte(store: Any, admin_conn: Conn) -> None:
    cap = one(admin_conn, "SELECT max_payload_bytes FROM runledger.settings")
    assert cap == {"max_payload_bytes": 1024 * 1024}
    big = {"blob": "x" * 1_100_000}

    with unchanged(admin_conn), pytest.raises(errors.InvalidInput) as info:
        await store.worker.submit_run("big", "demo", "1", big)

    assert "over the cap of 1048576 bytes" in info.value.message
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert info.value.__cause__.sqlstate == "RL006"
    # Just under the cap goes through.
    assert (await store.worker.submit_run("fits", "demo", "1", {"blob": "x" * 1_000_000})).created


# -- NUL characters ------------------------------------------------------------------


NUL_CASES = [
    ("r1", {"title": "a\x00b"}, "input"),
    ("r1", {"a\x00": 1}, "input"),
    ("r1", {"deep": [{"x": "\x00"}]}, "input"),
    ("r\x001", {"a": 1}, "run id"),
]


async def test_store_refuses_nul_before_sending(store: Any, admin_conn: Conn) -> None:
    for run_id, input, field in NUL_CASES:
        with unchanged(admin_conn, input), pytest.raises(errors.InvalidInput) as info:
            await store.worker.submit_run(run_id, "demo", "1", input)
        assert info.value.message.startswith(field), info.value.message
        assert "NUL" in info.value.message
        assert info.value.__cause__ is None  # refused client-side: no driver error behind it


def test_the_server_refuses_a_nul_escape_in_jsonb(worker: Conn, admin_conn: Conn) -> None:
    with refused(admin_conn, "22P05"):
        worker.execute(
            "SELECT * FROM runledger.submit_run('r1', 'demo', '1', %s::jsonb)",
            ('{"title": "a\\u0000b"}',),
        )
    with refused(admin_conn, "22P05"):
        submit(worker, "r1", {"title": "a\x00b"})  # psycopg sends it as \u0000
    assert count(admin_conn, "runs") == 0


# -- NOTIFY -------------------------------------------------------------------------------


def test_submit_notifies_listeners_with_the_flow_reference(connect: Any, worker: Conn) -> None:
    listener = connect("runledger_worker")
    listener.execute("LISTEN runledger_runs")

    submit(worker, "r1")
    submit(worker, "r1")  # no-op: must not wake anyone
    submit(worker, "r2", flow="other", version="7")

    got = [n for n in listener.notifies(timeout=10, stop_after=2)]
    assert [(n.channel, n.payload) for n in got] == [
        ("runledger_runs", FLOW_REF),
        ("runledger_runs", "other@7"),
    ]


def test_a_refused_submit_sends_no_notification(connect: Any, worker: Conn) -> None:
    listener = connect("runledger_worker")
    listener.execute("LISTEN runledger_runs")

    with sqlstate("RL006"):
        submit(worker, "-bad")
    submit(worker, "ok", flow="marker", version="1")

    got = list(listener.notifies(timeout=10, stop_after=1))
    assert [n.payload for n in got] == ["marker@1"]


def test_available_at_in_the_future_delays_the_claim(worker: Conn, db_clock: DbClock) -> None:
    later = db_clock.now() + dt.timedelta(seconds=60)
    submit(worker, "later", available_at=later)
    submit(worker, "now")

    assert [c.run_id for c in claim(worker, lease_seconds=600)] == ["now"]
    assert claim(worker) == []
    db_clock.advance(61)
    assert [c.run_id for c in claim(worker)] == ["later"]


def test_priority_then_age_orders_claims(worker: Conn) -> None:
    submit(worker, "old-low", priority=0)
    submit(worker, "high", priority=10)
    submit(worker, "new-low", priority=0)

    assert [c.run_id for c in claim(worker, max_runs=1)] == ["high"]
    assert [c.run_id for c in claim(worker, max_runs=1)] == ["old-low"]
    assert [c.run_id for c in claim(worker, max_runs=1)] == ["new-low"]


def test_claims_take_only_the_pinned_flow_versions(worker: Conn, admin_conn: Conn) -> None:
    submit(worker, "v1")
    submit(worker, "v2", version="2")
    submit(worker, "x1", flow="other")

    assert [c.run_id for c in claim(worker, flows=["demo@2"])] == ["v2"]
    assert claim(worker, flows=["demo@3", "nope@1"]) == []
    assert [c.run_id for c in claim(worker, flows=["other@1", "demo@1"])] == ["v1", "x1"]
    assert run_row(admin_conn, "v1")["status"] == "running"


def test_claim_with_a_malformed_flow_reference_is_refused(worker: Conn, admin_conn: Conn) -> None:
    submit(worker, "r1")
    bad: list[list[Any]] = [
        ["demo"],
        ["demo@"],
        ["@1"],
        ["demo@1@2"],
        ["de mo@1"],
        [""],
        ["demo@1", "bad"],
        [None],
    ]
    for flows in bad:
        with refused(admin_conn, "RL006", flows) as info:
            claim(worker, flows=flows)
        assert "flow reference" in info.value.diag.message_primary, flows
    with refused(admin_conn, "RL006", "NULL array"):
        worker.execute("SELECT * FROM runledger.claim_runs_v4('w1', NULL, '30 s', 1)")
    assert run_row(admin_conn, "r1")["status"] == "queued"


def test_claim_with_bad_arguments_is_refused(worker: Conn, admin_conn: Conn) -> None:
    submit(worker, "r1")
    bad = [
        ("empty worker", "", 30, 1),
        ("long worker", "w" * 201, 30, 1),
        ("zero lease", "w1", 0, 1),
        ("negative lease", "w1", -5, 1),
        ("lease over a day", "w1", 86401, 1),
        ("negative max", "w1", 30, -1),
        ("max too big", "w1", 30, 10001),
    ]
    for case, worker_id, lease_seconds, max_runs in bad:
        with refused(admin_conn, "RL006", case):
            claim(worker, worker_id, lease_seconds=lease_seconds, max_runs=max_runs)


def test_raw_jsonb_parameter_round_trips(worker: Conn, admin_conn: Conn) -> None:
    payload = {"unicode": "\u00e9\u20ac\U0001f600", "n": 1.5, "nested": {"list": [None, True]}}
    submit(worker, "r1", payload)
    assert run_row(admin_conn, "r1")["input"] == payload

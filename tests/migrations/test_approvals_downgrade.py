"""Downgrading below 0006 would turn a call awaiting approval into a plain planned call
that the next worker sends unapproved: the downgrade refuses while one waits."""

from __future__ import annotations

import psycopg
import pytest

from runledger.db import migrate
from tests.contract.helpers import call, deny, key, record_v2, submit_and_claim


def test_the_0006_downgrade_refuses_while_a_call_awaits_approval(empty_database_url: str) -> None:
    url = empty_database_url
    migrate.upgrade(url, "0006")
    with psycopg.connect(url, autocommit=True) as conn:
        lease = submit_and_claim(conn)
        record_v2(conn, lease, 0, [{**call("c0"), "approval": True}])
        conn.execute(
            "SELECT runledger.finish_run(%s, %s, %s, 'paused', NULL, 'awaits approval')",
            (lease.run_id, lease.lease_id, lease.token),
        )
        with pytest.raises(psycopg.Error) as caught:
            migrate.downgrade(url, "0005")
        assert caught.value.sqlstate == "RL004"
        assert "1 call(s) await approval" in str(caught.value)
        assert migrate.current(url) == "0006"  # nothing of the downgrade stayed
        deny(conn, key(lease.run_id, 0, "c0"), actor="ops", reason="not now")
    migrate.downgrade(url, "0005")
    assert migrate.current(url) == "0005"

"""The doctor's replication judgement over rows as ``pg_stat_replication`` returns them:
a synchronous standby is never called asynchronous, and one synchronous standby that
commits wait for is a healthy cluster (the default of Patroni's synchronous mode)."""

from __future__ import annotations

from typing import Any

import pytest

from runledger.doctor import OK, WARN, judge_replication


def _settings(commit: str = "on", names: str = "") -> dict[str, Any]:
    return {"names": names, "commit": commit}


def _standby(name: str, sync_state: str | None) -> dict[str, Any]:
    return {
        "application_name": name,
        "client_addr": "127.0.0.1",
        "state": "streaming",
        "sync_state": sync_state,
    }


def test_no_standby_is_ok() -> None:
    status, detail, data = judge_replication(_settings(), [])
    assert status == OK and "no streaming standby" in detail
    assert data["standbys"] == []


def test_hidden_sync_state_warns() -> None:
    status, detail, _ = judge_replication(_settings(), [_standby("s1", None)])
    assert status == WARN and "pg_monitor" in detail


@pytest.mark.parametrize(
    ("states", "commit", "status", "synchronous", "asynchronous"),
    [
        # Patroni's synchronous mode: one sync, one async standby
        (["sync", "async"], "on", OK, ["s1 (sync)"], ["s2 (async)"]),
        (["sync", "potential"], "remote_apply", OK, ["s1 (sync)"], ["s2 (potential)"]),
        (["sync", "async"], "remote_write", OK, ["s1 (sync)"], ["s2 (async)"]),
        (["sync"], "on", OK, ["s1 (sync)"], []),
        (["quorum", "quorum"], "on", OK, ["s1 (quorum)", "s2 (quorum)"], []),
        # commits do not wait for the synchronous standby
        (["sync", "async"], "local", WARN, ["s1 (sync)"], ["s2 (async)"]),
        (["sync"], "off", WARN, ["s1 (sync)"], []),
        # no synchronous standby at all
        (["async"], "on", WARN, [], ["s1 (async)"]),
        (["async", "potential"], "on", WARN, [], ["s1 (async)", "s2 (potential)"]),
    ],
)
def test_synchronous_and_asynchronous_standbys_are_named_apart(
    states: list[str], commit: str, status: str, synchronous: list[str], asynchronous: list[str]
) -> None:
    rows = [_standby(f"s{n}", state) for n, state in enumerate(states, 1)]
    got, detail, data = judge_replication(_settings(commit), rows)
    assert got == status, detail
    assert (data["synchronous"], data["asynchronous"]) == (synchronous, asynchronous)
    assert data["synchronous_commit"] == commit
    if synchronous:
        # never named under "asynchronous standby(s)"
        assert detail.startswith(f"synchronous standby(s): {', '.join(synchronous)}")
        tail = detail.partition("asynchronous standby(s): ")[2]
        assert not any(name in tail for name in synchronous), detail
    if asynchronous and synchronous:
        assert f"asynchronous standby(s): {', '.join(asynchronous)}" in detail
    if status == OK and asynchronous:
        assert "A failover must go to a synchronous standby" in detail
        assert "Patroni's synchronous_mode" in detail
    if not synchronous:
        # the wording of the asynchronous-only case is unchanged
        assert detail.startswith(f"asynchronous standby(s): {', '.join(asynchronous)}. ")
        assert "Use synchronous_standby_names" in detail
    if status == WARN and synchronous:
        assert f"synchronous_commit = {commit}: commits do not wait" in detail


def test_a_potential_standby_is_said_to_be_next_in_line() -> None:
    rows = [_standby("s1", "sync"), _standby("s2", "potential")]
    _, detail, _ = judge_replication(_settings(), rows)
    assert "a potential one becomes synchronous if a synchronous one goes" in detail


def test_quorum_commit_says_which_standby_to_promote() -> None:
    rows = [_standby("s1", "quorum"), _standby("s2", "quorum")]
    status, detail, _ = judge_replication(_settings(names="ANY 1 (s1, s2)"), rows)
    assert status == OK and "only the standby that received the most" in detail


def test_a_standby_without_application_name_is_named_by_address() -> None:
    row = _standby("", "sync") | {"client_addr": "10.0.0.7"}
    _, _, data = judge_replication(_settings(), [row])
    assert data["synchronous"] == ["10.0.0.7 (sync)"]

"""The PostgreSQL fixture never skips: with nothing available it fails and says why."""

from __future__ import annotations

import pytest

from runledger.testing.postgres import NoPostgres, acquire_server, url_with_dbname


def test_no_postgres_is_a_clear_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_TEST_POSTGRES", "url")
    monkeypatch.delenv("RUNLEDGER_TEST_DATABASE_URL", raising=False)
    with pytest.raises(NoPostgres) as info:
        acquire_server()
    message = str(info.value)
    assert "need a real PostgreSQL and found none" in message
    assert "RUNLEDGER_TEST_DATABASE_URL: not set" in message


def test_unknown_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_TEST_POSTGRES", "sqlite")
    with pytest.raises(NoPostgres, match="expected one of"):
        acquire_server()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql://postgres@127.0.0.1:5433/postgres",
            "postgresql://postgres@127.0.0.1:5433/t1",
        ),
        ("postgresql://u:p%40ss@db/x", "postgresql://u:p%40ss@db/t1"),
        (
            "host=/tmp/sock port=5999 user=me dbname=x",
            "postgresql://me@/t1?host=%2Ftmp%2Fsock&port=5999",
        ),
        (  # several hosts stay several (a worker that follows a promotion)
            "postgresql://u@a:1,b:2/x?target_session_attrs=read-write",
            "postgresql://u@a:1,b:2/t1?target_session_attrs=read-write",
        ),
        (
            "host=a,b port=1,2 user=u dbname=x target_session_attrs=read-write",
            "postgresql://u@a:1,b:2/t1?target_session_attrs=read-write",
        ),
        ("host=a,b port=7 user=u dbname=x", "postgresql://u@a:7,b:7/t1"),
    ],
)
def test_url_for_another_database(url: str, expected: str) -> None:
    assert url_with_dbname(url, "t1") == expected

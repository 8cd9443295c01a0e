"""Multi-host URLs (docs/failover.md): every host a promotion may move the primary to,
with ``target_session_attrs=read-write``. libpq and psycopg read them as they are; the
migrations go through SQLAlchemy, which needs its own form of them."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import make_url

from runledger.config import with_connect_timeout
from runledger.db.migrate import sqlalchemy_url


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:p%25w@a:5432,b:5433/app?target_session_attrs=read-write",
        "host=a,b port=5432,5433 user=u password=p%w dbname=app target_session_attrs=read-write",
    ],
)
def test_sqlalchemy_gets_every_host_and_the_session_attrs(url: str) -> None:
    parsed = make_url(sqlalchemy_url(url))
    assert parsed.drivername == "postgresql+psycopg"
    assert parsed.query["host"] == ("a:5432", "b:5433")
    assert parsed.query["target_session_attrs"] == "read-write"
    assert (parsed.username, parsed.password, parsed.database) == ("u", "p%w", "app")


def test_one_port_for_every_host() -> None:
    parsed = make_url(sqlalchemy_url("host=a,b port=6000 user=u dbname=app"))
    assert parsed.query["host"] == ("a:6000", "b:6000")


def test_a_single_host_url_is_as_before() -> None:
    assert sqlalchemy_url("postgresql://u@h:1/db?sslmode=require") == (
        "postgresql+psycopg://u@h:1/db?sslmode=require"
    )


def test_the_workers_connect_timeout_keeps_every_host() -> None:
    url = "postgresql://u@a:1,b:2/app?target_session_attrs=read-write"
    params = conninfo_to_dict(with_connect_timeout(url, 3))
    assert (params["host"], params["port"]) == ("a,b", "1,2")
    assert params["target_session_attrs"] == "read-write"
    assert params["connect_timeout"] == "3"


def test_a_connection_error_names_every_host() -> None:
    from runledger.db.connecting import connect_error

    url = "postgresql://u@a:1,b:2/app?target_session_attrs=read-write"
    error = connect_error(OSError("session is read-only"), url, None)
    assert "PostgreSQL at a:1,b:2 (database 'app')" in str(error)

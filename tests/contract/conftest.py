"""Fixtures for the contract tests: connections that act as each database role.

Each connection is its own session on the test's fresh database, in autocommit, so
one function call is one transaction, as for a worker or an operator in psql. The
role is taken with ``SET ROLE``: the worker connection holds only the privileges of
``runledger_worker`` (no table writes), the operator those of ``runledger_operator``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

Connect = Callable[[str], psycopg.Connection[Any]]


@pytest.fixture
def connect(database_url: str) -> Iterator[Connect]:
    """A factory of new sessions under a given role, closed at the end of the test."""
    with ExitStack() as stack:

        def open_as(role: str) -> psycopg.Connection[Any]:
            conn = stack.enter_context(
                psycopg.connect(database_url, autocommit=True, row_factory=dict_row)
            )
            if role != "admin":
                conn.execute(f"SET ROLE {role}")  # type: ignore[arg-type]
            return conn

        yield open_as


@pytest.fixture
def worker(connect: Connect) -> psycopg.Connection[Any]:
    return connect("runledger_worker")


@pytest.fixture
def worker2(connect: Connect) -> psycopg.Connection[Any]:
    return connect("runledger_worker")


@pytest.fixture
def operator(connect: Connect) -> psycopg.Connection[Any]:
    return connect("runledger_operator")


@pytest.fixture
def auditor(connect: Connect) -> psycopg.Connection[Any]:
    return connect("runledger_auditor")

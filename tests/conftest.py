"""The project's own fixtures: short names over the plugin's ``runledger_*`` fixtures.

Users load the plugin with ``-p runledger.testing`` and use the prefixed names; the
suite keeps its short ones, and its workers run the demo flows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # importing runledger.testing here would defeat the plugin's assert rewriting
    import psycopg

    from runledger.db.store import Store
    from runledger.testing import DbClock, ProviderProcess, WorkerPool

pytest_plugins = ["runledger.testing"]

DEMO_FLOWS = ["runledger.demo.flows:flows"]


@pytest.fixture
def database_url(runledger_database_url: str) -> str:
    return runledger_database_url


@pytest.fixture
def admin_conn(runledger_admin_conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    return runledger_admin_conn


@pytest.fixture
def db_clock(runledger_db_clock: DbClock) -> DbClock:
    return runledger_db_clock


@pytest.fixture
def store(runledger_store: Store) -> Store:
    return runledger_store


@pytest.fixture
def provider(runledger_provider: ProviderProcess) -> ProviderProcess:
    return runledger_provider


@pytest.fixture
def workers(runledger_workers: WorkerPool, provider: ProviderProcess) -> Iterator[WorkerPool]:
    """The plugin's worker pool running the demo flows, with the provider's URL."""
    runledger_workers.flows = list(DEMO_FLOWS)
    yield runledger_workers


@pytest.fixture
def small_disk(runledger_databases: Any) -> Iterator[Any]:
    """A migrated database on a filesystem of its own that the test fills and frees: a
    real full disk (:mod:`tests.small_disk`)."""
    from tests.small_disk import small_disk as make

    with make(runledger_databases) as disk:
        yield disk

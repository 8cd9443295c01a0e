"""Fixtures for the migration tests: empty (never migrated) databases."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from runledger.testing.postgres import Databases


@pytest.fixture
def empty_database_url(runledger_databases: Databases) -> Iterator[str]:
    """A database that no migration has touched (no schema runledger)."""
    url = runledger_databases.create("rl_mig", migrated=False)
    try:
        yield url
    finally:
        runledger_databases.drop(url)


@pytest.fixture
def new_empty_database(runledger_databases: Databases) -> Iterator[Callable[[], str]]:
    """A factory of empty databases, all dropped at the end of the test."""
    urls: list[str] = []

    def make() -> str:
        url = runledger_databases.create("rl_mig", migrated=False)
        urls.append(url)
        return url

    try:
        yield make
    finally:
        for url in urls:
            runledger_databases.drop(url)

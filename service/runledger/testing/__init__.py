"""runledger's pytest plugin and test helpers: a real PostgreSQL per test, a fakeable DB
clock, real worker processes you can kill, and a gated fake provider.

Enable the plugin with ``pytest -p runledger.testing`` (or
``pytest_plugins = ["runledger.testing"]`` in your top-level conftest). Its fixtures are
prefixed ``runledger_`` (see :mod:`runledger.testing.plugin`). The helpers
(:mod:`.postgres`, :mod:`.processes`, :mod:`.provider`) work without pytest too; the
fixtures load only when pytest is importable.

This package never imports :mod:`runledger.demo` (the demo may use it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runledger.testing.processes import ProviderProcess, WorkerPool, wait_for

if TYPE_CHECKING:
    from runledger.testing.provider import (
        FakeProvider,
        ProviderClient,
        ProviderError,
        make_server,
    )

# Imported on first use, so that ``python -m runledger.testing.provider`` does not find its
# own module already imported by this package.
_FROM_PROVIDER = frozenset({"FakeProvider", "ProviderClient", "ProviderError", "make_server"})


def __getattr__(name: str) -> Any:
    if name in _FROM_PROVIDER:
        from runledger.testing import provider

        return getattr(provider, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FakeProvider",
    "ProviderClient",
    "ProviderError",
    "ProviderProcess",
    "WorkerPool",
    "make_server",
    "wait_for",
]

try:
    import pytest  # noqa: F401
    import pytest_asyncio  # noqa: F401
except ImportError:  # a production install (no runledger-pg[testing]): helpers only
    pass
else:
    from runledger.testing.plugin import (  # noqa: F401
        DbClock,
        pytest_configure,
        runledger_admin_conn,
        runledger_database_url,
        runledger_databases,
        runledger_db_clock,
        runledger_flows,
        runledger_provider,
        runledger_server,
        runledger_store,
        runledger_workers,
    )

    __all__ += ["DbClock"]

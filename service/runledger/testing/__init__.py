"""runledger's pytest plugin: a real PostgreSQL per test, a fakeable DB clock, real
worker processes you can kill, and a fake provider.

Enable it with ``-p runledger.testing`` or ``pytest_plugins = ["runledger.testing"]``.
The process and server helpers (:mod:`.postgres`, :mod:`.processes`) work without
pytest too; the fixtures load only when pytest is importable.
"""

from __future__ import annotations

from runledger.testing.processes import ProviderProcess, WorkerPool, wait_for

__all__ = ["ProviderProcess", "WorkerPool", "wait_for"]

try:
    import pytest  # noqa: F401
except ImportError:  # a production install: helpers only
    pass
else:
    from runledger.testing.plugin import (  # noqa: F401
        DbClock,
        admin_conn,
        database_url,
        db_clock,
        provider,
        runledger_databases,
        runledger_server,
        store,
        workers,
    )

    __all__ += ["DbClock"]

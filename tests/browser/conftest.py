"""The browser tests use the integration tests' fixtures: a fresh database, in-process
workers (``start_worker``) and the async reads of ``db``."""

from __future__ import annotations

from tests.integration.conftest import db, start_worker

__all__ = ["db", "start_worker"]

"""The provider adapters' tests run real workers on a real database: the integration
suite's fixtures (``db``, ``start_worker``)."""

from tests.integration.conftest import db, start_worker

__all__ = ["db", "start_worker"]

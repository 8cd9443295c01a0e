"""The store: one :class:`~runledger.db.execution.Executor` and the two stores over it.

- :class:`~runledger.db.worker_store.WorkerStore` (``store.worker``): what a worker
  calls, submit, claim, renew, record a turn, dispatch, complete, finish, release, and
  its registration and heartbeats (``store.worker.registry``);
- :class:`~runledger.db.operator_store.OperatorStore` (``store.operator``): the reads of
  runs, calls and events, and the operator's writes (resolve, approve, deny, cancel,
  retry, prune).

Methods are named for what they do (``claim_runs``, ``record_turn``); which version of
a contract function each one calls is this package's business. Every refusal is mapped
in one place, :func:`runledger.db.sqlstate.map_error`. A process that needs one side only
connects that one (``WorkerStore.connect``, ``OperatorStore.connect``); the client and
the tests take both over one pool.
"""

from __future__ import annotations

from typing import Any

from runledger.db.execution import Executor
from runledger.db.landed import ReadBacks
from runledger.db.operator_store import OperatorStore
from runledger.db.worker_store import WorkerStore

__all__ = ["OperatorStore", "Store", "WorkerStore"]


class Store:
    """A worker store and an operator store over one executor (one pool)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.worker = WorkerStore(executor)
        self.operator = OperatorStore(executor)
        self.landed: ReadBacks = self.worker.landed

    @classmethod
    async def connect(cls, url: str, **options: Any) -> Store:
        """Both stores on one pool: :meth:`Executor.connect`'s options."""
        return cls(await Executor.connect(url, **options))

    async def close(self) -> None:
        await self.worker.close()  # its coalescers, then the executor

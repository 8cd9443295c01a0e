"""runledger's contract without its worker: bare clients (``peers.rl_sql_client``) send
the worker's statements for the same runs. The floor its SQL puts under the worker."""

from __future__ import annotations

import sys

from peers.harness import Procs
from peers.rl_side import Runledger


class RunledgerSql(Runledger):
    """System ``runledger-sql``: this tree's database and runs, ``clients`` bare clients
    (1 in the sequential batch) in place of the worker processes."""

    def __init__(self, clients: int) -> None:
        super().__init__(workers=clients, concurrency=1)  # a client in a worker's place
        self.name = "runledger-sql"

    def setup(self, sequential: bool) -> str:
        n = 1 if sequential else self.workers
        return f"{n} bare client{'s' if n > 1 else ''}, the worker's statements, no worker"

    def start(self, url: str, sequential: bool, procs: Procs) -> None:
        for i in range(1 if sequential else self.workers):
            procs.start([sys.executable, "-m", "peers.rl_sql_client", url, str(i)])

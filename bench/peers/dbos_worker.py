"""A DBOS worker process of the peer benchmark (run as a script by ``dbos_side``).

    python dbos_worker.py URL QUEUE CONCURRENCY POLL_SECONDS

The workflow ``agent_run`` calls 9 ``@DBOS.step()`` functions, 3 "turns" of 3 no-op
steps. The process dequeues from the queue ``QUEUE`` with ``worker_concurrency`` =
CONCURRENCY and polls it every POLL_SECONDS. No conductor key: it runs offline.
SIGTERM stops it (DBOS.destroy).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from dbos import DBOS, DBOSConfig

APP = "peers"
VERSION = "1"
TURNS = 3
CALLS_PER_TURN = 3


@DBOS.step()
def tool(turn: int, i: int) -> dict[str, Any]:
    return {"ok": True, "turn": turn, "i": i}


@DBOS.workflow()
def agent_run() -> dict[str, Any]:
    for turn in range(TURNS):
        for i in range(CALLS_PER_TURN):
            tool(turn, i)
    return {"calls": TURNS * CALLS_PER_TURN}


def main() -> int:
    url, queue, concurrency, poll = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    config: DBOSConfig = {
        "name": APP,
        "system_database_url": url,
        "application_version": VERSION,
        "executor_id": f"peers-{os.getpid()}",
        "log_level": "WARNING",
        "run_migrations": False,  # the benchmark ran `dbos migrate` on the template
    }
    DBOS(config=config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    DBOS.launch()
    # Queues live in the system database (so after launch); the queue manager starts a
    # dequeuing thread for it within its 1 s check interval.
    DBOS.register_queue(
        queue,
        worker_concurrency=concurrency,
        polling_interval_sec=poll,
        on_conflict="always_update",
    )
    stop.wait()
    DBOS.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An Absurd worker process of the peer benchmark (run as a script by ``absurd_side``).

    python absurd_worker.py URL QUEUE WORKER_ID CONCURRENCY

The task ``agent-run`` makes 9 steps (``ctx.step``), 3 "turns" of 3 no-op steps, the
same work as the runledger flow's tool calls. SIGTERM stops the worker loop.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from absurd_sdk import Absurd, TaskContext

TURNS = 3
CALLS_PER_TURN = 3


def main() -> int:
    url, queue, worker_id, concurrency = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    app = Absurd(url, queue_name=queue)

    @app.register_task("agent-run")
    def agent_run(params: Any, ctx: TaskContext) -> dict[str, Any]:
        for turn in range(TURNS):
            for i in range(CALLS_PER_TURN):
                ctx.step(f"t{turn}-c{i}", lambda i=i: {"ok": True, "i": i})
        return {"calls": TURNS * CALLS_PER_TURN}

    signal.signal(signal.SIGTERM, lambda *_: app.stop_worker())
    app.start_worker(worker_id=worker_id, concurrency=concurrency)
    app.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

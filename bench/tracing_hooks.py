"""What the tracing hooks (runledger.worker.tracing) cost per run, in-process, no database:
one run span, three turns, three calls (each call's settle an empty coroutine), as the
executor calls them. Three settings, each in a fresh interpreter:

- ``off``: OpenTelemetry never imported (the hooks find ``ActiveRun.trace`` None);
- ``noop``: ``opentelemetry.trace`` imported, no provider configured (no span is made);
- ``sdk``: an SDK TracerProvider whose processor drops every span (the cost of making
  the spans, without an exporter's).

    python bench/tracing_hooks.py [--runs 20000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import asyncio, datetime as dt, json, sys, time, uuid
mode, runs = sys.argv[1], int(sys.argv[2])
if mode in ("noop", "sdk"):
    from opentelemetry import trace
if mode == "sdk":
    from opentelemetry.sdk.trace import TracerProvider, SpanProcessor
    provider = TracerProvider()
    provider.add_span_processor(SpanProcessor())
    trace.set_tracer_provider(provider)
from runledger.model import Call, CallStatus, ClaimedRun, FinishStatus
from runledger.worker import tracing
from runledger.worker.runs import ActiveRun

class Calls:
    @tracing.call_span
    async def settle(self, active, flow, call):
        return None, None

calls = Calls()
def claim(i):
    return ClaimedRun(run_id=f"r{i}", flow="f", flow_version="1", input={}, state=None,
        state_version=0, fencing_token=1, lease_id=uuid.uuid4(),
        lease_expires_at=dt.datetime.now(dt.timezone.utc), takeover=False)
call = Call(run_id="r", turn=0, call_id="c0", position=0, tool="t", args={},
    idempotency_key="r:0:c0", status=CallStatus.PLANNED, attempts=0, result=None,
    receipt=None, error=None, dispatched_token=None, completed_token=None)

async def one(i):
    active = ActiveRun(claim=claim(i), deadline=time.monotonic() + 60)
    async with tracing.run(active, "w"):
        for n in range(3):
            tracing.turn(active, n)
            tracing.decided(active, 1)
            await calls.settle(active, None, call)
        tracing.finished(active, FinishStatus.SUCCEEDED, None)

async def main():
    for i in range(200):
        await one(i)
    t0 = time.perf_counter()
    for i in range(runs):
        await one(i)
    return (time.perf_counter() - t0) / runs

print(json.dumps({"mode": mode, "us_per_run": asyncio.run(main()) * 1e6}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20_000)
    args = parser.parse_args()
    for mode in ("off", "noop", "sdk"):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(args.runs)],
            capture_output=True,
            text=True,
            check=True,
        )
        print(out.stdout.strip())


if __name__ == "__main__":
    main()

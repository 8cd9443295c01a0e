"""Console page load times on a large table: 100,000 runs (docs/console.md, "Cost").

Run by hand, never from pytest::

    .venv/bin/python bench/console_load.py [--runs 100000] [--reps 30] [--no-browser]

The runs are planted by INSERT as the admin (as docs/operating.md's million-run table
was): 90% succeeded, 5% failed, 2% queued, 1% each running, paused (each on one unknown
call, so the inbox holds 1% of the runs) and cancelled, three events each. Then a real
``runledger console`` process (read-only, reading as runledger_auditor) is timed:

- HTTP: each page and /api document over one keep-alive connection, ``--reps`` times
  after 3 warm-ups (p50, p95, max, bytes);
- browser: a headless Chromium navigation of each page (Navigation Timing: first byte,
  DOMContentLoaded and load, from the start of the navigation), ``--reps`` // 3 times.

Data (markdown tables) on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import database, say

CHROMIUM = os.environ.get("RUNLEDGER_TEST_CHROMIUM", "/usr/bin/chromium")

PLANT = """
WITH g AS (
    SELECT i, CASE WHEN i %% 100 < 90 THEN 'succeeded' WHEN i %% 100 < 95 THEN 'failed'
                   WHEN i %% 100 < 97 THEN 'queued' WHEN i %% 100 = 97 THEN 'running'
                   WHEN i %% 100 = 98 THEN 'paused' ELSE 'cancelled' END AS status,
           runledger.now() - make_interval(secs => %(n)s - i) AS at
    FROM generate_series(1, %(n)s) i
)
INSERT INTO runledger.runs (run_id, flow, flow_version, status, input, state, state_version,
                            fencing_token, claims, lease_id, lease_owner, lease_expires_at,
                            pause_reason, result, error, available_at, created_at, updated_at,
                            finished_at)
SELECT 'b-' || lpad(i::text, 7, '0'), 'payments', '1', status,
       jsonb_build_object('order', i, 'amount', i %% 500), NULL, 0,
       CASE WHEN status = 'queued' THEN 0 ELSE 1 END,
       CASE WHEN status = 'queued' THEN 0 ELSE 1 END,
       CASE WHEN status = 'running' THEN gen_random_uuid() END,
       CASE WHEN status = 'running' THEN 'w-bench' END,
       CASE WHEN status = 'running' THEN runledger.now() + interval '30 s' END,
       CASE WHEN status = 'paused' THEN 'call b-' || lpad(i::text, 7, '0')
            || ':0:c0 is unknown' END,
       CASE WHEN status = 'succeeded' THEN jsonb_build_object('charged', i %% 500) END,
       CASE WHEN status = 'failed' THEN '{"reason": "declined"}'::jsonb END,
       at, at, at + interval '1 s',
       CASE WHEN status IN ('succeeded', 'failed', 'cancelled') THEN at + interval '1 s' END
FROM g
"""

PLANT_CALLS = """
INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, created_at, record)
SELECT run_id, 0, '[{"call_id": "c0", "tool": "charge", "args": {"amount": 42}}]', 1,
       created_at, '{"role": "assistant", "content": "charging"}'
FROM runledger.runs WHERE status IN ('succeeded', 'failed', 'paused', 'running');
INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args, idempotency_key,
                                 status, attempts, result, receipt, error, dispatched_by,
                                 dispatched_token, dispatched_at, completed_by,
                                 completed_token, completed_at)
SELECT run_id, 0, 'c0', 0, 'charge', '{"amount": 42, "card": "4242-xxxx"}', run_id || ':0:c0',
       CASE status WHEN 'paused' THEN 'unknown' WHEN 'running' THEN 'dispatched'
                   WHEN 'failed' THEN 'failed' ELSE 'succeeded' END,
       1,
       CASE WHEN status = 'succeeded' THEN '{"charge_id": "ch_1"}'::jsonb END,
       CASE WHEN status = 'succeeded' THEN '{"charge_id": "ch_1"}'::jsonb END,
       CASE WHEN status = 'paused' THEN '{"reason": "ambiguous failure of an unsafe tool"}'::jsonb
            WHEN status = 'failed' THEN '{"reason": "declined"}'::jsonb END,
       'w-bench', 1, created_at,
       CASE WHEN status IN ('succeeded', 'failed', 'paused') THEN 'w-bench' END,
       CASE WHEN status IN ('succeeded', 'failed', 'paused') THEN 1 END,
       CASE WHEN status IN ('succeeded', 'failed', 'paused') THEN created_at END
FROM runledger.runs WHERE status IN ('succeeded', 'failed', 'paused', 'running');
INSERT INTO runledger.run_events (run_id, at, kind, actor, fencing_token, state_version, detail)
SELECT run_id, created_at, 'submitted', NULL, NULL, 0,
       '{"flow": "payments", "flow_version": "1", "priority": 0}'::jsonb
FROM runledger.runs
UNION ALL
SELECT run_id, created_at, 'claimed', 'w-bench', 1, 0, '{}'::jsonb
FROM runledger.runs WHERE status <> 'queued'
UNION ALL
SELECT run_id, updated_at, CASE status WHEN 'succeeded' THEN 'run_succeeded'
                                       WHEN 'failed' THEN 'run_failed'
                                       WHEN 'paused' THEN 'run_paused'
                                       ELSE 'run_cancelled' END, 'w-bench', 1, 0, '{}'::jsonb
FROM runledger.runs WHERE status IN ('succeeded', 'failed', 'paused', 'cancelled')
ORDER BY 3;
"""


def plant(url: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        t0 = time.monotonic()
        conn.execute(
            "SELECT * FROM runledger.register_worker_v2("
            "'w-bench', 'bench-host', 1, ARRAY['payments@1'], false)"
        )
        conn.execute(PLANT, {"n": n})
        conn.execute(PLANT_CALLS)
        conn.execute("ANALYZE")
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM runledger.runs), (SELECT count(*) FROM "
            "runledger.run_calls), (SELECT count(*) FROM runledger.run_events), "
            "pg_size_pretty(pg_total_relation_size('runledger.runs'))"
        ).fetchone()
        say(f"planted {counts} in {time.monotonic() - t0:.1f} s")


class Console:
    def __init__(self, url: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLEDGER_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runledger", "console", "--database-url", url, "--port", "0"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.base: str | None = None
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                m = re.match(r"runledger console: (http://\S+?)/ ", line)
                if m:
                    self.base = m.group(1)
                    ready.set()
                else:
                    sys.stderr.write(line)
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(60)
        if self.base is None:
            raise RuntimeError("the console did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ms(values: list[float]) -> tuple[float, float, float]:
    values = sorted(values)
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return statistics.median(values) * 1000, p95 * 1000, values[-1] * 1000


def targets(url: str, n: int) -> list[tuple[str, str]]:
    with psycopg.connect(url, autocommit=True) as conn:
        (paused,) = conn.execute(
            "SELECT run_id FROM runledger.runs WHERE status = 'paused' ORDER BY created_at "
            "DESC LIMIT 1"
        ).fetchone() or ("?",)
        (middle,) = conn.execute(
            "SELECT created_at::text || '|' || run_id FROM runledger.runs "
            "ORDER BY created_at DESC, run_id DESC OFFSET %s LIMIT 1",
            (n // 2,),
        ).fetchone() or ("?",)
    cursor = httpx.QueryParams({"before": middle.replace(" ", "T")})
    return [
        ("runs (newest 50)", "/runs"),
        ("runs, status=paused", "/runs?status=paused"),
        (f"runs, page {n // 100 + 1:,} (cursor)", f"/runs?{cursor}"),
        ("run page (paused, unknown call)", f"/runs/{paused}"),
        ("inbox (the oldest 200)", "/inbox"),
        (f"inbox, limit=1000 ({n // 100:,} calls)", "/inbox?limit=1000"),
        ("workers", "/workers"),
        ("/api/runs", "/api/runs"),
        ("/api/runs?status=paused", "/api/runs?status=paused"),
        ("/api/runs/{id}", f"/api/runs/{paused}"),
        (f"/api/inbox ({n // 100:,} calls)", "/api/inbox"),
    ]


def http_times(base: str, pages: list[tuple[str, str]], reps: int) -> None:
    print(f"\n### HTTP ({reps} requests each, keep-alive, after 3 warm-ups)\n")
    print("| page | p50 ms | p95 ms | max ms | bytes |")
    print("| --- | --- | --- | --- | --- |")
    with httpx.Client(base_url=base, timeout=30) as client:
        for name, path in pages:
            for _ in range(3):
                assert client.get(path).status_code == 200, path
            times = []
            size = 0
            for _ in range(reps):
                t0 = time.perf_counter()
                r = client.get(path)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200, (path, r.text[:200])
                size = len(r.content)
            p50, p95, top = ms(times)
            print(f"| {name} | {p50:.1f} | {p95:.1f} | {top:.1f} | {size:,} |")


def browser_times(base: str, pages: list[tuple[str, str]], reps: int) -> None:
    import asyncio

    from playwright.async_api import async_playwright

    async def run() -> None:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM, args=["--headless", "--no-sandbox"]
            )
            page = await browser.new_page()
            print(f"\n### Headless Chromium ({reps} navigations each, median ms)\n")
            print("| page | first byte | DOMContentLoaded | load |")
            print("| --- | --- | --- | --- |")
            for name, path in pages:
                if path.startswith("/api"):
                    continue
                rows: list[dict[str, Any]] = []
                for i in range(reps + 1):
                    await page.goto(base + path, wait_until="load")
                    timing = await page.evaluate(
                        "JSON.stringify(performance.getEntriesByType('navigation')[0])"
                    )
                    if i:  # the first one warms the cache of the stylesheet and script
                        import json

                        rows.append(json.loads(timing))

                def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
                    return statistics.median(r[key] - r["startTime"] for r in rows)

                print(
                    f"| {name} | {med('responseStart'):.0f} | "
                    f"{med('domContentLoadedEventEnd'):.0f} | {med('loadEventEnd'):.0f} |"
                )
            await browser.close()

    asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-browser", action="store_true")
    args = parser.parse_args()
    with database() as db:
        url = db.fresh("runledger_console_bench")
        say(f"database: {db.source}, PostgreSQL {db.version}")
        plant(url, args.runs)
        auditor = url + ("&" if "?" in url else "?") + "options=-crole%3Drunledger_auditor"
        console = Console(auditor)
        try:
            assert console.base is not None
            pages = targets(url, args.runs)
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"## runledger console on {args.runs:,} runs (PostgreSQL {db.version})")
            print(f"\n{os.cpu_count()} cores; load average before: {load}")
            http_times(console.base, pages, args.reps)
            if not args.no_browser:
                browser_times(console.base, pages, max(3, args.reps // 3))
        finally:
            console.stop()


if __name__ == "__main__":
    main()

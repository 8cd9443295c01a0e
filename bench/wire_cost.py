"""What one hot-path statement costs the worker's process: psycopg's cursor vs runledger.db.wire.

Run by hand (``bench/README.md``, "wire_cost.py"). One process, one connection, the same
prepared statement, alternating the two ways rep by rep: a ``complete_call_v2``-shaped
``SELECT`` of 8 typed parameters (two of them ``jsonb``) that returns one integer. The
client's CPU (user + system) per statement is what is compared; the server's work is the
same both ways.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runledger.db import wire

from _common import database, say, table

SQL_CURSOR = (
    "SELECT length(%s::text) + length(%s::uuid::text) + %s::bigint + length(%s::text)"
    " + length(%s::text) + length(%s::jsonb::text) + length(%s::jsonb::text)"
    " + length(%s::text) AS attempt"
)
STMT = wire.Prepared(
    "bench_wire_cost",
    "SELECT length($1::text) + length($2::uuid::text) + $3::bigint + length($4::text)"
    " + length($5::text) + length($6::jsonb::text) + length($7::jsonb::text)"
    " + length($8::text) AS attempt",
    8,
)


def _params() -> tuple[Any, ...]:
    return (
        "run-000001",
        uuid.uuid4(),
        12,
        "run-000001:0:c1",
        "succeeded",
        Jsonb({"ok": True, "n": 3}),
        Jsonb({"provider": "x"}),
        "run-000001:0:c2",
    )


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _cursor(conn: psycopg.AsyncConnection[Any]) -> int:
    async with conn.cursor(row_factory=dict_row) as cur:  # as Store._rows sends statements
        await cur.execute(SQL_CURSOR, _params(), prepare=True)
        rows = await cur.fetchall()
    return int(rows[0]["attempt"])


async def _wire(conn: psycopg.AsyncConnection[Any]) -> int:
    rows = await wire.execute(conn, STMT, _params())
    return int(rows[0]["attempt"])


async def _measure(url: str, reps: int, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"cursor": [], "wire": []}
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        ways = (("cursor", _cursor), ("wire", _wire))
        for fn in (_cursor, _wire):
            assert await fn(conn) == await _cursor(conn)  # the same answer both ways
            for _ in range(200):
                await fn(conn)
        for rep in range(reps):
            for name, fn in ways if rep % 2 == 0 else ways[::-1]:
                c0, w0 = _cpu(), time.perf_counter()
                for _ in range(n):
                    await fn(conn)
                out[name].append((_cpu() - c0) / n * 1e6)
                out[name + " wall"] = [
                    *out.get(name + " wall", []),
                    (time.perf_counter() - w0) / n * 1e6,
                ]
            say(f"rep {rep + 1}/{reps} done")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--statements", type=int, default=2000, help="per rep and way")
    args = ap.parse_args()
    with database() as db:
        got = asyncio.run(_measure(db.url, args.reps, args.statements))
    med = {k: statistics.median(v) for k, v in got.items()}
    rows = [
        [
            way,
            f"{med[way]:.1f} [{min(got[way]):.1f}-{max(got[way]):.1f}]",
            f"{med[way + ' wall']:.1f}",
            f"{med[way] / med['cursor']:.2f}",
        ]
        for way in ("cursor", "wire")
    ]
    print(f"{args.reps} reps x {args.statements} statements per way, alternating; {db.version}")
    print(table(["way", "client CPU us/statement", "wall us/statement", "vs cursor"], rows))


if __name__ == "__main__":
    main()

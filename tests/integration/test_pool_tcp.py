"""The pooled connections carry libpq's TCP keepalives and ``tcp_user_timeout``
(``runledger.db.connecting.POOL_TCP``), unless the URL sets its own: a primary cut off
the network fails a statement in flight within seconds, and the worker's pool reconnects
to the new primary (tests/process/test_patroni.py's ``cut``), instead of every pooled
connection waiting for the kernel to give up retransmitting."""

from __future__ import annotations

from typing import Any

from runledger.db.connecting import POOL_TCP
from runledger.db.execution import Executor


async def _options(url: str) -> dict[str, Any]:
    executor = await Executor.connect(url, min_size=1, max_size=1)
    try:
        async with executor.pool.connection() as conn:
            return {
                o.keyword.decode(): (o.val or b"").decode()
                for o in conn.pgconn.info
                if o.keyword.decode() in POOL_TCP
            }
    finally:
        await executor.close()


async def test_pooled_connections_fail_a_dead_socket_in_seconds(database_url: str) -> None:
    assert await _options(database_url) == POOL_TCP


async def test_the_urls_own_settings_are_kept(database_url: str) -> None:
    sep = "&" if "?" in database_url else "?"
    options = await _options(f"{database_url}{sep}keepalives_idle=30&tcp_user_timeout=0")
    assert options == {**POOL_TCP, "keepalives_idle": "30", "tcp_user_timeout": "0"}

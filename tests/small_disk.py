"""A database on a small filesystem of its own, which a test fills to the last byte and
frees again: a real full disk (ENOSPC, SQLSTATE 53100), no mock.

:func:`small_disk` mounts a tmpfs, makes it a tablespace of the test server and clones
the migrated template into a database in it: every relation of that database (catalogs
and runledger's tables) lives on the small filesystem; WAL does not (the data
directory's). ``fill()`` writes a filler file (root's) until the filesystem has no byte
left; ``free()`` deletes it. Full, a write that needs a new page (a table's first row, a
value large enough to be stored out of line) fails with 53100; a row that fits in a page
the relation has still lands, and every read works.

It needs root (mount) and the server on this machine (its tablespace directory is a
local path): otherwise the test is skipped, saying why, except under ``CI=true``, where
it fails (CI runs as root on local binaries).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from runledger.testing.postgres import Databases

SIZE = "64m"  # the migrated template takes ~2.5 MB of it


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true: {why}")
    pytest.skip(why)


def _cluster_user() -> pwd.struct_passwd:
    for name in ("postgres", "runledger_pg"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    pytest.fail("running as root and no postgres user owns the test cluster")


@dataclass
class SmallDisk:
    """``url``: a migrated database whose every relation is on the small filesystem."""

    url: str
    mount: Path

    @property
    def filler(self) -> Path:
        return self.mount / "filler"

    def fill(self) -> None:
        """Write the filler until the filesystem is full: nothing more fits."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 20, 1 << 12):
                block = bytes(chunk)
                while True:
                    try:
                        os.write(fd, block)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        assert os.statvfs(self.mount).f_bavail == 0

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@contextlib.contextmanager
def small_disk(databases: Databases) -> Iterator[SmallDisk]:
    """A :class:`SmallDisk` on ``databases``' server; everything is removed after."""
    if os.geteuid() != 0:
        _unavailable("a full disk needs root (a tmpfs mounted for a tablespace)")
    if databases.server.backend not in ("local", "embedded"):
        _unavailable(
            f"a full disk needs the test server on this machine, not {databases.server.backend}"
        )
    user = _cluster_user()
    mount = Path(tempfile.mkdtemp(prefix="runledger-disk-"))
    name = f"rl_disk_{uuid.uuid4().hex[:12]}"
    admin = databases.server.admin_url
    mounted = created = False
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0755", "tmpfs", str(mount)],
            check=True,
            capture_output=True,
            timeout=30,
        )
        mounted = True
        space = mount / "pg"
        space.mkdir()
        os.chown(space, user.pw_uid, user.pw_gid)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE TABLESPACE {} LOCATION {}").format(
                    sql.Identifier(name), sql.Literal(str(space))
                )
            )
            created = True
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {} TABLESPACE {}").format(
                    sql.Identifier(name),
                    sql.Identifier(databases.template),
                    sql.Identifier(name),
                )
            )
        disk = SmallDisk(url=databases.server.url_for(name), mount=mount)
        # the first session of a database writes its relation-cache init file there: a
        # database that has had sessions has one (a full disk fails no connection)
        with psycopg.connect(disk.url, autocommit=True) as conn:
            conn.execute("SELECT count(*) FROM runledger.runs")
        try:
            yield disk
        finally:
            disk.free()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            if created:
                conn.execute(sql.SQL("DROP TABLESPACE IF EXISTS {}").format(sql.Identifier(name)))
        if mounted:
            subprocess.run(["umount", str(mount)], check=False, capture_output=True, timeout=30)
        with contextlib.suppress(OSError):
            mount.rmdir()

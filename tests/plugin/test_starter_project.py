"""``runledger init`` from a wheel install: the starter project's own tests pass in a
fresh virtualenv that has only the wheel and its ``[testing]`` extra, in a directory that
holds nothing else, SIGKILLed workers included."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runledger.starter import templates
from runledger.testing.postgres import Server
from tests.plugin.helpers import REPO, passed_count, user_env


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This checkout's wheel, built once per session."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("runledger_pg-*.whl")
    yield built


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(420)
def test_init_from_the_wheel_writes_a_project_whose_tests_pass(
    tmp_path: Path, wheel: Path, runledger_server: Server
) -> None:
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.startswith("runledger/starter/templates/")}
    assert shipped == {f"runledger/starter/templates/{name}.tmpl" for name in templates()}

    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = user_env(None)
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-compile", f"{wheel}[testing]"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    project = tmp_path / "support-bot"
    init = subprocess.run(
        [str(venv / "bin" / "runledger"), "init", str(project)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert init.returncode == 0, init.stdout + init.stderr
    assert sorted(p.name for p in project.iterdir()) == sorted(templates())

    # The server this session already runs (never the one on 5432): the child makes its
    # template database there.
    # `pytest` as the project's README says (its pyproject.toml loads the plugin).
    result = subprocess.run(
        [python, "-m", "pytest", "-q", "-rA"],
        cwd=project,
        env=user_env(runledger_server.admin_url),
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert passed_count(result.stdout) == 2, output
    for name in (
        "test_a_ticket_in_flight_is_sent_again_under_its_key",
        "test_an_email_in_flight_pauses_the_run_for_a_person",
    ):
        assert f"PASSED test_flows.py::{name}" in result.stdout, output

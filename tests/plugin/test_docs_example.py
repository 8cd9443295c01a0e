"""docs/testing.md's "Testing your agent" example runs exactly as shown, so it cannot
drift."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runledger.testing.postgres import Server
from tests.plugin.helpers import docs_example, passed_count, run_pytest, user_env


def test_docs_example_is_a_plain_user_test() -> None:
    code = docs_example()
    assert "runledger.demo" not in code  # no demo internals
    assert "from runledger.testing import" in code
    assert "def test_" in code
    assert "kill_holder" in code and "open_gate" in code and "gate=" in code
    compile(code, "docs/testing.md", "exec")


@pytest.mark.process
def test_docs_example_passes(tmp_path: Path, runledger_server: Server) -> None:
    (tmp_path / "test_refund.py").write_text(docs_example())
    # The server this session already runs: the child finds its template there.
    result = run_pytest(sys.executable, tmp_path, user_env(runledger_server.admin_url))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert passed_count(result.stdout) == 1, output
    assert "PASSED test_refund.py::test_sigkill_mid_call" in result.stdout, output

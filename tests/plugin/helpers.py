"""What the plugin tests share: the example of docs/testing.md and running pytest as a
user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTING_DOC = REPO / "docs" / "testing.md"


def docs_example() -> str:
    """The python block of docs/testing.md's "Testing your agent" section, exactly as shown."""
    text = TESTING_DOC.read_text()
    start = text.index("## Testing your agent")
    end = text.index("\n## ", start + 1)
    blocks = re.findall(r"^```python\n(.*?)^```", text[start:end], re.S | re.M)
    assert len(blocks) == 1, f"expected one python block in the section, found {len(blocks)}"
    return str(blocks[0])


def user_env(database_url: str | None) -> dict[str, str]:
    """The environment of a user's shell: nothing of this suite's pytest or paths."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "RUNLEDGER_", "PYTHON", "VIRTUAL_ENV", "COV_"))
    }
    if database_url is not None:
        env["RUNLEDGER_TEST_DATABASE_URL"] = database_url
        env["RUNLEDGER_TEST_POSTGRES"] = "url"
    return env


def run_pytest(
    python: str, cwd: Path, env: dict[str, str], *args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``python -m pytest -p runledger.testing ARGS`` in ``cwd``, as a user runs it."""
    return subprocess.run(
        [python, "-m", "pytest", "-p", "runledger.testing", "-q", "-rA", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def passed_count(output: str) -> int:
    """N in pytest's final "N passed" line (0 when nothing passed)."""
    m = re.search(r"(\d+) passed", output.strip().splitlines()[-1] if output.strip() else "")
    return int(m.group(1)) if m else 0


def fresh_venv(where: Path, requirement: str) -> Path:
    """A virtualenv at ``where`` with ``requirement`` installed; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-compile", requirement],
        env=user_env(None),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return python

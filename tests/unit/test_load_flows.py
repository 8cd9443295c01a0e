"""``runledger worker --flows``: a flows module that cannot be imported is one line naming
the module and its error, exit 2 (usage), never a traceback.

Real processes (``python -m runledger worker``, as a user runs it, logging configured), in
a directory holding the broken modules; the database URL points at a closed port: the
flows are loaded before anything connects.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

MODULES = {
    "syntax.py": "from runledger import Flow\n\nflow = Flow('a', '1'\n",
    "raises.py": "from runledger import Flow\n\nraise RuntimeError('ticket service\\nexploded')\n",
    "needs.py": "import json\n\nimport not_installed_anywhere_xyz\n",
    "deep.py": "import json\n\nCONFIG = json.loads('{')\n",
}

CASES = [
    (
        "fl_pkg.syntax:flow",
        "error: flows module 'fl_pkg.syntax' failed to import: SyntaxError: "
        "'(' was never closed (syntax.py, line 3)",
    ),
    (
        "fl_pkg.raises:flow",
        "error: flows module 'fl_pkg.raises' failed to import: RuntimeError: "
        "ticket service exploded (fl_pkg/raises.py, line 3)",
    ),
    (  # a dependency it imports is missing: which flows module imported it
        "fl_pkg.needs:flow",
        "error: flows module 'fl_pkg.needs' failed to import: ModuleNotFoundError: "
        "No module named 'not_installed_anywhere_xyz' (fl_pkg/needs.py, line 3)",
    ),
    (  # raised inside the standard library: the line of the user's code that called it
        "fl_pkg.deep:flow",
        "error: flows module 'fl_pkg.deep' failed to import: JSONDecodeError: Expecting "
        "property name enclosed in double quotes: line 1 column 2 (char 1) "
        "(fl_pkg/deep.py, line 3)",
    ),
    (
        "fl_pkg.nothere:flow",
        "error: flows module 'fl_pkg.nothere' not found (No module named 'fl_pkg.nothere'): "
        "is it installed, or importable from the current directory?",
    ),
    ("fl_pkg:nothing", "error: --flows 'fl_pkg:nothing': module fl_pkg has no nothing"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("spec", "line"), CASES, ids=[spec for spec, _ in CASES])
def test_a_flows_module_that_does_not_import_is_one_line_and_exit_2(
    tmp_path: Path, spec: str, line: str
) -> None:
    package = tmp_path / "fl_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, source in MODULES.items():
        (package / name).write_text(source)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"postgresql://u@127.0.0.1:{sock.getsockname()[1]}/db"
    env = {**os.environ, "RUNLEDGER_DATABASE_URL": url, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "runledger", "worker", "--flows", spec],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.splitlines() == [line]

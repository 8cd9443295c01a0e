"""``runledger init DIR`` writes the starter project (runledger.starter), and only into a
new or empty directory (no database; tests/plugin/test_starter_project.py runs the
project's own tests from a wheel install)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runledger.errors import DirectoryNotEmpty, ProjectNotWritten
from runledger.starter import project_name, templates, write_project

FILES = ["README.md", "clients.py", "conftest.py", "flows.py", "pyproject.toml", "test_flows.py"]


def test_the_project_is_its_templates_with_its_name(tmp_path: Path) -> None:
    target = tmp_path / "My Support Bot"
    written = write_project(target)  # a new directory: made
    assert [p.name for p in written] == FILES
    assert sorted(p.name for p in target.iterdir()) == FILES
    for path in written:
        text = path.read_text(encoding="utf-8")
        assert "{{" not in text, path.name
        assert text == templates()[path.name].replace("{{name}}", "my-support-bot")
    assert (target / "README.md").read_text().startswith("# my-support-bot\n")
    assert 'name = "my-support-bot"' in (target / "pyproject.toml").read_text()


def test_the_flow_has_an_idempotent_and_an_unsafe_tool_and_a_sigkill_test() -> None:
    flows, test = templates()["flows.py"], templates()["test_flows.py"]
    assert '@flow.tool(safety="idempotent")' in flows
    assert '@flow.tool(safety="unsafe")' in flows
    assert "kill_holder" in test and "wait_for_held" in test
    for name, text in templates().items():
        if name.endswith(".py"):
            compile(text, name, "exec")


@pytest.mark.parametrize(
    ("name", "expected"),
    [("support", "support"), ("My Bot!", "my-bot"), ("__", "runledger-project")],
)
def test_project_name(tmp_path: Path, name: str, expected: str) -> None:
    assert project_name(tmp_path / name) == expected


def test_an_empty_directory_is_written_into(tmp_path: Path) -> None:
    assert [p.name for p in write_project(tmp_path)] == FILES


def test_a_directory_with_anything_in_it_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    with pytest.raises(DirectoryNotEmpty, match="is not empty"):
        write_project(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".git"]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(DirectoryNotEmpty, match="is not a directory"):
        write_project(a_file)
    assert a_file.read_text() == "mine"


def test_the_command_refuses_a_non_empty_directory_in_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "flows.py").write_text("# mine\n")

    def init() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "runledger", "init", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    refused = init()
    assert refused.returncode == 2, refused
    assert refused.stdout == ""
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: ") and "is not empty" in refused.stderr
    assert (tmp_path / "flows.py").read_text() == "# mine\n"
    assert [p.name for p in tmp_path.iterdir()] == ["flows.py"]

    (tmp_path / "flows.py").unlink()
    written = init()
    assert written.returncode == 0, written
    assert sorted(p.name for p in tmp_path.iterdir()) == FILES
    assert "pytest" in written.stdout


def test_a_directory_that_cannot_be_made_is_one_line_exit_2(tmp_path: Path) -> None:
    """Under a file: mkdir fails. One line, exit 2, no traceback, nothing written."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(ProjectNotWritten, match="cannot make"):
        write_project(a_file / "bot")
    refused = subprocess.run(
        [sys.executable, "-m", "runledger", "init", str(a_file / "bot")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: ") and "cannot make" in refused.stderr
    assert a_file.read_text() == "mine"

"""The oldest end of the adapters' version ranges (``scripts/test-oldest``): the constraints
pin every lower bound of the framework, SDK and provider extras, and the script runs every
test module that imports an adapter, a provider tool or one of their frameworks."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What the adapters and provider tools wrap: a test importing one of these (or runledger's
# adapters and provider tools) tests an end of a version range.
FRAMEWORKS = {
    "agents",
    "anthropic",
    "githubkit",
    "mcp",
    "openai",
    "pydantic_ai",
    "resend",
    "slack_sdk",
    "stripe",
}
OURS = ("runledger.integrations", "runledger.providers")
# what adapters share without importing a framework: no end of a range to test
SHARED = {"runledger.providers.base"}


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "oldest_constraints", ROOT / "scripts" / "oldest_constraints.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules_of_the_ranges() -> list[str]:
    found = []
    for folder in ("unit", "integration", "providers"):
        for path in sorted((ROOT / "tests" / folder).glob("test_*.py")):
            names = imports(path)
            if any(
                n.split(".")[0] in FRAMEWORKS or (n.startswith(OURS) and n not in SHARED)
                for n in names
            ):
                found.append(path.relative_to(ROOT).as_posix())
    return found


def test_the_oldest_pass_runs_every_test_of_an_adapter_or_provider() -> None:
    script = (ROOT / "scripts" / "test-oldest").read_text()
    listed = re.findall(r"^\s+(tests/\S+)$", script, re.MULTILINE)
    assert listed, "scripts/test-oldest lists no tests"
    for entry in listed:
        assert (ROOT / entry).exists(), f"scripts/test-oldest lists {entry}, which is gone"
    missing = [
        path
        for path in modules_of_the_ranges()
        if not any(path == entry or path.startswith(entry + "/") for entry in listed)
    ]
    assert not missing, f"add to scripts/test-oldest: {', '.join(missing)}"


def test_every_adapter_and_provider_extra_has_its_lower_bound_pinned() -> None:
    bounds = generator().lower_bounds()
    assert {
        "anthropic",
        "githubkit",
        "httpx",
        "mcp",
        "openai",
        "openai-agents",
        "pydantic-ai-slim",
        "resend",
        "slack-sdk",
        "stripe",
    } <= set(bounds)
    assert bounds["openai-agents"] == "0.24"
    # the dependencies of the suite itself keep their newest releases
    assert not {"pytest", "playwright", "pytest-xdist"} & set(bounds)


def test_the_constraints_follow_self_references_and_refuse_two_lower_bounds(
    tmp_path: Path,
) -> None:
    module = generator()
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "Runledger_PG"\n[project.optional-dependencies]\n'
        'pydantic-ai = ["pydantic-ai-slim>=2.68,<3"]\nanthropic = ["anthropic>=2.10,<3"]\n'
        'openai = ["openai>=3.51,<4"]\nopenai-agents = ["openai-agents>=0.24,<1"]\n'
        'mcp = ["mcp>=2.3,<3", "pydantic-ai-slim[mcp]>=2.68.0,<3"]\n'
        'http = ["httpx >= 0.28.1"]\nslack = ["slack_sdk>=3.48,<4; python_version >= \'3.9\'"]\n'
        'github = ["githubkit>=0.16,<0.17", "hishel<2"]\n'
        'providers = ["runledger-pg[http,slack,github]"]\n'
        'test = ["pytest>=8"]\n'
    )
    bounds = module.lower_bounds(pyproject)
    assert bounds == {
        "anthropic": "2.10",
        "githubkit": "0.16",
        "httpx": "0.28.1",
        "mcp": "2.3",
        "openai": "3.51",
        "openai-agents": "0.24",
        "pydantic-ai-slim": "2.68",
        "slack-sdk": "3.48",
    }
    assert "openai-agents==0.24\n" in module.constraints(bounds)
    pyproject.write_text(
        pyproject.read_text().replace(
            '"mcp>=2.3,<3", "pydantic-ai-slim[mcp]>=2.68.0',
            '"mcp>=2.3,<3", "pydantic-ai-slim[mcp]>=2.70',
        )
    )
    with pytest.raises(SystemExit, match=r"pydantic-ai-slim has two lower bounds, 2\.68 and 2\.70"):
        module.lower_bounds(pyproject)

"""Arrows point one way (docs/design.md, "The package"), checked over the source's AST.

Every ``import`` counts, also one inside a function or under ``TYPE_CHECKING``: a lazy
import is still an arrow. Rules 1-4 hold over the transitive closure (``db`` importing a
helper that imports ``worker`` is ``db`` importing ``worker``); who may import ``demo``
(rule 5) is about direct imports, since everything that reaches the CLI reaches it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE_ROOT = Path(__file__).resolve().parents[2] / "service"
TOP = "runledger"


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_names(root: Path) -> dict[str, Path]:
    """``runledger.db.store`` -> its file, for every module under ``root/runledger``."""
    names: dict[str, Path] = {}
    for path in sorted((root / TOP).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported(name: str, path: Path, modules: Iterable[str] = ()) -> set[str]:
    """Every module name that ``path`` (module ``name``) imports, relative ones resolved.

    ``from pkg import x`` imports the module ``pkg.x`` when there is one (``modules``),
    else the name ``x`` from ``pkg`` itself. As for ``import pkg.x``, the parent package's
    ``__init__`` running first is not counted: every import would reach it.
    """
    known = set(modules)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Our modules -> the modules of ours they import (names that are modules only)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {
            m
            for m in imported(name, path, modules)
            if within(m, TOP) and m in modules and m != name
        }
    return graph


def chains(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module reachable from ``start``, with the shortest import chain to it."""
    seen: dict[str, list[str]] = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for module in frontier:
            for target in sorted(graph.get(module, ())):
                if target not in seen:
                    seen[target] = [*seen[module], target]
                    nxt.append(target)
        frontier = nxt
    del seen[start]
    return seen


def cycles(graph: dict[str, set[str]]) -> list[tuple[set[str], str]]:
    """Each import cycle: the modules of one strongly connected component, and the
    shortest chain from its first module back to that module."""
    reach = {module: chains(graph, module) for module in graph}
    found: list[tuple[set[str], str]] = []
    seen: set[str] = set()
    for module in sorted(graph):
        back = [t for t in reach[module] if module in graph[t]]  # imports it, reached from it
        if module in seen or not back:
            continue
        component = {module} | {t for t in reach[module] if module in reach[t]}
        seen |= component
        shortest = min((reach[module][t] for t in back), key=len)
        found.append((component, " -> ".join([*shortest, module])))
    return found


# Packages no import cycle may pass through (the CLI, the console and what they share).
ACYCLIC = ("runledger.cli", "runledger.console", "runledger.present")


def cycles_through(graph: dict[str, set[str]], packages: Iterable[str] = ACYCLIC) -> list[str]:
    return [
        chain
        for component, chain in cycles(graph)
        if any(within(m, p) for m in component for p in packages)
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    name: str
    sources: tuple[str, ...]  # packages the rule applies to
    forbidden: tuple[str, ...]  # packages they must not reach
    allowed_sources: tuple[str, ...] = ()  # importers exempt from the rule
    direct_only: bool = False


RULES = (
    Rule(
        name="model and errors import nothing of ours",
        sources=("runledger.model", "runledger.errors"),
        forbidden=(TOP,),
    ),
    Rule(
        name="the data layer never imports worker, flows, cli, client, demo or testing",
        sources=("runledger.db",),
        forbidden=tuple(
            f"{TOP}.{m}" for m in ("worker", "flows", "cli", "client", "demo", "testing")
        ),
    ),
    Rule(
        name="tool-facing code never touches the database",
        sources=("runledger.flows", "runledger.integrations"),
        forbidden=("runledger.db",),
    ),
    Rule(
        name="testing never imports demo",
        sources=("runledger.testing",),
        forbidden=("runledger.demo",),
    ),
    Rule(
        name="the console never imports the CLI",
        sources=("runledger.console",),
        forbidden=("runledger.cli",),
    ),
    Rule(
        name="the presentation module imports neither the CLI nor the console",
        sources=("runledger.present",),
        forbidden=("runledger.cli", "runledger.console"),
    ),
    Rule(
        name="only the CLI imports demo",
        sources=(TOP,),
        forbidden=("runledger.demo",),
        allowed_sources=("runledger.cli", "runledger.demo"),
        direct_only=True,
    ),
)


def violations(graph: dict[str, set[str]], rules: Iterable[Rule] = RULES) -> list[str]:
    found: list[str] = []
    for rule in rules:
        for module in sorted(graph):
            if not any(within(module, s) for s in rule.sources):
                continue
            if any(within(module, a) for a in rule.allowed_sources):
                continue
            reach = (
                {t: [module, t] for t in graph[module]}
                if rule.direct_only
                else chains(graph, module)
            )
            for target, chain in sorted(reach.items()):
                # a module inside a forbidden package may import itself (model ->
                # model.x); "nothing of ours" means nothing outside itself
                if within(target, module) and any(within(module, f) for f in rule.forbidden):
                    continue
                if any(within(target, f) for f in rule.forbidden):
                    found.append(f"{rule.name}: {' -> '.join(chain)}")
    return found


# -- the package itself ----------------------------------------------------------------


def test_the_package_keeps_its_arrows() -> None:
    assert violations(import_graph(SOURCE_ROOT)) == []


def test_no_import_cycle_passes_through_the_cli_or_the_console() -> None:
    assert cycles_through(import_graph(SOURCE_ROOT)) == []


def test_the_checker_sees_the_real_imports() -> None:
    graph = import_graph(SOURCE_ROOT)
    assert "runledger.errors" in graph["runledger.db.store"]
    assert "runledger.demo.run" in graph["runledger.cli.start"]  # a lazy import, inside a function
    assert "runledger.testing.processes" in graph["runledger.demo.run"]  # demo may use testing


# -- the checker against fake module trees ---------------------------------------------

BASE_TREE = {
    "__init__.py": "",
    "model.py": "import dataclasses\n",
    "errors.py": "",
    "config.py": "from runledger.errors import Oops\n",
    "helper.py": "",
    "flows.py": "from runledger.model import Safety\n",
    "client.py": "from runledger.db.store import Store\n",
    "cli.py": "def demo():\n    from runledger.demo.run import run_demo\n",
    "db/__init__.py": "",
    "db/store.py": "from runledger import errors\nfrom runledger.model import Run\n",
    "worker/__init__.py": (
        "from runledger.db.store import Store\nfrom runledger.flows import Flow\n"
    ),
    "integrations/__init__.py": "",
    "integrations/adapter.py": "from runledger.flows import Flow\n",
    "testing/__init__.py": "from runledger.testing.provider import ProviderClient\n",
    "testing/provider.py": "",
    "demo/__init__.py": "",
    "demo/run.py": "from runledger.testing import WorkerPool\nfrom . import flows\n",
    "demo/flows.py": "from runledger.testing.provider import ProviderClient\n",
}


def fake_tree(tmp_path: Path, overrides: dict[str, str]) -> dict[str, set[str]]:
    for rel, source in {**BASE_TREE, **overrides}.items():
        path = tmp_path / TOP / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return import_graph(tmp_path)


def test_the_base_tree_is_clean(tmp_path: Path) -> None:
    graph = fake_tree(tmp_path, {})
    assert violations(graph) == []
    assert cycles(graph) == []
    assert graph["runledger.demo.run"] == {"runledger.testing", "runledger.demo.flows"}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param(
            {"model.py": "from runledger.errors import RunLedgerError\n"},
            "model and errors import nothing of ours: runledger.model -> runledger.errors",
            id="model-imports-errors",
        ),
        pytest.param(
            {"errors.py": "from . import config\n"},
            "model and errors import nothing of ours: runledger.errors -> runledger.config",
            id="errors-relative-import",
        ),
        pytest.param(
            {"model.py": "import runledger\n"},
            "model and errors import nothing of ours: runledger.model -> runledger",
            id="model-imports-the-package",
        ),
        pytest.param(
            {"db/store.py": "def f():\n    from runledger.worker import Worker\n"},
            "never imports worker, flows, cli, client, demo or testing: "
            "runledger.db.store -> runledger.worker",
            id="db-lazy-imports-worker",
        ),
        pytest.param(
            {"db/store.py": "from runledger import flows\n"},
            "runledger.db.store -> runledger.flows",
            id="db-from-package-import-flows",
        ),
        pytest.param(
            {
                "db/store.py": "from runledger import Flow\n",
                "__init__.py": "from runledger.flows import Flow\n",
            },
            "runledger.db.store -> runledger -> runledger.flows",
            id="db-imports-a-name-the-package-re-exports",
        ),
        pytest.param(
            {
                "db/store.py": "import runledger.helper\n",
                "helper.py": "from runledger import cli\n",
            },
            "runledger.db.store -> runledger.helper -> runledger.cli",
            id="db-reaches-cli-through-a-helper",
        ),
        pytest.param(
            {"db/__init__.py": "from ..client import Client\n"},
            "runledger.db -> runledger.client",
            id="db-init-relative-import-client",
        ),
        pytest.param(
            {
                "flows.py": "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from runledger.db.store import Store\n"
            },
            "tool-facing code never touches the database: runledger.flows -> runledger.db.store",
            id="flows-type-checking-import-store",
        ),
        pytest.param(
            {"integrations/adapter.py": "from ..db import store\n"},
            "tool-facing code never touches the database: "
            "runledger.integrations.adapter -> runledger.db.store",
            id="integration-imports-store",
        ),
        pytest.param(
            {"testing/provider.py": "from runledger.demo.flows import flows\n"},
            "testing never imports demo: runledger.testing.provider -> runledger.demo.flows",
            id="testing-imports-demo",
        ),
        pytest.param(
            {
                "console/__init__.py": "",
                "console/pages.py": "def page():\n    from runledger.cli import reads\n",
            },
            "the console never imports the CLI: runledger.console.pages -> runledger.cli",
            id="console-lazy-imports-cli",
        ),
        pytest.param(
            {"present.py": "from runledger import cli\n"},
            "imports neither the CLI nor the console: runledger.present -> runledger.cli",
            id="present-imports-cli",
        ),
        pytest.param(
            {"worker/__init__.py": "import runledger.demo.flows\n"},
            "only the CLI imports demo: runledger.worker -> runledger.demo.flows",
            id="worker-imports-demo",
        ),
    ],
)
def test_a_broken_arrow_is_reported(
    tmp_path: Path, overrides: dict[str, str], expected: str
) -> None:
    found = violations(fake_tree(tmp_path, overrides))
    assert any(expected in v for v in found), found


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param(
            {"cli.py": "from runledger import helper\n", "helper.py": "import runledger.cli\n"},
            ["runledger.cli -> runledger.helper -> runledger.cli"],
            id="cli-and-a-helper",
        ),
        pytest.param(
            {
                "console/__init__.py": "from runledger.console import app\n",
                "console/app.py": "from runledger.console import pages\n",
                "console/pages.py": "def f():\n    from runledger import console\n",
            },
            [
                "runledger.console -> runledger.console.app -> runledger.console.pages -> "
                "runledger.console"
            ],
            id="a-lazy-import-closes-the-cycle",
        ),
        pytest.param(
            {
                "db/store.py": "import runledger.helper\n",
                "helper.py": "import runledger.db.store\n",
            },
            [],
            id="a-cycle-elsewhere-is-left-to-others",
        ),
    ],
)
def test_a_cycle_through_the_cli_or_the_console_is_reported(
    tmp_path: Path, overrides: dict[str, str], expected: list[str]
) -> None:
    assert cycles_through(fake_tree(tmp_path, overrides)) == expected

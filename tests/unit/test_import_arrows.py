"""Arrows point one way (docs/design.md, "The package"), checked over the source's AST.

Every ``import`` counts, also one inside a function or under ``TYPE_CHECKING``: a lazy
import is still an arrow. Rules 1-4 hold over the transitive closure (``db`` importing a
helper that imports ``worker`` is ``db`` importing ``worker``); who may import ``demo``
(rule 5) is about direct imports, since everything that reaches the CLI reaches it.
And no import cycle anywhere in the package: each is reported as one loop of imports.
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


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle: the modules of each strongly connected component of more than
    one module, sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest loop of imports through the first module of ``component``."""
    start = component[0]
    inside = {m: graph.get(m, set()) & set(component) for m in component}
    reach = chains(inside, start)
    back = [m for m in sorted(reach, key=lambda m: len(reach[m])) if start in inside[m]]
    return [*reach[back[0]], start]


def cycle_report(graph: dict[str, set[str]]) -> list[str]:
    """``import cycle: a -> b -> a`` for each cycle, with every module it takes in."""
    return [
        f"import cycle: {' -> '.join(loop(graph, c))} (modules: {', '.join(c)})"
        for c in cycles(graph)
    ]


# -- the package itself ----------------------------------------------------------------


def test_the_package_keeps_its_arrows() -> None:
    assert violations(import_graph(SOURCE_ROOT)) == []


def test_no_import_cycles() -> None:
    assert cycle_report(import_graph(SOURCE_ROOT)) == []


def test_the_checker_sees_the_real_imports() -> None:
    graph = import_graph(SOURCE_ROOT)
    assert "runledger.errors" in graph["runledger.db.worker_store"]
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
            {
                "db/store.py": "from runledger.db import migrate\n",
                "db/migrate.py": "import runledger.db.store\n",
            },
            [
                "import cycle: runledger.db.migrate -> runledger.db.store -> runledger.db.migrate "
                "(modules: runledger.db.migrate, runledger.db.store)"
            ],
            id="two-modules",
        ),
        pytest.param(
            {
                "helper.py": "def f():\n    from runledger import config\n",
                "config.py": "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from runledger.flows import Flow\n",
                "flows.py": "from runledger.helper import f\n",
            },
            [
                "import cycle: runledger.config -> runledger.flows -> runledger.helper -> "
                "runledger.config (modules: runledger.config, runledger.flows, runledger.helper)"
            ],
            id="lazy-and-type-checking-imports-count",
        ),
        pytest.param(
            {
                "db/store.py": "from runledger.db import migrate\n",
                "db/migrate.py": "import runledger.db.store\n",
                "worker/__init__.py": "from runledger.worker import health\n",
                "worker/health.py": "from runledger import worker\n",
            },
            [
                "import cycle: runledger.db.migrate -> runledger.db.store -> runledger.db.migrate "
                "(modules: runledger.db.migrate, runledger.db.store)",
                "import cycle: runledger.worker -> runledger.worker.health -> runledger.worker "
                "(modules: runledger.worker, runledger.worker.health)",
            ],
            id="every-cycle-is-reported",
        ),
    ],
)
def test_an_import_cycle_is_reported(
    tmp_path: Path, overrides: dict[str, str], expected: list[str]
) -> None:
    graph = fake_tree(tmp_path, overrides)
    assert cycle_report(graph) == expected
    assert violations(graph) == []  # a cycle breaks no arrow rule here: only this one sees it


def test_the_base_tree_has_no_cycle(tmp_path: Path) -> None:
    assert cycles(fake_tree(tmp_path, {})) == []

"""The adapters touch no private name of the frameworks they adapt, checked over the AST.

A private name (``_name``, or a module ``pkg._mod``) can change in any release, so an
adapter that reads one breaks on its framework's next release. Under
``service/runledger/integrations`` no module may:

- import a private module or name of ``pydantic_ai``, ``pydantic_graph`` or ``agents``
  (``from pydantic_ai._output import ...``, ``from agents.tool import _x``), or a module
  the SDK names internal (``agents.run_internal``);
- read or write a private attribute of anything but itself (``agent._max_tool_retries``;
  ``self._x`` is the module's own business; ``x.__dunder__`` is Python's);
- reach one by name (``getattr(model, "_supports_...")``, also through a module constant,
  a ``__dunder__``-shaped one included unless it is Python's own).

``ALLOWED`` lists what is left, each with the reason no public name does it: the list only
shrinks. Each adapter checks what it assumes of them when a flow is built (``needs.py``,
run by ``tests/unit/test_adapter_assumptions.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

INTEGRATIONS = Path(__file__).resolve().parents[2] / "service" / "runledger" / "integrations"
FRAMEWORKS = ("pydantic_ai", "pydantic_graph", "agents")
INTERNAL_MODULES = ("agents.run_internal",)  # named internal by the SDK, without a "_"

# Python's own dunders: not a framework's private names.
PYTHON_DUNDERS = {"__name__", "__doc__", "__qualname__", "__module__", "__dict__", "__class__"}

# (module under integrations/, private name): what no public name of the framework does.
ALLOWED = {
    # the Codex tool (agents.extensions.experimental.codex) is a FunctionTool told apart
    # only by this flag; agent_flow refuses it, as an agent tool (its model requests would
    # not be journaled).
    ("openai_agents/tools.py", "_is_codex_tool"),
    # @function_tool on a plain def marks its invoker so; the SDK exposes no other sign,
    # and runledger must run such a tool as a def (it waits for its thread).
    ("openai_agents/tools.py", "__agents_sync_function_tool__"),
}


def private(name: str) -> bool:
    return name.startswith("_") and name not in PYTHON_DUNDERS


def dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def framework(module: str) -> bool:
    return module.split(".")[0] in FRAMEWORKS


def private_module(module: str) -> bool:
    parts = module.split(".")
    return any(private(p) for p in parts) or any(
        module == m or module.startswith(m + ".") for m in INTERNAL_MODULES
    )


def string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` bindings (a name given to getattr through one)."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    out[target.id] = node.value.value
    return out


def private_names(source: str) -> set[str]:
    """Every private framework name ``source`` touches (see the module docstring)."""
    tree = ast.parse(source)
    constants = string_constants(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if framework(alias.name) and private_module(alias.name):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not framework(node.module):
                continue
            if private_module(node.module):
                found.add(node.module)
            found.update(a.name for a in node.names if private(a.name))
        elif isinstance(node, ast.Attribute) and private(node.attr) and not dunder(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
        ):
            arg = node.args[1]
            name = None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
            elif isinstance(arg, ast.Name):
                name = constants.get(arg.id)
            if name is not None and private(name):
                found.add(name)
    return found


def adapter_modules() -> list[Path]:
    return sorted(INTEGRATIONS.rglob("*.py"))


def test_the_scan_sees_every_form_of_a_private_name() -> None:
    """The forms the adapters used before 0.1, each seen (a scan that saw nothing would
    pass whatever the adapters do)."""
    cases = {
        "from pydantic_ai._output import build_retried_tool_return": {"pydantic_ai._output"},
        "import agents.models._retry_runtime": {"agents.models._retry_runtime"},
        "from agents.run_internal.items import prepare": {"agents.run_internal.items"},
        "from agents.tool import _helper": {"_helper"},
        "n = self.agent._max_tool_retries": {"_max_tool_retries"},
        "f = getattr(agent, '_get_model_outside_run', None)": {"_get_model_outside_run"},
        "MARK = '__agents_sync_function_tool__'\nx = getattr(f, MARK, False)": {
            "__agents_sync_function_tool__"
        },
        "tool._output_type_adapter = None": {"_output_type_adapter"},
    }
    for source, expected in cases.items():
        assert private_names(source) == expected, source
    clean = (
        "from pydantic_ai.models.wrapper import WrapperModel\n"
        "from runledger.integrations.openai._shared import x\n"  # ours, not a framework's
        "self._cache = {}\n"
        "super().__init__()\n"
        "call.__name__ = 'tool'\n"
        "y = getattr(item, 'call_id', None)\n"
    )
    assert private_names(clean) == set()


def test_no_adapter_touches_a_private_name_of_its_framework() -> None:
    assert adapter_modules(), f"no modules under {INTEGRATIONS}"
    touched = {
        (path.relative_to(INTEGRATIONS).as_posix(), name)
        for path in adapter_modules()
        for name in private_names(path.read_text())
    }
    new = sorted(touched - ALLOWED)
    assert not new, f"private framework names in integrations/: {new}"
    gone = sorted(ALLOWED - touched)
    assert not gone, f"no longer used, take them out of ALLOWED: {gone}"


@pytest.mark.parametrize("package", ["pydantic_ai"])
def test_an_adapter_that_uses_no_private_name_has_none_allowed(package: str) -> None:
    assert not [entry for entry in ALLOWED if entry[0].startswith(package + "/")]

"""The revisions this code knows, read from the revision files without importing them.

Every :class:`~runledger.db.execution.Executor` checks the schema's revision when it
connects (:func:`behind`): reading the chain from the files (``revision`` and
``down_revision``) costs nothing of Alembic's or SQLAlchemy's import time.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from runledger.errors import ConfigurationError

_PACKAGE = Path(__file__).resolve().parent.parent


# The revisions of the unreleased history that the baseline 0.1 replaced (as in
# migrations/env.py): a database at one of them is behind; `runledger migrate` brings one
# at 0032 to the baseline and refuses the others (SchemaTooOld).
BEFORE_BASELINE = frozenset(f"{n:04d}" for n in range(1, 33))


def migrations_dir() -> Path:
    for candidate in (_PACKAGE / "_migrations", _PACKAGE.parent.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise ConfigurationError("runledger migrations not found (broken installation?)")


def head() -> str:
    """The head revision: the last of :func:`revision_chain` (which refuses a chain that
    is not linear, so there is exactly one)."""
    return revision_chain()[-1]


def behind(revision: str | None) -> bool:
    """True for a schema this code cannot work with until ``runledger migrate``: no revision,
    or one before the head. A revision this code does not know is a newer release's (two
    releases share a database during a rolling deploy): not behind."""
    return revision is None or revision in revision_chain()[:-1] or revision in BEFORE_BASELINE


def _assigned(tree: ast.Module, name: str) -> str | None:
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        value = getattr(node, "value", None)
        if (
            any(isinstance(t, ast.Name) and t.id == name for t in targets)
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str | None)
        ):
            return value.value
    return None


@functools.cache
def revision_chain() -> tuple[str, ...]:
    """The revisions from the first to the head, read from the revision files (``revision``
    and ``down_revision``) without importing Alembic; the head is the last one."""
    parents: dict[str, str | None] = {}
    for path in sorted((migrations_dir() / "versions").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        revision = _assigned(tree, "revision")
        if revision is not None:
            parents[revision] = _assigned(tree, "down_revision")
    children = {parent: rev for rev, parent in parents.items()}
    chain: list[str] = []
    current = children.get(None)
    while current is not None and current not in chain:
        chain.append(current)
        current = children.get(current)
    if len(chain) != len(parents):
        raise ConfigurationError(f"the migrations are not one linear chain: {sorted(parents)}")
    return tuple(chain)

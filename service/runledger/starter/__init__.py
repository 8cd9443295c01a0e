"""``runledger init DIR``: a starter project, written from the templates beside this file.

The project is a flow with an idempotent and an unsafe tool (``flows.py``), the clients
its tools call (``clients.py``: runledger's fake provider until the user writes theirs),
its pytest test that SIGKILLs a worker mid-call with runledger's plugin
(``test_flows.py``), and a README. Each ``templates/NAME.tmpl`` becomes ``NAME``, with
``{{name}}`` replaced by the project's name (the directory's).
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

from runledger.errors import DirectoryNotEmpty, ProjectNotWritten

SUFFIX = ".tmpl"


def templates() -> dict[str, str]:
    """``{file name: template text}`` of the starter project, by file name."""
    folder = resources.files(__name__).joinpath("templates")
    found = {
        item.name.removesuffix(SUFFIX): item.read_text(encoding="utf-8")
        for item in folder.iterdir()
        if item.name.endswith(SUFFIX)
    }
    return dict(sorted(found.items()))


def project_name(directory: Path) -> str:
    """A distribution name (PEP 508) from the directory's name: ``My Bot`` -> ``my-bot``."""
    name = re.sub(r"[^a-z0-9]+", "-", directory.resolve().name.lower()).strip("-")
    return name or "runledger-project"


def write_project(directory: str | os.PathLike[str]) -> list[Path]:
    """Write the starter project into ``directory`` (made when missing, parents too);
    returns the files written, in order.

    Raises :class:`~runledger.errors.DirectoryNotEmpty`, writing nothing, when
    ``directory`` exists and holds anything, or is not a directory: the starter never
    writes over a file; :class:`~runledger.errors.ProjectNotWritten` when it cannot be
    made (a parent that is a file, no permission).
    """
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise DirectoryNotEmpty(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        raise DirectoryNotEmpty(
            f"{target} is not empty: runledger init writes into a new or empty directory"
        )
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ProjectNotWritten(f"cannot make {target}: {exc.strerror}") from None
    name = project_name(target)
    written = []
    for file_name, text in templates().items():
        path = target / file_name
        with path.open("x", encoding="utf-8") as out:  # "x": never over a file
            out.write(text.replace("{{name}}", name))
        written.append(path)
    return written

#!/usr/bin/env python3
"""The oldest end of the adapters' and providers' version ranges, as a pip constraints file.

Each extra of an agent framework, a model SDK or a provider in pyproject.toml pins its
package to a range (``openai-agents>=0.24,<1``). ``pip install -e .[test]`` gets the newest
release each range allows; this script gives the other end: every ``>=X`` of those extras
as ``name==X``, to install with ``pip install -c FILE`` (``scripts/test-oldest``).

    scripts/oldest_constraints.py            # the constraints, on stdout
    scripts/oldest_constraints.py --check    # and each pinned release exists on the index
    scripts/oldest_constraints.py --verify   # the installed releases are the pinned ones

Only the standard library: it runs before any virtualenv has anything in it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The extras whose lower bounds are a promise about a third party's releases: the framework
# and SDK adapters (runledger.integrations) and the provider tools (runledger.providers).
EXTRAS = ("pydantic-ai", "anthropic", "openai", "openai-agents", "mcp", "providers")

_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?"
    r"\s*(?P<specs>[^;]*?)\s*(?:;.*)?$"
)


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """``2.68`` and ``2.68.0`` alike: the release numbers without trailing zeros."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def lower_bounds(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``{distribution: X}`` for every ``>=X`` of :data:`EXTRAS` (self-references such as
    ``runledger-pg[http,stripe]`` followed). A package with two different lower bounds in
    two extras is an error: one of them would be untested."""
    project = tomllib.loads(pyproject.read_text())["project"]
    own = normalize(project["name"])
    extras: dict[str, list[str]] = project["optional-dependencies"]
    bounds: dict[str, str] = {}
    seen: set[str] = set()
    pending = list(EXTRAS)
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in extras:
            raise SystemExit(f"error: pyproject.toml has no extra {extra!r}")
        for requirement in extras[extra]:
            match = _REQUIREMENT.match(requirement)
            if match is None:
                raise SystemExit(f"error: cannot read the requirement {requirement!r}")
            name = normalize(match["name"])
            if name == own:
                pending += [e.strip() for e in (match["extras"] or "").split(",") if e.strip()]
                continue
            for spec in match["specs"].split(","):
                spec = spec.strip()
                if not spec.startswith(">="):
                    continue
                version = spec[2:].strip()
                if name in bounds and release(bounds[name]) != release(version):
                    raise SystemExit(
                        f"error: {name} has two lower bounds, {bounds[name]} and {version}"
                    )
                bounds.setdefault(name, version)
    return bounds


def constraints(bounds: dict[str, str]) -> str:
    lines = [
        "# The oldest releases the adapter and provider extras allow (the lower bounds in",
        "# pyproject.toml), written by scripts/oldest_constraints.py.",
    ]
    lines += [f"{name}=={version}" for name, version in sorted(bounds.items())]
    return "\n".join(lines) + "\n"


def check(bounds: dict[str, str]) -> list[str]:
    """The pins that name no release on the package index (``pip index versions``)."""
    missing = []
    for name, version in sorted(bounds.items()):
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", name],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        found = re.search(r"Available versions:\s*(.*)", listed)
        versions = [v.strip() for v in found[1].split(",")] if found else []
        if not any(release(v) == release(version) for v in versions):
            missing.append(f"{name}=={version}")
    return missing


def verify(bounds: dict[str, str]) -> list[str]:
    """The pins the current environment does not have installed, as ``name X (installed Y)``."""
    wrong = []
    for name, version in sorted(bounds.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "none"
        if release(installed) != release(version):
            wrong.append(f"{name} {version} (installed {installed})")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="each pin exists on the index")
    action.add_argument("--verify", action="store_true", help="each pin is what is installed")
    args = parser.parse_args(argv)
    bounds = lower_bounds()
    if args.verify:
        wrong = verify(bounds)
        if wrong:
            print(f"error: not the oldest releases: {', '.join(wrong)}", file=sys.stderr)
            return 1
        print("oldest releases: " + ", ".join(f"{n} {v}" for n, v in sorted(bounds.items())))
        return 0
    if args.check:
        missing = check(bounds)
        if missing:
            print(f"error: no such release on the index: {', '.join(missing)}", file=sys.stderr)
            return 1
    sys.stdout.write(constraints(bounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/operating.md and docs/on-call.md's "The read commands" section say what the read
commands do (no database):

- every read command has its section in operating.md, and every option it takes is named
  there;
- every command line shown (``$ runledger ...`` in on-call.md's output blocks, and the
  synopsis lines of operating.md) parses with the real CLI: the command and each option
  exist, and each value is one the option accepts;
- on-call.md's output shows the states it explains (a run whose lease expired with no
  live worker, a silent worker, the resolve line).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from runledger import cli

ROOT = Path(__file__).resolve().parents[2]
OPERATING = ROOT / "docs" / "operating.md"
ON_CALL = ROOT / "docs" / "on-call.md"
READS = ("list", "show", "workers", "unknown", "events")


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## `runledger (\w+)[^`]*`$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _on_call_section() -> str:
    text = ON_CALL.read_text(encoding="utf-8")
    start = text.index("## The read commands")
    return text[start : text.index("\n## ", start + 1)]


@pytest.mark.parametrize("name", READS)
def test_every_option_of_a_read_command_is_documented(name: str) -> None:
    section = _sections(OPERATING.read_text(encoding="utf-8")).get(name)
    assert section is not None, f"docs/operating.md has no section for runledger {name}"
    command = cli.main.commands[name]
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in (
            "database_url",
            "connect_timeout",
        ):
            assert any(opt in section for opt in param.opts), (
                f"runledger {name} {param.opts[0]} is not in its section of docs/operating.md"
            )


def _parse(line: str) -> None:
    args = shlex.split(line)
    assert args[0] == "runledger", line
    command = cli.main.commands.get(args[1])
    assert command is not None, f"no command {args[1]!r}: {line}"
    command.make_context(args[1], args[2:])  # raises on an unknown option or a bad value


def _shown_lines() -> list[str]:
    lines = [m.group(1) for m in re.finditer(r"^\$ (runledger .*)$", _on_call_section(), re.M)]
    for block in re.findall(r"```text\n(.*?)```", OPERATING.read_text(encoding="utf-8"), re.S):
        # a synopsis: drop the [optional] brackets, keep one example of each option
        joined = " ".join(block.split())
        if joined.startswith("runledger "):
            example = joined
            while "[" in example:
                example = re.sub(r"\[([^\[\]]*)\](\.\.\.)?", r"\1", example)
            example = example.replace("RUN_ID", "r-1").replace("NAME@VERSION", "n@1")
            example = example.replace("--status S", "--status paused")
            example = example.replace("--liveness alive|silent|stopped", "--liveness silent")
            example = example.replace("--kind K", "--kind claimed").replace("2h|ISO", "2h")
            lines.append(example)
    return lines


def test_the_command_lines_shown_parse() -> None:
    lines = _shown_lines()
    assert len(lines) >= 9, lines
    for line in lines:
        _parse(line)


def test_the_on_call_output_shows_what_it_explains() -> None:
    section = _on_call_section()
    assert "lease expired, no live worker" in section
    assert re.search(r"│ silent +│", section)
    assert re.search(r"^    runledger resolve \S+ applied\|not_applied\|abandoned$", section, re.M)
    assert re.search(r"^    runledger approve \S+$", section, re.M)

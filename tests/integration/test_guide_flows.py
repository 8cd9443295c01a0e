"""The two flows of docs/guide.md (``## An agent``) run as shown: each python block is written
to the module its first line names, next to a ``myapp.clients`` with in-memory clients,
and driven by a real worker against a real database. The agent's model is replaced
with a scripted ``FunctionModel`` through ``agent.override``, as a user's test does."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tests.integration.conftest import Db, StartWorker

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"

CLIENTS = """
class Helpdesk:
    def __init__(self):
        self.created = {}

    def create(self, title, idempotency_key):
        ticket = self.created.setdefault(idempotency_key, {"id": f"T-{len(self.created) + 1}"})
        ticket["title"] = title
        return ticket


class Mailer:
    def __init__(self):
        self.sent = []

    def send(self, to, body):
        self.sent.append((to, body))
        return f"m-{len(self.sent)}"


helpdesk, mailer = Helpdesk(), Mailer()
"""


def guide_blocks() -> dict[str, str]:
    """``{module path: code}`` of the python blocks of the guide's "An agent" section."""
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index("## An agent\n")
    end = text.index("\n## ", start + 1)
    blocks = re.findall(r"^```python\n(.*?)^```", text[start:end], re.S | re.M)
    named = {}
    for code in blocks:
        first = code.splitlines()[0]
        m = re.fullmatch(r"# (myapp/\w+\.py)", first)
        assert m, f"a block of the section does not start with its file name: {first!r}"
        named[m.group(1)] = code
    assert set(named) == {"myapp/flows.py", "myapp/triage.py"}, sorted(named)
    return named


@pytest.fixture
def myapp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-not-used")  # the model is overridden
    pkg = tmp_path / "myapp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "clients.py").write_text(CLIENTS)
    for path, code in guide_blocks().items():
        (tmp_path / path).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "myapp" or m.startswith("myapp.")]:
        del sys.modules[name]


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Turn 0: open a ticket; turn 1: email the customer; then answer."""
    requests = len([m for m in messages if m.kind == "request"])
    if requests == 1:
        return ModelResponse(parts=[ToolCallPart("create_ticket", {"title": "Login fails"})])
    if requests == 2:
        args = {"to": "ana@example.com", "body": "We are on it."}
        return ModelResponse(parts=[ToolCallPart("send_email", args)])
    return ModelResponse(parts=[TextPart("Ticket T-1 is open and Ana knows.")])


async def test_the_agent_flow_runs_as_shown(myapp: Path, db: Db, start_worker: StartWorker) -> None:
    flows: Any = importlib.import_module("myapp.flows")
    clients: Any = importlib.import_module("myapp.clients")
    with flows.agent.override(model=FunctionModel(script)):
        await start_worker(flows.flow)
        await db.submit("readme-agent", flows.flow, {"prompt": "Login fails for ana@example.com"})
        run = await db.wait_status("readme-agent", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run
    assert run["result"] == "Ticket T-1 is open and Ana knows."
    assert flows.flow.ref == "ticket-triage@1"
    assert list(clients.helpdesk.created) == ["readme-agent:0:c0"]  # runledger's key
    assert clients.mailer.sent == [("ana@example.com", "We are on it.")]
    calls = await db.calls("readme-agent")
    assert [(c["tool"], c["status"]) for c in calls] == [
        ("create_ticket", "succeeded"),
        ("send_email", "succeeded"),
    ]
    assert len(await db.turns("readme-agent")) == 3


async def test_the_plain_flow_runs_as_shown(myapp: Path, db: Db, start_worker: StartWorker) -> None:
    triage: Any = importlib.import_module("myapp.triage")
    clients: Any = importlib.import_module("myapp.clients")
    await start_worker(triage.flow)
    await db.submit("readme-plain", triage.flow, {"prompt": "Printer on fire"})
    run = await db.wait_status("readme-plain", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run
    assert clients.helpdesk.created == {
        "readme-plain:0:c0": {"id": "T-1", "title": "Printer on fire"}
    }

"""The console's reads (``/api`` and the pages) against a real database, in process
(Starlette's TestClient runs the app with its lifespan): the JSON is what the CLI's
``--json`` prints, runs page by a cursor, a bad query parameter is a 400 naming it (never
a traceback), an unknown run a 404, and ``--redact`` hides arguments and receipts.

The world: ``c-ok`` succeeded, ``c-unknown`` paused on an unknown call (its tool was
called with a secret), ``c-approve`` paused on a call awaiting approval, driven by an
in-process worker that then stops; ``c-queued-N``: runs of a flow no worker runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from runledger import cli
from runledger.console import ConsoleConfig, create_app
from runledger.flows import Decision, Flow, ToolCall
from tests.integration.conftest import Db, StartWorker

pytestmark = pytest.mark.timeout(90)

SECRET = "card-4242-4242-secret"
TOKEN = "api-test-token-0123456789"


def as_role(url: str, role: str) -> str:
    """The URL of a session that takes ``role`` at its start (libpq ``options``)."""
    return url + ("&" if "?" in url else "?") + f"options=-crole%3D{role}"


def ops_flow() -> Flow:
    flow = Flow("ops", "1")

    @flow.tool(safety="unsafe")
    def poke(ctx: Any, card: str) -> str:
        raise ConnectionResetError("no answer")  # ambiguous: unsafe -> unknown, pause

    @flow.tool(safety="unsafe", approval=True)
    def pay(ctx: Any, amount: int) -> dict[str, Any]:
        return {"paid": amount}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> Decision:
        if history:
            return Decision(calls=[], output={"done": True})
        mode = ctx.input["mode"]
        calls = {
            "unknown": [ToolCall("poke", {"card": SECRET})],
            "approve": [ToolCall("pay", {"amount": 5})],
        }.get(mode, [])
        return Decision(
            calls=calls,
            record={"said": f"calling with {SECRET}"},
            output=None if calls else {"done": True},
        )

    return flow


@dataclass
class World:
    url: str
    flow: Flow
    db: Db

    def app(self, **config: Any) -> Any:
        config.setdefault("database_url", as_role(self.url, "runledger_auditor"))
        if config.get("allow_actions"):
            config.setdefault("operator_url", as_role(self.url, "runledger_operator"))
            config.setdefault("token", TOKEN)
        return create_app(ConsoleConfig(**config))

    def cli_json(self, *args: str) -> Any:
        result = CliRunner().invoke(
            cli.main, [*args, "--json"], env={"RUNLEDGER_DATABASE_URL": self.url}
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)


async def build_world(database_url: str, db: Db, start_worker: StartWorker) -> World:
    flow = ops_flow()
    worker = await start_worker(flow, worker_id="ops-worker")
    for run_id, mode in (("c-ok", "ok"), ("c-unknown", "unknown"), ("c-approve", "approve")):
        await db.submit(run_id, flow, {"mode": mode, "card": SECRET})
    await db.wait_status("c-ok", "succeeded")
    await db.wait_status("c-unknown", "paused")
    await db.wait_status("c-approve", "paused")
    await worker.stop()
    for i in range(1, 6):
        await db.submit(f"c-queued-{i}", Flow("idle", "1"))
    return World(database_url, flow, db)


@pytest.fixture
async def world(database_url: str, db: Db, start_worker: StartWorker) -> World:
    return await build_world(database_url, db, start_worker)


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    with TestClient(world.app(), follow_redirects=False) as c:
        yield c


@pytest.fixture
def bare_client(database_url: str) -> Iterator[TestClient]:
    """The console on an empty database (no runs, no workers)."""
    config = ConsoleConfig(database_url=as_role(database_url, "runledger_auditor"))
    with TestClient(create_app(config), follow_redirects=False) as c:
        yield c


NEWEST_FIRST = [
    "c-queued-5",
    "c-queued-4",
    "c-queued-3",
    "c-queued-2",
    "c-queued-1",
    "c-approve",
    "c-unknown",
    "c-ok",
]


def _without_clock(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "expires_in_seconds"} for r in rows]


# -- the JSON is the CLI's --------------------------------------------------------------


async def test_api_runs_is_runledger_list_json(world: World, client: TestClient) -> None:
    got = client.get("/api/runs")
    assert got.status_code == 200
    data = got.json()
    assert [r["run_id"] for r in data["runs"]] == NEWEST_FIRST
    assert _without_clock(data["runs"]) == _without_clock(world.cli_json("list")["runs"])
    assert data["next"] is None
    unknown = next(r for r in data["runs"] if r["run_id"] == "c-unknown")
    assert (unknown["status"], unknown["unknown_calls"], unknown["awaiting_approval"]) == (
        "paused",
        1,
        0,
    )
    paused = client.get("/api/runs", params=[("status", "paused"), ("flow", "ops@1")]).json()
    assert [r["run_id"] for r in paused["runs"]] == ["c-approve", "c-unknown"]
    assert client.get("/api/runs?flow=idle&limit=2").json()["runs"][1]["run_id"] == "c-queued-4"
    assert client.get("/api/runs?since=2999-01-01T00:00:00").json()["runs"] == []
    assert len(client.get("/api/runs?since=1h").json()["runs"]) == 8


async def test_api_run_is_runledger_show_json_with_the_decision_records(
    world: World, client: TestClient
) -> None:
    data = client.get("/api/runs/c-unknown").json()
    shown = world.cli_json("show", "c-unknown")
    assert data["run"] == {**shown["run"]}
    assert data["timeline"] == shown["timeline"]
    assert [t["turn"] for t in data["turns"]] == [t["turn"] for t in shown["turns"]]
    assert data["turns"][0]["calls"] == shown["turns"][0]["calls"]
    # the console has each turn's decision record too; `show --json` leaves it out
    assert data["turns"][0]["record"] == {"said": f"calling with {SECRET}"}
    assert "record" not in shown["turns"][0]
    (call,) = data["turns"][0]["calls"]
    assert (call["idempotency_key"], call["status"], call["attempts"]) == (
        "c-unknown:0:c0",
        "unknown",
        1,
    )
    assert call["args"] == {"card": SECRET}
    done = client.get("/api/runs/c-ok").json()
    assert [(t["turn"], t["output"]) for t in done["turns"]] == [(0, {"done": True})]
    assert done["run"]["result"] == {"done": True}


async def test_api_inbox_and_workers_are_the_cli_json(world: World, client: TestClient) -> None:
    inbox = client.get("/api/inbox").json()
    assert inbox["calls"] == world.cli_json("unknown")["calls"]
    # oldest first (dispatched, else paused): the two runs ran side by side, either order
    waiting = {c["idempotency_key"]: c for c in inbox["calls"]}
    assert {k: c["waits_for"] for k, c in waiting.items()} == {
        "c-unknown:0:c0": "unknown",
        "c-approve:0:c0": "approval",
    }
    assert waiting["c-unknown:0:c0"]["commands"] == [
        "runledger resolve c-unknown:0:c0 applied|not_applied|abandoned"
    ]
    workers = client.get("/api/workers").json()
    assert [(w["worker_id"], w["liveness"]) for w in workers["workers"]] == [
        ("ops-worker", "stopped")
    ]
    assert [
        {k: v for k, v in w.items() if k != "heartbeat_age_seconds"} for w in workers["workers"]
    ] == [
        {k: v for k, v in w.items() if k != "heartbeat_age_seconds"}
        for w in world.cli_json("workers")["workers"]
    ]
    events = client.get("/api/events", params={"run": "c-unknown"}).json()["events"]
    assert [e["kind"] for e in events] == [
        e["kind"] for e in world.cli_json("events", "--run", "c-unknown")["events"]
    ]
    assert events[-1]["kind"] == "run_paused"
    index = client.get("/api").json()
    assert index["actions"] is False
    assert set(index["endpoints"]) >= {"GET /api/runs", "GET /api/stream"}


# -- paging -----------------------------------------------------------------------------


async def test_runs_page_by_a_cursor(client: TestClient) -> None:
    seen: list[str] = []
    url: str | None = "/api/runs?limit=3"
    pages = 0
    while url is not None:
        data = client.get(url).json()
        seen += [r["run_id"] for r in data["runs"]]
        url = data["next_url"]
        pages += 1
        assert pages <= 4
    assert seen == NEWEST_FIRST
    assert pages == 3
    # the filters are kept from page to page
    first = client.get("/api/runs?limit=2&flow=idle").json()
    assert first["next_url"].startswith("/api/runs?")
    second = client.get(first["next_url"]).json()
    assert [r["run_id"] for r in second["runs"]] == ["c-queued-3", "c-queued-2"]
    # the page has the same link
    html = client.get("/runs?limit=3").text
    assert 'rel="next"' in html
    assert "c-queued-5" in html and "c-approve" not in html
    last = client.get("/runs?limit=8").text
    assert 'rel="next"' not in last


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "param", "message"),
    [
        ("/api/runs?status=done", "status", "status 'done' is not one of queued, running"),
        ("/api/runs?limit=0", "limit", "limit must be from 1 to 10000, got 0"),
        ("/api/runs?limit=ten", "limit", "limit must be a whole number, got 'ten'"),
        ("/api/runs?limit=1&limit=2", "limit", "limit given 2 times"),
        ("/api/runs?since=yesterday", "since", "neither a duration (30m, 2h, 7d)"),
        ("/api/runs?before=garbage", "before", "before must be the cursor of a page"),
        ("/api/runs?before=2026-01-01T00:00:00|x%20y", "before", "before must be the cursor"),
        ("/api/runs?flow=@1", "flow", "flow: give a name or name@version"),
        ("/api/runs?stauts=paused", "stauts", "unknown parameter 'stauts'"),
        ("/api/runs/not%20a%20run", "run id", "invalid run id 'not a run'"),
        ("/api/events?until=soon", "until", "until must be an event id"),
        ("/api/events?run=a%20b", "run", "invalid run id"),
        ("/api/inbox?include_finished=maybe", "include_finished", "must be 1 or 0"),
        ("/api/workers?liveness=dead", "liveness", "liveness 'dead' is not one of"),
        ("/api/stream?run=%00", "run", "invalid run id"),
    ],
)
def test_a_bad_query_parameter_is_a_clear_400(
    bare_client: TestClient, url: str, param: str, message: str
) -> None:
    got = bare_client.get(url)
    assert got.status_code == 400, got.text
    body = got.json()
    assert body["param"] == param
    assert message in body["error"], body
    assert "\n" not in body["error"]
    assert "Traceback" not in got.text


def test_bad_input_on_a_page_is_a_400_page_and_an_unknown_run_a_404(
    bare_client: TestClient,
) -> None:
    client = bare_client
    page = client.get("/runs?limit=0")
    assert page.status_code == 400
    assert page.headers["content-type"].startswith("text/html")
    assert "limit must be from 1 to 10000, got 0" in page.text
    assert "Traceback" not in page.text
    missing = client.get("/api/runs/c-nope")
    assert (missing.status_code, missing.json()["error"]) == (
        404,
        "RunNotFound: run c-nope not found",
    )
    assert client.get("/runs/c-nope").status_code == 404


# -- pages ------------------------------------------------------------------------------


async def test_the_pages_show_what_the_api_has(client: TestClient) -> None:
    run = client.get("/runs/c-unknown")
    assert run.status_code == 200
    html = run.text
    for text in (
        "c-unknown:0:c0",
        "ops-worker (1)",
        "call_unknown",
        "run_paused",
        "decision record",
        SECRET,
        # read-only: the CLI line instead of a form
        "runledger resolve c-unknown:0:c0 applied|not_applied|abandoned",
    ):
        assert text in html, text
    assert 'class="act resolve"' not in html
    inbox = client.get("/inbox").text
    assert "c-approve:0:c0" in inbox and "c-unknown:0:c0" in inbox
    assert "ops-worker" in client.get("/workers").text
    fragment = client.get("/runs/c-unknown?fragment=1").text
    assert "<html" not in fragment and "c-unknown:0:c0" in fragment
    assert client.get("/static/console.js").status_code == 200
    assert client.get("/", follow_redirects=False).headers["location"] == "/runs"


async def test_the_run_page_and_the_inbox_say_what_the_tool_raised(
    client: TestClient,
) -> None:
    """The call's error as the CLI shows it, one line (why, then the exception); the
    whole JSON in its title. The inbox showed the reason only, the run page raw JSON."""
    import html
    import re

    shown = "ambiguous failure of an unsafe tool: ConnectionResetError: no answer"
    for page in ("/runs/c-unknown", "/inbox"):
        [(title, text)] = re.findall(
            r'<code class="json err" title="([^"]*)">([^<]*)</code>', client.get(page).text
        )
        assert text == shown, page
        whole = json.loads(html.unescape(title))
        [send] = whole.pop("evidence")  # the send that raised, listed under the call
        assert whole == {
            "reason": "ambiguous failure of an unsafe tool",
            "type": "ConnectionResetError",
            "message": "no answer",
        }
        assert (send["step"], send["ended"]) == ("send", "raised")


# -- --redact ---------------------------------------------------------------------------


async def test_redact_hides_args_receipts_and_records_in_pages_and_api(world: World) -> None:
    with TestClient(world.app(redact=True)) as client:
        data = client.get("/api/runs/c-unknown").json()
        (call,) = data["turns"][0]["calls"]
        assert call["args"] == "[redacted]"
        assert call["idempotency_key"] == "c-unknown:0:c0"  # what an operator needs stays
        assert call["error"]["reason"] == "ambiguous failure of an unsafe tool"
        assert data["turns"][0]["record"] == "[redacted]"
        assert data["run"]["input"] == "[redacted]"
        ok = client.get("/api/runs/c-ok").json()
        assert ok["run"]["result"] == "[redacted]"
        assert all(t["output"] in (None, "[redacted]") for t in ok["turns"])
        for url in ("/runs/c-unknown", "/api/runs/c-unknown", "/runs/c-ok", "/api/runs/c-ok"):
            body = client.get(url).text
            assert SECRET not in body, url
            assert "[redacted]" in body, url
        assert client.get("/api").json()["redact"] is True

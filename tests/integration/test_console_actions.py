"""Acting in the console: read-only unless started with actions; with them, a signed-in
session (the token compared, a name recorded), a CSRF token on every form, and the
operator-role store. Each refusal writes nothing; each action records its actor in the
call and in ``run_events``, as SQL shows.

The world is :func:`tests.integration.test_console_api.build_world`'s.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.integration.conftest import Db, StartWorker
from tests.integration.test_console_api import TOKEN, World, build_world

pytestmark = pytest.mark.timeout(90)

UNKNOWN_KEY = "c-unknown:0:c0"
APPROVE_KEY = "c-approve:0:c0"


@pytest.fixture
async def world(database_url: str, db: Db, start_worker: StartWorker) -> World:
    return await build_world(database_url, db, start_worker)


@pytest.fixture
def acting(world: World) -> Iterator[TestClient]:
    with TestClient(world.app(allow_actions=True), follow_redirects=False) as c:
        yield c


def login_csrf(client: TestClient, next_path: str = "/runs") -> str:
    page = client.get("/login", params={"next": next_path})
    assert page.status_code == 200
    m = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert m, page.text
    return m.group(1)


def sign_in(client: TestClient, name: str = "bob", token: str = TOKEN) -> Any:
    csrf = login_csrf(client)
    return client.post(
        "/login", data={"csrf": csrf, "name": name, "token": token, "next": "/inbox"}
    )


def page_csrf(client: TestClient, path: str) -> str:
    page = client.get(path)
    assert page.status_code == 200, page.text
    m = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert m, "no form on " + path
    return m.group(1)


async def unchanged(db: Db) -> None:
    """Nothing was written: the unknown call and the approval still wait, no operator
    event exists."""
    (call,) = await db.calls("c-unknown")
    assert (call["status"], call["resolved_by"]) == ("unknown", None)
    (pending,) = await db.calls("c-approve")
    assert pending["approval"] == "pending"
    for run_id in ("c-unknown", "c-approve", "c-queued-1"):
        kinds = await db.kinds(run_id)
        assert not {"call_resolved", "call_approved", "call_denied", "run_cancelled"} & set(
            kinds
        ), kinds


# -- read-only by default ---------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        f"/calls/{UNKNOWN_KEY}/resolve",
        f"/calls/{APPROVE_KEY}/approve",
        f"/calls/{APPROVE_KEY}/deny",
        "/runs/c-queued-1/cancel",
        "/runs/c-unknown/retry",
    ],
)
async def test_read_only_by_default_every_action_is_refused(
    world: World, db: Db, path: str
) -> None:
    with TestClient(world.app(), follow_redirects=False) as client:
        got = client.post(path, data={"resolution": "applied", "reason": "x", "csrf": "x"})
        assert got.status_code == 403
        assert "actions are off: this console is read-only" in got.text
        assert "--allow-actions" in got.text
        page = client.get("/runs/c-unknown").text
        assert '<form method="post"' not in page
        assert "runledger resolve c-unknown:0:c0 applied|not_applied|abandoned" in page
        assert client.get("/login").status_code == 404  # no login at all
    await unchanged(db)


# -- the login, the token, CSRF ---------------------------------------------------------


async def test_with_a_token_nothing_is_read_without_signing_in(
    world: World, acting: TestClient
) -> None:
    page = acting.get("/runs?status=paused")
    assert page.status_code == 303
    assert page.headers["location"] == "/login?next=/runs%3Fstatus%3Dpaused"
    api = acting.get("/api/runs")
    assert api.status_code == 401
    assert "sign in first" in api.json()["error"]
    assert acting.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    bearer = acting.get("/api/runs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 200
    assert len(bearer.json()["runs"]) == 8
    assert acting.get("/api/stream").status_code == 401
    assert acting.get("/static/console.css").status_code == 200  # no secret there


async def test_sign_in_refusals_write_nothing_and_set_no_session(
    world: World, db: Db, acting: TestClient
) -> None:
    # no CSRF cookie (the form was not loaded from here)
    bare = acting.post("/login", data={"csrf": "x", "name": "bob", "token": TOKEN})
    assert bare.status_code == 403
    assert "CSRF" in bare.text
    # the form's CSRF, but the wrong token
    wrong = sign_in(acting, token="not-the-token-at-all")
    assert wrong.status_code == 401
    assert "wrong token" in wrong.text
    assert "rl_session" not in acting.cookies
    # no name
    nameless = sign_in(acting, name="   ")
    assert nameless.status_code == 400
    assert "give your name" in nameless.text
    # from another site
    csrf = login_csrf(acting)
    foreign = acting.post(
        "/login",
        data={"csrf": csrf, "name": "bob", "token": TOKEN},
        headers={"Origin": "https://evil.example"},
    )
    assert foreign.status_code == 403
    assert "rl_session" not in acting.cookies
    assert acting.get("/api/runs").status_code == 401
    await unchanged(db)


async def test_an_action_needs_a_session_and_its_csrf_token(
    world: World, db: Db, acting: TestClient
) -> None:
    form = {"resolution": "applied", "receipt": '{"id": 1}'}
    anonymous = acting.post(f"/calls/{UNKNOWN_KEY}/resolve", data={**form, "csrf": "x"})
    assert anonymous.status_code == 401
    assert "sign in first" in anonymous.text
    signed = sign_in(acting)
    assert (signed.status_code, signed.headers["location"]) == (303, "/inbox")
    csrf = page_csrf(acting, "/runs/c-unknown")
    no_csrf = acting.post(f"/calls/{UNKNOWN_KEY}/resolve", data=form)
    assert no_csrf.status_code == 403
    assert "CSRF token is missing or wrong" in no_csrf.text
    bad_csrf = acting.post(f"/calls/{UNKNOWN_KEY}/resolve", data={**form, "csrf": csrf + "x"})
    assert bad_csrf.status_code == 403
    foreign = acting.post(
        f"/calls/{UNKNOWN_KEY}/resolve",
        data={**form, "csrf": csrf},
        headers={"Origin": "http://evil.example"},
    )
    assert foreign.status_code == 403
    assert "another site" in foreign.text
    await unchanged(db)
    # signed out, the same form is refused again
    out = acting.post("/logout", data={"csrf": csrf})
    assert out.status_code == 303
    again = acting.post(f"/calls/{UNKNOWN_KEY}/resolve", data={**form, "csrf": csrf})
    assert again.status_code == 401
    await unchanged(db)


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"resolution": "applied", "receipt": "{not json"}, "receipt is not JSON"),
        ({"resolution": "applied", "receipt": "[1, 2]"}, "receipt must be a JSON object"),
        ({"resolution": "applied", "receipt": '{"a":' * 100 + "1" + "}" * 100}, "nests deeper"),
        ({"resolution": "done"}, "resolution must be one of applied, not_applied, abandoned"),
        ({}, "resolution is required"),
        ({"resolution": "not_applied", "receipt": "{}"}, "a receipt goes with 'applied' only"),
        ({"resolution": "applied", "note": "x" * 5000}, "note must be 0-4000 characters, got 5000"),
    ],
)
async def test_a_bad_resolve_form_is_a_400_and_writes_nothing(
    world: World, db: Db, acting: TestClient, form: dict[str, str], message: str
) -> None:
    sign_in(acting)
    csrf = page_csrf(acting, "/runs/c-unknown")
    got = acting.post(f"/calls/{UNKNOWN_KEY}/resolve", data={**form, "csrf": csrf})
    assert got.status_code == 400, got.text
    assert message in html.unescape(got.text)
    assert "Traceback" not in got.text
    await unchanged(db)


# -- actions, each recorded with its actor ----------------------------------------------


async def test_actions_record_the_signed_in_name(world: World, db: Db, acting: TestClient) -> None:
    sign_in(acting, name="bob")
    csrf = page_csrf(acting, "/runs/c-unknown")
    page = acting.get("/runs/c-unknown").text
    assert 'class="act resolve"' in page  # the form, not the CLI line

    done = acting.post(
        f"/calls/{UNKNOWN_KEY}/resolve",
        data={"csrf": csrf, "resolution": "applied", "receipt": '{"id": "m-1"}', "note": "ok"},
    )
    assert (done.status_code, done.headers["location"]) == (303, "/runs/c-unknown")
    shown = acting.get("/runs/c-unknown").text
    assert f"{UNKNOWN_KEY} resolved as applied by console:bob" in shown
    assert f"{UNKNOWN_KEY} resolved as applied" not in acting.get("/runs/c-unknown").text  # once
    (resolved,) = await db.events("c-unknown", "call_resolved")
    assert (resolved["actor"], resolved["detail"]["resolution"]) == ("console:bob", "applied")
    (call,) = await db.calls("c-unknown")
    assert (call["status"], call["resolved_by"], call["receipt"]) == (
        "succeeded",
        "console:bob",
        {"id": "m-1"},
    )
    assert (await db.run("c-unknown"))["status"] == "queued"

    # the same call again: the database refuses it, and the page says so
    twice = acting.post(
        f"/calls/{UNKNOWN_KEY}/resolve", data={"csrf": csrf, "resolution": "applied"}
    )
    assert twice.status_code == 409
    assert "InvalidTransition: call c-unknown:0:c0 is succeeded" in twice.text

    approved = acting.post(f"/calls/{APPROVE_KEY}/approve", data={"csrf": csrf, "note": "fine"})
    assert approved.status_code == 303
    (event,) = await db.events("c-approve", "call_approved")
    assert event["actor"] == "console:bob"
    (pending,) = await db.calls("c-approve")
    assert (pending["approval"], pending["approval_by"]) == ("approved", "console:bob")

    denied = acting.post(f"/calls/{APPROVE_KEY}/deny", data={"csrf": csrf, "reason": "late"})
    assert denied.status_code == 409  # decided already
    assert acting.post(f"/calls/{APPROVE_KEY}/deny", data={"csrf": csrf}).status_code == 400

    cancelled = acting.post("/runs/c-queued-1/cancel", data={"csrf": csrf, "reason": "dup"})
    assert cancelled.status_code == 303
    (cancel_event,) = await db.events("c-queued-1", "run_cancelled")
    assert (cancel_event["actor"], cancel_event["detail"]["reason"]) == ("console:bob", "dup")

    retried = acting.post("/runs/c-ok/retry", data={"csrf": csrf})
    assert retried.status_code == 409
    assert "only failed or paused runs are retried" in retried.text
    gone = acting.post("/calls/c-nope:0:c0/approve", data={"csrf": csrf})
    assert gone.status_code == 404


async def test_actor_option_records_every_action_under_one_name(world: World, db: Db) -> None:
    with TestClient(
        world.app(allow_actions=True, actor="oncall-team"), follow_redirects=False
    ) as client:
        form = client.get("/login").text
        assert 'name="name"' in form and "oncall-team" in form  # no name asked
        signed = sign_in(client, name="")
        assert signed.status_code == 303
        csrf = page_csrf(client, "/runs/c-approve")
        denied = client.post(f"/calls/{APPROVE_KEY}/deny", data={"csrf": csrf, "reason": "no"})
        assert denied.status_code == 303
    (event,) = await db.events("c-approve", "call_denied")
    assert event["actor"] == "oncall-team"

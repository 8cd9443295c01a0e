"""The Slack adapter (runledger.providers.slack) against a local Slack Web API
(tests/providers/fake_slack.py), through slack_sdk's WebClient pointed at it.

The tool and its lookup by themselves, then runs through a real worker on a real
PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import pytest
from slack_sdk import WebClient
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler

from runledger.flows import Flow, NotApplied, Receipt, ToolCall, Unknowable
from runledger.providers import slack as slack_tools
from runledger.providers.base import Retention
from tests.integration.conftest import Db, StartWorker
from tests.providers.fake_slack import FakeSlack
from tests.providers.test_github import ctx_for, now, sent_ctx

CHANNEL, OTHER = "C0GENERAL1", "C0RANDOM01"
POST = "/api/chat.postMessage"


@pytest.fixture
def fake() -> Iterator[FakeSlack]:
    f = FakeSlack((CHANNEL, OTHER))
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def client(fake: FakeSlack) -> WebClient:
    return WebClient("xoxb-test", base_url=fake.api_url, timeout=2, retry_handlers=[])


def post_tool(client: WebClient, **kw: Any) -> Any:
    kw.setdefault("channel", CHANNEL)
    kw.setdefault("processing_bound", 0.0)
    return slack_tools.post_message(Flow("sl"), client, **kw)


# -- send and look up ---------------------------------------------------------------


def test_a_send_carries_the_key_in_metadata_and_the_lookup_finds_it(
    fake: FakeSlack, client: WebClient
) -> None:
    post = post_tool(client)
    ctx = sent_ctx()
    out = post.fn(ctx, text="Deploy finished")
    assert isinstance(out, Receipt)
    [msg] = fake.effects(ctx.idempotency_key)
    assert msg["text"] == "Deploy finished"
    assert msg["metadata"] == {
        "event_type": "runledger_call",
        "event_payload": {"runledger_key": ctx.idempotency_key},
    }
    assert out.result == {"channel": CHANNEL, "ts": msg["ts"]}
    assert ctx.observed[0]["status"] == 200 and ctx.observed[0]["request_id"]

    found = post.lookup_fn(sent_ctx())
    assert found == {"channel": CHANNEL, "ts": msg["ts"], "found_by": "lookup"}
    assert len(fake.effects(ctx.idempotency_key)) == 1
    history = [q for m, p, q in fake.requests if p == "/api/conversations.history"]
    assert history  # the SDK posts the form; the fake read it
    assert len(fake.requests) == 2


def test_the_lookup_asks_for_metadata_from_the_first_send_less_a_margin(
    fake: FakeSlack, client: WebClient
) -> None:
    post = post_tool(client, margin=dt.timedelta(minutes=5))
    ctx = sent_ctx()
    post.fn(ctx, text="x")
    seen: list[Any] = []
    original = fake._history

    def spy(args: dict[str, Any]) -> Any:
        seen.append(dict(args))
        return original(args)

    fake._history = spy  # type: ignore[method-assign]
    assert post.lookup_fn(ctx) is not None
    [args] = seen
    assert args["include_all_metadata"] in ("1", "true", "True")
    assert ctx.first_sent_at is not None
    expected = (ctx.first_sent_at - dt.timedelta(minutes=5)).timestamp()
    assert abs(float(args["oldest"]) - expected) < 0.001


def test_not_found_within_the_window_is_none_past_it_unknowable(
    fake: FakeSlack, client: WebClient
) -> None:
    post = post_tool(client)
    fake.seed_message(CHANNEL, "chatter", age=dt.timedelta(minutes=1))
    assert post.lookup_fn(sent_ctx()) is None
    two_days = now() - dt.timedelta(days=2)
    ctx = ctx_for(first=two_days, sent=two_days)
    with pytest.raises(Unknowable, match="Slack keeps") as err:
        post.lookup_fn(ctx)
    assert err.value.facts["window_hours"] == 24
    # a longer retention, when the workspace's policy is known: None again
    keep = post_tool(client, retention=Retention(dt.timedelta(days=90), name="Slack"))
    assert keep.lookup_fn(ctx_for(first=two_days, sent=two_days)) is None


def test_a_message_older_than_the_window_is_still_found(fake: FakeSlack, client: WebClient) -> None:
    """Found wins over the window: past it only "not found" is unknowable."""
    post = post_tool(client)
    ctx = sent_ctx(ago=3 * 86400)
    post.fn(ctx, text="x")
    assert post.lookup_fn(sent_ctx(ago=3 * 86400)) is not None


def test_the_lookup_pages_with_the_cursor(fake: FakeSlack, client: WebClient) -> None:
    post = post_tool(client)
    ctx = sent_ctx()
    post.fn(ctx, text="mine")
    for i in range(450):
        fake.seed_message(CHANNEL, f"later {i}", age=dt.timedelta(seconds=-1 - i * 0.001))
    assert post.lookup_fn(sent_ctx()) is not None
    calls = [p for _, p, _ in fake.requests if p == "/api/conversations.history"]
    assert len(calls) == 3  # 200 + 200 + the rest


def test_several_channels_the_model_picks_one_the_lookup_reads_each(
    fake: FakeSlack, client: WebClient
) -> None:
    post = post_tool(client, channel=[CHANNEL, OTHER])
    ctx = sent_ctx()
    post.fn(ctx, channel=OTHER, text="x")
    found = post.lookup_fn(sent_ctx())
    assert found and found["channel"] == OTHER
    with pytest.raises(NotApplied, match="not one of"):
        post.fn(sent_ctx("run-2:0:c0"), channel="C0ELSEWHER", text="x")


def test_a_deleted_channel_makes_the_lookup_unknowable(fake: FakeSlack, client: WebClient) -> None:
    post = post_tool(client)
    del fake.channels[CHANNEL]
    with pytest.raises(Unknowable, match="channel_not_found"):
        post.lookup_fn(sent_ctx())


# -- error switches -----------------------------------------------------------------


@pytest.mark.parametrize("error", ["channel_not_found", "not_in_channel", "is_archived"])
def test_a_documented_refusal_is_not_applied(
    fake: FakeSlack, client: WebClient, error: str
) -> None:
    """Slack has no key, so no key conflict: its refusals are ok:false errors."""
    post = post_tool(client)
    fake.fault("POST", POST, status=200, body={"ok": False, "error": error})
    ctx = sent_ctx()
    with pytest.raises(NotApplied, match=error) as err:
        post.fn(ctx, text="x")
    assert not err.value.retry
    assert fake.effects(ctx.idempotency_key) == []


def test_a_409_is_ambiguous_slack_documents_no_conflict(fake: FakeSlack, client: WebClient) -> None:
    post = post_tool(client)
    fake.fault("POST", POST, status=409, body={"ok": False, "error": "conflict"})
    with pytest.raises(slack_tools.SlackAmbiguous):
        post.fn(sent_ctx(), text="x")


def test_a_429_waits_for_retry_after_and_is_not_applied(fake: FakeSlack, client: WebClient) -> None:
    post = post_tool(client)
    fake.fault(
        "POST",
        POST,
        status=429,
        headers={"Retry-After": "1"},
        body={"ok": False, "error": "ratelimited"},
    )
    ctx = sent_ctx()
    started = time.monotonic()
    with pytest.raises(NotApplied) as err:
        post.fn(ctx, text="x")
    assert err.value.retry and time.monotonic() - started >= 1.0
    assert fake.effects(ctx.idempotency_key) == []


@pytest.mark.parametrize(
    "status,error",
    [(500, "internal_error"), (503, "service_unavailable"), (200, "fatal_error")],
)
@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not_applied"])
def test_server_errors_are_ambiguous_and_the_lookup_decides(
    fake: FakeSlack, client: WebClient, status: int, error: str, applied: bool
) -> None:
    post = post_tool(client)
    fake.fault(
        "POST",
        POST,
        status=status,
        body={"ok": False, "error": error},
        apply="before" if applied else "never",
    )
    ctx = sent_ctx()
    with pytest.raises(slack_tools.SlackAmbiguous, match=error):
        post.fn(ctx, text="x")
    assert (post.lookup_fn(sent_ctx()) is not None) == applied


def test_a_held_answer_times_out_and_is_ambiguous(fake: FakeSlack) -> None:
    client = WebClient("xoxb-test", base_url=fake.api_url, timeout=0.5, retry_handlers=[])
    post = post_tool(client)
    fake.fault("POST", POST, apply="before", hold=2.0)
    ctx = sent_ctx()
    with pytest.raises(slack_tools.SlackAmbiguous, match="no answer"):
        post.fn(ctx, text="x")
    assert post.lookup_fn(sent_ctx()) is not None
    assert len(fake.effects(ctx.idempotency_key)) == 1


def test_a_post_that_lands_after_the_client_gave_up_is_found_once(fake: FakeSlack) -> None:
    client = WebClient("xoxb-test", base_url=fake.api_url, timeout=0.5, retry_handlers=[])
    post = post_tool(client, processing_bound=3.5)  # waits 0.5 + 3.5 + 2 s from the send
    fake.fault("POST", POST, apply="after", hold=3.0)
    key = "run-1:0:c0"
    sent = now()
    with pytest.raises(slack_tools.SlackAmbiguous):
        post.fn(ctx_for(key, first=sent, sent=sent), text="x")
    assert fake.effects(key) == []  # not landed yet
    lookup_ctx = ctx_for(key, first=sent, sent=sent)
    assert post.lookup_fn(lookup_ctx) is not None
    assert len(fake.effects(key)) == 1
    assert any("waited_for_landing_s" in o for o in lookup_ctx.observed)


def test_bad_configuration_says_so_in_one_line(fake: FakeSlack) -> None:
    with pytest.raises(slack_tools.SlackConfigError, match="retry_handlers=\\[\\]"):
        slack_tools.post_message(Flow("x"), WebClient("t"), channel=CHANNEL)
    ok = WebClient("t", retry_handlers=[RateLimitErrorRetryHandler()])
    slack_tools.post_message(Flow("x"), ok, channel=CHANNEL)  # rate limits only: fine
    with pytest.raises(slack_tools.SlackConfigError, match="conversation id"):
        slack_tools.post_message(Flow("x"), ok, channel="#general")


# -- through a real worker, on a real PostgreSQL --------------------------------------


def worker_flow(client: WebClient, **kw: Any) -> Flow:
    flow = Flow("slack-post", "1")
    slack_tools.post_message(flow, client, channel=CHANNEL, processing_bound=0.0, **kw)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("post_slack_message", {"text": ctx.input["text"]})]

    return flow


async def test_worker_a_run_posts_one_message(
    fake: FakeSlack, client: WebClient, db: Db, start_worker: StartWorker
) -> None:
    flow = worker_flow(client)
    await db.submit("sl-1", flow, {"text": "hello"})
    await start_worker(flow)
    assert (await db.wait_status("sl-1", "succeeded", "paused", "failed"))["status"] == "succeeded"
    [call] = await db.calls("sl-1")
    assert (call["status"], call["attempts"], call["receipt"]["found_by"]) == (
        "succeeded",
        1,
        "send",
    )
    assert len(fake.effects("sl-1:0:c0")) == 1


async def test_worker_an_applied_internal_error_settles_by_lookup(
    fake: FakeSlack, client: WebClient, db: Db, start_worker: StartWorker
) -> None:
    flow = worker_flow(client)
    fake.fault(
        "POST", POST, status=500, body={"ok": False, "error": "internal_error"}, apply="before"
    )
    await db.submit("sl-2", flow, {"text": "hello"})
    await start_worker(flow)
    assert (await db.wait_status("sl-2", "succeeded", "paused", "failed"))["status"] == "succeeded"
    [call] = await db.calls("sl-2")
    assert (call["attempts"], call["receipt"]["found_by"]) == (1, "lookup")
    assert len(fake.effects("sl-2:0:c0")) == 1


async def test_worker_a_late_landing_ends_with_exactly_one_message(
    fake: FakeSlack, db: Db, start_worker: StartWorker
) -> None:
    client = WebClient("xoxb-test", base_url=fake.api_url, timeout=0.5, retry_handlers=[])
    flow = Flow("slack-late", "1")
    slack_tools.post_message(flow, client, channel=CHANNEL, processing_bound=1.5)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("post_slack_message", {"text": "late"})]

    fake.fault("POST", POST, apply="after", hold=1.5)
    await db.submit("sl-3", flow)
    await start_worker(flow)
    run = await db.wait_status("sl-3", "succeeded", "paused", "failed", timeout=30)
    assert run["status"] == "succeeded"
    [call] = await db.calls("sl-3")
    assert (call["attempts"], call["receipt"]["found_by"]) == (1, "lookup")
    assert len(fake.effects("sl-3:0:c0")) == 1


async def test_worker_past_the_window_the_call_is_unknown_not_resent(
    fake: FakeSlack, client: WebClient, db: Db, start_worker: StartWorker
) -> None:
    one_second = Retention(dt.timedelta(seconds=1), margin=dt.timedelta(0), name="Slack")
    flow = worker_flow(client, retention=one_second)
    fake.fault("POST", POST, status=503, body={"ok": False, "error": "service_unavailable"})
    await db.submit("sl-4", flow, {"text": "hello"})
    await start_worker(flow)
    run = await db.wait_status("sl-4", "paused", "succeeded", "failed")
    assert run["status"] == "paused"
    [call] = await db.calls("sl-4")
    assert (call["status"], call["attempts"]) == ("unknown", 1)
    assert "Slack keeps what the lookup reads for" in call["error"]["reason"]
    send, lookup = call["error"]["evidence"]
    assert send["observed"][0]["saw"] == "service_unavailable"
    assert lookup["saw"] == "unknowable"
    assert fake.effects("sl-4:0:c0") == []

"""The GitHub adapter (runledger.providers.github) against a local GitHub REST API
(tests/providers/fake_github.py), through githubkit pointed at it.

First the tools and lookups by themselves (a ToolContext built here): a send, a lookup
that finds it, one that does not, a deleted issue (the lookup cannot tell), every error
switch and what the tool makes of it, and a create that lands after the client gave
up. Then runs through a real worker on a real PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import pytest
from githubkit import GitHub

from runledger.flows import Flow, NotApplied, Receipt, ToolCall, ToolContext, Unknowable
from runledger.providers import github as github_tools
from runledger.providers.base import marker
from tests.integration.conftest import Db, StartWorker
from tests.providers.fake_github import FakeGitHub

OWNER, REPO = "acme", "support"


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    f = FakeGitHub(OWNER, REPO)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def gh(fake: FakeGitHub) -> GitHub[Any]:
    return GitHub("ghp_test", base_url=fake.url, auto_retry=False)


def ctx_for(
    key: str = "run-1:0:c0",
    *,
    first: dt.datetime | None = None,
    sent: dt.datetime | None = None,
    lease: float = 60.0,
) -> ToolContext:
    run_id, turn, call_id = key.rsplit(":", 2)
    deadline = time.monotonic() + lease
    return ToolContext(
        run_id=run_id,
        flow="t@1",
        turn=int(turn),
        call_id=call_id,
        tool="t",
        idempotency_key=key,
        fencing_token=1,
        attempt=1,
        lease_deadline=lambda: deadline,
        first_sent_at=first,
        sent_at=sent,
    )


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def sent_ctx(key: str = "run-1:0:c0", ago: float = 60.0) -> ToolContext:
    """A key first (and last) sent ``ago`` seconds ago: past any landing wait here."""
    t = now() - dt.timedelta(seconds=ago)
    return ctx_for(key, first=t, sent=t)


def tools(gh: GitHub[Any], **kw: Any) -> tuple[Any, Any, Any]:
    flow = Flow("gh")
    return (
        github_tools.create_issue(flow, gh, owner=OWNER, repo=REPO, **kw),
        github_tools.add_comment(flow, gh, owner=OWNER, repo=REPO, **kw),
        github_tools.add_labels(
            flow, gh, owner=OWNER, repo=REPO, request_timeout=kw.get("request_timeout", 5.0)
        ),
    )


ISSUES = r"/repos/acme/support/issues"


# -- send and look up ---------------------------------------------------------------


async def test_a_send_carries_the_key_and_the_lookup_finds_it(
    fake: FakeGitHub, gh: GitHub[Any]
) -> None:
    create, _, _ = tools(gh)
    ctx = sent_ctx()
    out = await create.fn(ctx, title="Printer on fire", body="Room 4")
    assert isinstance(out, Receipt)
    [issue] = fake.effects(ctx.idempotency_key)
    assert issue["body"] == f"Room 4\n\n{marker(ctx.idempotency_key)}"
    assert out.result == {"issue_number": issue["number"], "url": issue["html_url"]}
    assert out.receipt and out.receipt["found_by"] == "send"
    assert ctx.observed[0]["asked"] == "POST /repos/acme/support/issues"
    assert ctx.observed[0]["status"] == 201 and ctx.observed[0]["request_id"]

    found = await create.lookup_fn(sent_ctx())
    assert found == {**out.receipt, "found_by": "lookup"}
    assert len(fake.effects(ctx.idempotency_key)) == 1  # a lookup sends nothing


async def test_the_lookup_reads_the_issue_list_not_search(
    fake: FakeGitHub, gh: GitHub[Any]
) -> None:
    create, _, _ = tools(gh)
    await create.fn(sent_ctx(), title="t")
    await create.lookup_fn(sent_ctx())
    paths = {p for _, p, _ in fake.requests}
    assert "/repos/acme/support/issues" in paths
    assert not any(p.startswith("/search") for p in paths)
    listing = [q for m, p, q in fake.requests if m == "GET" and p == ISSUES]
    assert listing[0]["state"] == "all" and listing[0]["sort"] == "created"
    assert listing[0]["direction"] == "desc"


async def test_a_lookup_that_finds_nothing_says_none(fake: FakeGitHub, gh: GitHub[Any]) -> None:
    create, comment, _ = tools(gh)
    await create.fn(sent_ctx("other:0:c0"), title="someone else's")
    assert await create.lookup_fn(sent_ctx()) is None
    assert await comment.lookup_fn(sent_ctx()) is None


async def test_issues_persist_a_key_sent_long_ago_and_not_found_is_none(
    fake: FakeGitHub, gh: GitHub[Any]
) -> None:
    """GitHub keeps issues with no retention window: an old key is still looked up."""
    create, _, _ = tools(gh)
    fake.seed_issue("ancient", age=dt.timedelta(days=400))
    month = now() - dt.timedelta(days=30)
    assert await create.lookup_fn(ctx_for(first=month, sent=month)) is None


async def test_the_lookup_pages_back_to_the_first_send(fake: FakeGitHub, gh: GitHub[Any]) -> None:
    create, _, _ = tools(gh)
    fake.seed_issue("before the window", age=dt.timedelta(hours=2))
    ctx = sent_ctx()
    out = await create.fn(ctx, title="mine")
    for i in range(130):
        fake.seed_issue(f"newer {i}")
    found = await create.lookup_fn(sent_ctx())
    assert found and found["issue_number"] == out.receipt["issue_number"]
    pages = [q["page"] for m, p, q in fake.requests if m == "GET" and p == ISSUES]
    assert pages[-2:] == ["1", "2"]  # followed the Link header to the second page


async def test_an_issue_deleted_since_the_first_send_makes_it_unknowable(
    fake: FakeGitHub, gh: GitHub[Any]
) -> None:
    create, _, _ = tools(gh)
    old = fake.seed_issue("deleted long ago", age=dt.timedelta(days=3))
    fake.delete_issue(old)  # before the window (older than #2): not a candidate
    fake.seed_issue("kept", age=dt.timedelta(days=2))
    ctx = sent_ctx()
    await create.fn(ctx, title="mine")
    assert await create.lookup_fn(sent_ctx("run-2:0:c0")) is None
    fake.delete_issue(fake.effects(ctx.idempotency_key)[0]["number"])
    with pytest.raises(Unknowable) as err:
        await create.lookup_fn(sent_ctx())
    assert err.value.facts["gone"] == [3]
    # the newest issue deleted: found by asking past the newest listed number too
    fake.delete_issue(fake.seed_issue("another"))
    with pytest.raises(Unknowable):
        await create.lookup_fn(sent_ctx("run-3:0:c0"))


async def test_comments_carry_the_key_and_are_found(fake: FakeGitHub, gh: GitHub[Any]) -> None:
    _, comment, _ = tools(gh)
    number = fake.seed_issue("an issue")
    ctx = sent_ctx("run-1:1:c0")
    out = await comment.fn(ctx, issue_number=number, body="On it.")
    [made] = fake.effects(ctx.idempotency_key)
    assert made["body"].startswith("On it.") and marker(ctx.idempotency_key) in made["body"]
    found = await comment.lookup_fn(sent_ctx("run-1:1:c0"))
    assert found == {**out.receipt, "found_by": "lookup"}
    assert found["issue_number"] == number


async def test_a_comment_on_a_deleted_issue_is_refused(fake: FakeGitHub, gh: GitHub[Any]) -> None:
    _, comment, _ = tools(gh)
    number = fake.seed_issue("to delete")
    fake.delete_issue(number)
    with pytest.raises(NotApplied, match="410"):
        await comment.fn(sent_ctx(), issue_number=number, body="x")


async def test_labels_are_idempotent_and_carry_no_key(fake: FakeGitHub, gh: GitHub[Any]) -> None:
    _, _, labels = tools(gh)
    assert labels.safety.value == "idempotent" and labels.lookup_fn is None
    number = fake.seed_issue("label me")
    for _ in range(2):
        out = await labels.fn(sent_ctx(), issue_number=number, labels=["bug", "p1"])
        assert out == {"issue_number": number, "labels": ["bug", "p1"]}
    assert [x["name"] for x in fake.issues[number]["labels"]] == ["bug", "p1"]


# -- error switches -----------------------------------------------------------------


@pytest.mark.parametrize("status", [409, 422, 403, 404])
async def test_a_4xx_is_a_refusal(fake: FakeGitHub, gh: GitHub[Any], status: int) -> None:
    create, _, _ = tools(gh)
    fake.fault(
        "POST", ISSUES, status=status, body={"message": "Conflict", "documentation_url": "x"}
    )
    ctx = sent_ctx()
    with pytest.raises(NotApplied) as err:
        await create.fn(ctx, title="t")
    assert not err.value.retry
    assert fake.effects(ctx.idempotency_key) == []
    assert ctx.observed[-1]["status"] == status


@pytest.mark.parametrize(
    "status,headers,message",
    [
        (429, {"retry-after": "1"}, "You have exceeded a secondary rate limit"),
        (403, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "0"}, "API rate limit exceeded"),
    ],
)
async def test_a_rate_limit_waits_and_is_not_applied(
    fake: FakeGitHub, gh: GitHub[Any], status: int, headers: dict[str, str], message: str
) -> None:
    create, _, _ = tools(gh)
    fake.fault("POST", ISSUES, status=status, headers=headers, body={"message": message})
    ctx = sent_ctx()
    started = time.monotonic()
    with pytest.raises(NotApplied) as err:
        await create.fn(ctx, title="t")
    assert err.value.retry
    if status == 429:
        assert time.monotonic() - started >= 1.0  # waited as asked
    assert fake.effects(ctx.idempotency_key) == []
    # sent again later (same key): one issue
    await create.fn(ctx, title="t")
    assert len(fake.effects(ctx.idempotency_key)) == 1


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not_applied"])
async def test_a_5xx_is_ambiguous_and_the_lookup_decides(
    fake: FakeGitHub, gh: GitHub[Any], applied: bool
) -> None:
    create, _, _ = tools(gh)
    fake.fault(
        "POST",
        ISSUES,
        status=502,
        body={"message": "Server Error"},
        apply="before" if applied else "never",
    )
    ctx = sent_ctx()
    with pytest.raises(github_tools.GitHubAmbiguous, match="502"):
        await create.fn(ctx, title="t")
    found = await create.lookup_fn(sent_ctx())
    assert (found is not None) == applied
    assert len(fake.effects(ctx.idempotency_key)) == int(applied)


async def test_a_held_answer_is_a_timeout_and_ambiguous(fake: FakeGitHub, gh: GitHub[Any]) -> None:
    create, _, _ = tools(gh, request_timeout=0.5)
    fake.fault("POST", ISSUES, apply="before", hold=2.0)
    ctx = sent_ctx()
    with pytest.raises(github_tools.GitHubAmbiguous, match="no answer"):
        await create.fn(ctx, title="t")
    assert await create.lookup_fn(sent_ctx()) is not None
    assert len(fake.effects(ctx.idempotency_key)) == 1


async def test_a_create_that_lands_after_the_client_gave_up_is_found_once(
    fake: FakeGitHub, gh: GitHub[Any]
) -> None:
    """The server acts 3 s after the client gave up at 0.5 s; the lookup waits out the
    landing bound (4 s from the send) before it reads, finds it, and nothing is sent
    twice."""
    create, _, _ = tools(gh, request_timeout=0.5, landing_bound=4.0)
    fake.fault("POST", ISSUES, apply="after", hold=3.0)
    key = "run-1:0:c0"
    sent = now()
    ctx = ctx_for(key, first=sent, sent=sent)
    with pytest.raises(github_tools.GitHubAmbiguous):
        await create.fn(ctx, title="t")
    assert fake.effects(key) == []  # not landed yet: a read now would say "not found"
    lookup_ctx = ctx_for(key, first=sent, sent=sent)
    found = await create.lookup_fn(lookup_ctx)
    assert found is not None and found["found_by"] == "lookup"
    assert len(fake.effects(key)) == 1
    assert any("waited_for_landing_s" in o for o in lookup_ctx.observed)


async def test_a_lease_that_ends_before_the_landing_fails_the_lookup(
    fake: FakeGitHub, gh: GitHub[Any]
) -> None:
    """A lease not renewed (this ctx's) ends during the wait: the lookup fails (asked
    again later), it never says "not found" early."""
    create, _, _ = tools(gh, landing_bound=30.0)
    with pytest.raises(TimeoutError, match="lease is about to end"):
        await create.lookup_fn(ctx_for(first=now(), sent=now(), lease=1.5))
    assert not any(p == ISSUES for _, p, _ in fake.requests)


def test_a_client_that_retries_5xx_is_refused(fake: FakeGitHub) -> None:
    with pytest.raises(github_tools.GitHubConfigError, match="auto_retry=False"):
        github_tools.create_issue(Flow("x"), GitHub("t", base_url=fake.url), owner="a", repo="b")
    with pytest.raises(github_tools.GitHubConfigError, match="owner"):
        github_tools.create_issue(
            Flow("x"), GitHub("t", base_url=fake.url, auto_retry=False), owner="a/b", repo="c"
        )


# -- through a real worker, on a real PostgreSQL --------------------------------------


def worker_flow(gh: GitHub[Any], **kw: Any) -> Flow:
    flow = Flow("gh-issues", "1")
    github_tools.create_issue(flow, gh, owner=OWNER, repo=REPO, **kw)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        if history:
            return []
        return [ToolCall("create_github_issue", {"title": ctx.input["title"]})]

    return flow


async def test_worker_a_run_opens_one_issue(
    fake: FakeGitHub, gh: GitHub[Any], db: Db, start_worker: StartWorker
) -> None:
    flow = worker_flow(gh)
    await db.submit("gh-1", flow, {"title": "hello"})
    await start_worker(flow)
    run = await db.wait_status("gh-1", "succeeded", "paused", "failed")
    assert run["status"] == "succeeded"
    [call] = await db.calls("gh-1")
    assert (call["status"], call["attempts"]) == ("succeeded", 1)
    assert call["receipt"]["found_by"] == "send"
    assert len(fake.effects("gh-1:0:c0")) == 1


async def test_worker_an_applied_502_settles_by_lookup_without_a_second_issue(
    fake: FakeGitHub, gh: GitHub[Any], db: Db, start_worker: StartWorker
) -> None:
    flow = worker_flow(gh, landing_bound=0.5)
    fake.fault("POST", ISSUES, status=502, body={"message": "Server Error"}, apply="before")
    await db.submit("gh-2", flow, {"title": "hello"})
    await start_worker(flow)
    run = await db.wait_status("gh-2", "succeeded", "paused", "failed")
    assert run["status"] == "succeeded"
    [call] = await db.calls("gh-2")
    assert (call["status"], call["attempts"]) == ("succeeded", 1)
    assert call["receipt"]["found_by"] == "lookup"
    assert len(fake.effects("gh-2:0:c0")) == 1


async def test_worker_a_late_landing_ends_with_exactly_one_issue(
    fake: FakeGitHub, gh: GitHub[Any], db: Db, start_worker: StartWorker
) -> None:
    flow = worker_flow(gh, request_timeout=0.5, landing_bound=3.0)
    fake.fault("POST", ISSUES, apply="after", hold=1.5)
    await db.submit("gh-3", flow, {"title": "hello"})
    await start_worker(flow)
    run = await db.wait_status("gh-3", "succeeded", "paused", "failed", timeout=30)
    assert run["status"] == "succeeded"
    [call] = await db.calls("gh-3")
    assert (call["status"], call["attempts"]) == ("succeeded", 1)
    assert call["receipt"]["found_by"] == "lookup"
    assert len(fake.effects("gh-3:0:c0")) == 1


async def test_worker_a_not_applied_503_is_sent_again_once(
    fake: FakeGitHub, gh: GitHub[Any], db: Db, start_worker: StartWorker
) -> None:
    flow = worker_flow(gh, landing_bound=0.5)
    fake.fault("POST", ISSUES, status=503, body={"message": "Service Unavailable"})
    await db.submit("gh-4", flow, {"title": "hello"})
    await start_worker(flow)
    run = await db.wait_status("gh-4", "succeeded", "paused", "failed")
    assert run["status"] == "succeeded"
    [call] = await db.calls("gh-4")
    assert (call["status"], call["attempts"]) == ("succeeded", 2)
    assert call["receipt"]["found_by"] == "send"
    assert len(fake.effects("gh-4:0:c0")) == 1


async def test_worker_a_deleted_issue_in_the_window_makes_the_call_unknown_with_evidence(
    fake: FakeGitHub, gh: GitHub[Any], db: Db, start_worker: StartWorker
) -> None:
    flow = worker_flow(gh, landing_bound=0.5)
    fake.delete_issue(fake.seed_issue("someone's, deleted"))
    fake.fault("POST", ISSUES, status=503, body={"message": "Service Unavailable"})
    await db.submit("gh-5", flow, {"title": "hello"})
    await start_worker(flow)
    run = await db.wait_status("gh-5", "paused", "succeeded", "failed")
    assert run["status"] == "paused"
    [call] = await db.calls("gh-5")
    assert (call["status"], call["attempts"]) == ("unknown", 1)
    assert "cannot tell" in call["error"]["reason"] and "#1" in call["error"]["reason"]
    send, lookup = call["error"]["evidence"]
    assert send["observed"][0]["status"] == 503
    assert lookup["saw"] == "unknowable" and {"gone": [1]} in lookup["observed"]
    assert fake.effects("gh-5:0:c0") == []  # never sent twice, nor once

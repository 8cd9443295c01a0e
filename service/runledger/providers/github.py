"""GitHub issues, comments and labels as ready tools, on ``githubkit`` (docs/providers.md).

GitHub does not deduplicate anything: a create sent twice is two issues. So the two
creating tools are ``lookup`` tools that are never sent twice for a key that may have
taken effect, and the label tool is ``idempotent`` (adding labels twice is adding them
once)::

    from githubkit import GitHub
    from runledger.providers import github as github_tools

    gh = GitHub(token, auto_retry=False)
    github_tools.create_issue(flow, gh, owner="acme", repo="support")
    github_tools.add_comment(flow, gh, owner="acme", repo="support")
    github_tools.add_labels(flow, gh, owner="acme", repo="support")

How the key travels: the call's idempotency key is appended to the issue's or the
comment's body as a hidden marker (:func:`runledger.providers.base.marker`, an HTML
comment that GitHub does not render).

How a call found in flight settles (the crash windows):

- before the send (``before_dispatch``): sent, once;
- sent, no answer journaled (``after_dispatch``, ``after_effect``, a timeout, a 5xx, a
  dropped connection): the lookup first waits until the last send can no longer land
  (the request's own timeout plus GitHub's documented 10 s processing limit), then
  reads the repository's issues (or issue comments) newest first, back to the key's
  first send less a margin, for the marker. Found: the call succeeds with that issue
  or comment, nothing is sent. Not found: the key did not take effect, it is sent
  again. A list endpoint is read, not the search API: search is served from an index
  that GitHub updates asynchronously, with no bound on its lag;
- an issue created since the key's first send that was deleted since (GitHub answers
  410 for its number): the lookup cannot tell whether it was this call's, and raises
  :class:`runledger.Unknowable`: a person decides, nothing is sent again;
- the receipt is journaled (``after_complete``): reused, nothing is sent.

A 4xx answer is a refusal (:class:`runledger.NotApplied`); a rate limit (429, or 403
with the rate-limit headers) waits as long as GitHub asks (within the lease) and is not
applied either, to be sent again with the same key. Any other failure is ambiguous.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from githubkit import GitHub
from githubkit.exception import RateLimitExceeded, RequestError, RequestFailed
from githubkit.response import Response
from githubkit.retry import RetryChainDecision, RetryRateLimit

from runledger.flows import Flow, NotApplied, Receipt, Tool, ToolContext, Unknowable
from runledger.providers.base import await_landing, marker, retry_after

__all__ = [
    "GITHUB_PROCESSING_BOUND",
    "GitHubAmbiguous",
    "GitHubConfigError",
    "add_comment",
    "add_labels",
    "create_issue",
]

# "If GitHub takes more than 10 seconds to process an API request, GitHub will terminate
# the request and you will receive a timeout response" (docs.github.com, Troubleshooting
# the REST API, "Timeouts"). GitHub "reserves the right to change the timeout window":
# landing_bound= overrides what is derived from it.
GITHUB_PROCESSING_BOUND = 10.0
# time on the wire on top of both timeouts
NETWORK_MARGIN = 2.0
# rate limits: waited for within the tool at most this long (then sent again later)
MAX_RATE_WAIT = 60.0
# at most this many pages (100 items each) per lookup, and numbers probed one by one
MAX_PAGES = 20
MAX_PROBES = 20


class GitHubConfigError(ValueError):
    """The GitHub tools cannot be registered as configured (one line says why)."""


class GitHubAmbiguous(Exception):
    """A send whose outcome is unknown (a 5xx, a timeout, a dropped connection): the
    call is looked up, never simply sent again."""


@dataclass(frozen=True, slots=True)
class _Repo:
    client: GitHub[Any]
    owner: str
    repo: str
    request_timeout: float
    landing_bound: float
    margin: dt.timedelta
    max_pages: int

    @property
    def path(self) -> str:
        return f"/repos/{self.owner}/{self.repo}"


def _repo(
    client: Any,
    owner: str,
    repo: str,
    request_timeout: float,
    landing_bound: float | None,
    margin: dt.timedelta,
    max_pages: int,
) -> _Repo:
    if not isinstance(client, GitHub):
        raise GitHubConfigError(f"client must be a githubkit.GitHub, got {type(client).__name__}")
    if not _retries_rate_limits_only(client.config.auto_retry):
        raise GitHubConfigError(
            "the GitHub client retries failed requests itself (githubkit's auto_retry "
            "retries 5xx answers): an issue whose create answered 502 would be created "
            "twice; build it with GitHub(..., auto_retry=False)"
        )
    for what, value in (("owner", owner), ("repo", repo)):
        if not value or "/" in value or value.strip() != value:
            raise GitHubConfigError(f"{what} must be a plain GitHub {what} name, got {value!r}")
    if not request_timeout > 0:
        raise GitHubConfigError(f"request_timeout must be positive, got {request_timeout!r}")
    if max_pages < 1:
        raise GitHubConfigError("max_pages must be at least 1")
    bound = (
        request_timeout + GITHUB_PROCESSING_BOUND + NETWORK_MARGIN
        if landing_bound is None
        else landing_bound
    )
    return _Repo(client, owner, repo, request_timeout, bound, margin, max_pages)


def _retries_rate_limits_only(decide: Any) -> bool:
    """githubkit's ``auto_retry``: None (off), or retries of rate limits only (a rate
    limited request was not applied). Its default also retries 5xx answers."""
    if decide is None or isinstance(decide, RetryRateLimit):
        return True
    if isinstance(decide, RetryChainDecision):
        return all(_retries_rate_limits_only(d) for d in decide.decision_funcs)
    return False


# -- sending --------------------------------------------------------------------------


def _request_id(resp: Response[Any]) -> str | None:
    value = resp.headers.get("x-github-request-id")
    return None if value is None else str(value)


def _message(resp: Response[Any]) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        return str(body.get("message", ""))[:200]
    return ""


def _rate_limited(exc: RequestFailed) -> float | None:
    """Seconds GitHub asks to wait when ``exc`` is a rate limit, else None."""
    resp = exc.response
    if isinstance(exc, RateLimitExceeded):
        return exc.retry_after.total_seconds()
    if resp.status_code == 429 or (
        resp.status_code == 403 and "rate limit" in _message(resp).lower()
    ):
        return retry_after(dict(resp.headers), default=60.0, cap=3600.0)
    return None


async def _send(
    ctx: ToolContext, r: _Repo, asked: str, call: Callable[[], Awaitable[Response[Any]]]
) -> Any:
    """One write, within the request timeout; its JSON answer. A refusal raises
    NotApplied, anything that may have been applied GitHubAmbiguous."""
    try:
        async with asyncio.timeout(r.request_timeout):
            resp = await call()
    except RequestFailed as exc:
        resp = exc.response
        status = resp.status_code
        ctx.observe(asked=asked, status=status, request_id=_request_id(resp), saw=_message(resp))
        wait = _rate_limited(exc)
        if wait is not None:
            wait = max(0.0, min(wait, MAX_RATE_WAIT, ctx.remaining() / 2))
            await asyncio.sleep(wait)
            raise NotApplied(
                f"{asked}: rate limited (HTTP {status}), waited {wait:.0f} s", retry=True
            ) from None
        if 400 <= status < 500:
            raise NotApplied(f"{asked}: refused with HTTP {status}: {_message(resp)}") from None
        raise GitHubAmbiguous(
            f"{asked}: HTTP {status} {_message(resp)!r}: it may have been applied"
        ) from exc
    except (TimeoutError, RequestError) as exc:
        ctx.observe(asked=asked, saw=f"no answer: {type(exc).__name__}")
        raise GitHubAmbiguous(
            f"{asked}: no answer within {r.request_timeout:g} s ({type(exc).__name__}): "
            "it may have been applied"
        ) from exc
    ctx.observe(asked=asked, status=resp.status_code, request_id=_request_id(resp))
    return resp.json()


def _with_marker(ctx: ToolContext, body: str) -> str:
    mark = marker(ctx.idempotency_key)
    return f"{body}\n\n{mark}" if body else mark


# -- reading --------------------------------------------------------------------------


async def _read(
    ctx: ToolContext, r: _Repo, asked: str, call: Callable[[], Awaitable[Response[Any]]]
) -> Response[Any]:
    """One read for a lookup. A rate limit is waited for when the lease allows it (then
    read again), otherwise it raises: the lookup failed and is asked again later."""
    while True:
        try:
            async with asyncio.timeout(r.request_timeout):
                return await call()
        except RequestFailed as exc:
            wait = _rate_limited(exc)
            ctx.observe(asked=asked, status=exc.response.status_code, saw=_message(exc.response))
            if wait is None or wait >= ctx.remaining() / 2:
                raise
            await asyncio.sleep(wait)


def _next_page(resp: Response[Any]) -> int | None:
    """The page the ``Link: <...>; rel="next"`` header points to, if any."""
    nxt = resp.raw_response.links.get("next")
    if not nxt or "url" not in nxt:
        return None
    pages = parse_qs(urlsplit(nxt["url"]).query).get("page")
    return int(pages[0]) if pages else None


def _created(item: dict[str, Any]) -> dt.datetime:
    return dt.datetime.fromisoformat(str(item["created_at"]).replace("Z", "+00:00"))


def _since(ctx: ToolContext, r: _Repo) -> dt.datetime | None:
    return None if ctx.first_sent_at is None else ctx.first_sent_at - r.margin


def _too_many(ctx: ToolContext, r: _Repo, what: str) -> RuntimeError:
    return RuntimeError(
        f"more than {r.max_pages * 100} {what} since the first send of "
        f"{ctx.idempotency_key}: the lookup stops there (raise max_pages)"
    )


async def _find_issue(ctx: ToolContext, r: _Repo) -> dict[str, Any] | None:
    await await_landing(ctx, r.landing_bound)
    mark = marker(ctx.idempotency_key)
    since = _since(ctx, r)
    asked = f"GET {r.path}/issues?state=all&sort=created&direction=desc"
    numbers: list[int] = []
    before = 0  # the newest issue number older than the window (0: none)
    page: int | None = 1
    for _ in range(r.max_pages):
        assert page is not None
        resp = await _read(
            ctx,
            r,
            asked,
            functools.partial(
                r.client.rest.issues.async_list_for_repo,
                r.owner,
                r.repo,
                state="all",
                sort="created",
                direction="desc",
                per_page=100,
                page=page,
            ),
        )
        for item in resp.json():
            if since is not None and _created(item) < since:
                before = int(item["number"])
                page = None
                break
            if mark in (item.get("body") or ""):
                ctx.observe(asked=asked, saw=f"issue #{item['number']} carries the key")
                return _issue_receipt(item)
            numbers.append(int(item["number"]))
        else:
            page = _next_page(resp)
        if page is None:
            break
    else:
        raise _too_many(ctx, r, "issues")
    ctx.observe(asked=asked, saw=f"{len(numbers)} issues since the first send, none with the key")
    return await _missing_numbers(ctx, r, mark, before, numbers)


async def _missing_numbers(
    ctx: ToolContext, r: _Repo, mark: str, before: int, numbers: list[int]
) -> dict[str, Any] | None:
    """Issue numbers are one sequence per repository (issues, pull requests and
    discussions): a number in the window that the list did not show is a deleted or
    transferred issue, a discussion, or an issue created after the list was read. Each
    is asked for (a transferred issue redirects to its new place), and so is the next
    number past the newest, until GitHub says there is none (404)."""
    top = max(numbers, default=before)
    missing = sorted(set(range(before + 1, top + 1)) - set(numbers))
    if len(missing) > MAX_PROBES:
        raise Unknowable(
            f"{len(missing)} issue numbers since the first send of {ctx.idempotency_key} "
            "are not in the repository's issue list (deleted, transferred, or discussions): "
            "too many to check one by one",
            missing=missing[:50],
        )
    gone: list[int] = []
    candidates = [*missing, top + 1]
    probes = 0
    while candidates and probes < MAX_PROBES + 5:
        n = candidates.pop(0)
        probes += 1
        try:
            resp = await _read(
                ctx,
                r,
                f"GET {r.path}/issues/{n}",
                functools.partial(r.client.rest.issues.async_get, r.owner, r.repo, n),
            )
        except RequestFailed as exc:
            status = exc.response.status_code
            if status == 404:  # not an issue (a discussion), or none yet past the newest
                continue
            if status == 410:  # "Gone": the issue was deleted
                gone.append(n)
                if n > top:
                    candidates.append(n + 1)
                continue
            raise
        if resp.status_code in (301, 302, 307, 308):
            gone.append(n)  # moved, and the client does not follow redirects
        else:
            item = resp.json()
            if mark in (item.get("body") or ""):
                ctx.observe(asked=f"GET {r.path}/issues/{n}", saw="it carries the key")
                return _issue_receipt(item)
        if n > top:
            candidates.append(n + 1)  # created since the list was read: look further
    if gone:
        raise Unknowable(
            f"issue(s) {', '.join(f'#{n}' for n in gone)} of {r.owner}/{r.repo}, created "
            f"since the first send of {ctx.idempotency_key}, are gone (deleted or moved): "
            "one of them may have been this call's",
            gone=gone,
        )
    return None


def _issue_receipt(item: dict[str, Any], found_by: str = "lookup") -> dict[str, Any]:
    return {
        "issue_number": item["number"],
        "issue_id": item.get("id"),
        "html_url": item.get("html_url"),
        "found_by": found_by,
    }


async def _find_comment(ctx: ToolContext, r: _Repo) -> dict[str, Any] | None:
    await await_landing(ctx, r.landing_bound)
    mark = marker(ctx.idempotency_key)
    since = _since(ctx, r)
    asked = f"GET {r.path}/issues/comments?sort=created&direction=desc"
    seen = 0
    page: int | None = 1
    for _ in range(r.max_pages):
        assert page is not None
        resp = await _read(
            ctx,
            r,
            asked,
            functools.partial(
                r.client.rest.issues.async_list_comments_for_repo,
                r.owner,
                r.repo,
                sort="created",
                direction="desc",
                per_page=100,
                page=page,
            ),
        )
        for item in resp.json():
            if since is not None and _created(item) < since:
                page = None
                break
            if mark in (item.get("body") or ""):
                ctx.observe(asked=asked, saw=f"comment {item['id']} carries the key")
                return _comment_receipt(item)
            seen += 1
        else:
            page = _next_page(resp)
        if page is None:
            break
    else:
        raise _too_many(ctx, r, "comments")
    ctx.observe(asked=asked, saw=f"{seen} comments since the first send, none with the key")
    return None


def _comment_receipt(item: dict[str, Any], found_by: str = "lookup") -> dict[str, Any]:
    issue_url = str(item.get("issue_url") or "")
    number = issue_url.rsplit("/", 1)[-1]
    return {
        "comment_id": item["id"],
        "issue_number": int(number) if number.isdigit() else None,
        "html_url": item.get("html_url"),
        "found_by": found_by,
    }


# -- the tools ------------------------------------------------------------------------


def create_issue(
    flow: Flow,
    client: GitHub[Any],
    *,
    owner: str,
    repo: str,
    name: str = "create_github_issue",
    request_timeout: float = 5.0,
    landing_bound: float | None = None,
    margin: dt.timedelta = dt.timedelta(minutes=10),
    max_pages: int = MAX_PAGES,
    max_attempts: int = 3,
) -> Tool[Any]:
    """Register ``name(title, body="", labels=None)``: open an issue in ``owner/repo``.

    Safety ``lookup``. The key rides in the body as a hidden marker; the lookup reads
    the repository's issues (``GET /repos/{owner}/{repo}/issues?state=all&sort=created
    &direction=desc``, every page back to the key's first send less ``margin``) after
    waiting ``landing_bound`` seconds from the last send (default: ``request_timeout``
    plus GitHub's 10 s plus 2 s; the worker renews the lease meanwhile). An
    issue deleted since the first send makes the lookup :class:`~runledger.Unknowable`.
    """
    r = _repo(client, owner, repo, request_timeout, landing_bound, margin, max_pages)

    @flow.tool(safety="lookup", name=name, max_attempts=max_attempts)
    async def tool(
        ctx: ToolContext, title: str, body: str = "", labels: list[str] | None = None
    ) -> Receipt:
        data: dict[str, Any] = {"title": title, "body": _with_marker(ctx, body)}
        if labels:
            data["labels"] = list(labels)
        item = await _send(
            ctx,
            r,
            f"POST {r.path}/issues",
            lambda: r.client.rest.issues.async_create(r.owner, r.repo, data=data),  # type: ignore[call-overload]
        )
        receipt = _issue_receipt(item, found_by="send")
        return Receipt(
            result={"issue_number": item["number"], "url": item.get("html_url")}, receipt=receipt
        )

    @tool.lookup
    async def find(ctx: ToolContext) -> dict[str, Any] | None:
        return await _find_issue(ctx, r)

    return tool


def add_comment(
    flow: Flow,
    client: GitHub[Any],
    *,
    owner: str,
    repo: str,
    name: str = "comment_on_github_issue",
    request_timeout: float = 5.0,
    landing_bound: float | None = None,
    margin: dt.timedelta = dt.timedelta(minutes=10),
    max_pages: int = MAX_PAGES,
    max_attempts: int = 3,
) -> Tool[Any]:
    """Register ``name(issue_number, body)``: comment on an issue (or pull request).

    Safety ``lookup``. The key rides in the comment as a hidden marker; the lookup reads
    the repository's issue comments (``GET /repos/{owner}/{repo}/issues/comments
    ?sort=created&direction=desc``) back to the key's first send less ``margin``, after
    the same landing wait as :func:`create_issue`. A comment deleted before the lookup
    reads it is not seen: the comment is posted again. If the issue itself was deleted,
    its comments are gone too, and the send again is refused (410): the call fails.
    """
    r = _repo(client, owner, repo, request_timeout, landing_bound, margin, max_pages)

    @flow.tool(safety="lookup", name=name, max_attempts=max_attempts)
    async def tool(ctx: ToolContext, issue_number: int, body: str) -> Receipt:
        text = _with_marker(ctx, body)
        item = await _send(
            ctx,
            r,
            f"POST {r.path}/issues/{issue_number}/comments",
            lambda: r.client.rest.issues.async_create_comment(
                r.owner, r.repo, int(issue_number), body=text
            ),
        )
        receipt = _comment_receipt(item, found_by="send")
        return Receipt(
            result={"comment_id": item["id"], "url": item.get("html_url")}, receipt=receipt
        )

    @tool.lookup
    async def find(ctx: ToolContext) -> dict[str, Any] | None:
        return await _find_comment(ctx, r)

    return tool


def add_labels(
    flow: Flow,
    client: GitHub[Any],
    *,
    owner: str,
    repo: str,
    name: str = "label_github_issue",
    request_timeout: float = 5.0,
    max_attempts: int = 3,
) -> Tool[Any]:
    """Register ``name(issue_number, labels)``: add labels to an issue.

    Safety ``idempotent``, no lookup and no key: adding a label the issue already has
    changes nothing, so a call found in flight is simply sent again (up to
    ``max_attempts``; past them it is ``unknown``). A label a person removed between
    the first send and the resend is put back: the call's effect is "these labels are
    on the issue", not "these labels were added once".
    """
    r = _repo(client, owner, repo, request_timeout, None, dt.timedelta(0), 1)

    @flow.tool(safety="idempotent", name=name, max_attempts=max_attempts)
    async def tool(ctx: ToolContext, issue_number: int, labels: list[str]) -> dict[str, Any]:
        names = [str(label) for label in labels]
        items = await _send(
            ctx,
            r,
            f"POST {r.path}/issues/{issue_number}/labels",
            lambda: r.client.rest.issues.async_add_labels(
                r.owner, r.repo, int(issue_number), data={"labels": names}
            ),
        )
        return {"issue_number": int(issue_number), "labels": [i["name"] for i in items]}

    return tool

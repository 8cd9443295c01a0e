"""A local GitHub REST API for the GitHub adapter's tests (runledger.providers.github).

It speaks the documented shapes of the endpoints the adapter uses (docs.github.com,
REST API "Issues", "Issue comments", "Labels"):

- ``POST /repos/{o}/{r}/issues`` (201, the issue), ``GET /repos/{o}/{r}/issues``
  (``state``, ``sort``, ``direction``, ``since``, ``per_page`` up to 100, ``page``, with
  a ``Link`` header), ``GET /repos/{o}/{r}/issues/{n}`` (404 never existed, 410 deleted);
- ``POST /repos/{o}/{r}/issues/{n}/comments`` (201), ``GET /repos/{o}/{r}/issues/comments``
  (``sort``, ``direction``, ``since``, paged);
- ``POST /repos/{o}/{r}/issues/{n}/labels`` (200, every label of the issue).

Errors have GitHub's body (``{"message", "documentation_url", "status"}``) and headers
(``x-github-request-id``, ``retry-after`` on a rate limit). The switches
(:meth:`FakeHTTP.fault`) answer the next matching request(s) with a status of their
choice (a 409 or 422 refusal, a 429 with ``Retry-After``, a 5xx, applied first or
not), hold the answer (a timeout: applied before, after, or never), or apply it after
the client has given up (a late landing). Every effect is recorded, per key (the key's
marker in a body) and per issue (labels).

:class:`FakeHTTP` (a threaded HTTP server with faults) is shared with ``fake_slack``.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from runledger.providers.base import marker

Answer = tuple[int, dict[str, str], Any]  # status, headers, JSON body


@dataclass
class Fault:
    """What the next ``times`` requests matching ``method`` and ``path`` (a regex, whole
    path) get. ``apply``: ``"before"`` the effect happens, then the hold, then the
    answer; ``"after"``: the hold, then the effect (a late landing when the hold is
    longer than the client waits); ``"never"``. ``status``: the answer (with ``body``
    and ``headers``); None: the effect's own answer."""

    method: str
    path: str
    status: int | None = None
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    apply: str = "never"
    hold: float = 0.0
    times: int = 1
    hits: int = 0


class Request:
    def __init__(self, method: str, path: str, query: dict[str, str], body: Any, headers: Any):
        self.method = method
        self.path = path
        self.query = query
        self.body = body
        self.headers = headers


class FakeHTTP:
    """A threaded local HTTP server; subclasses route requests (:meth:`route` returns
    the function that applies the request and gives its answer)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.landed = threading.Condition(self.lock)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                split = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(split.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                ctype = self.headers.get("Content-Type") or ""
                body: Any = None
                if raw and "json" in ctype:
                    body = json.loads(raw)
                elif raw and "x-www-form-urlencoded" in ctype:
                    body = {k: v[-1] for k, v in parse_qs(raw.decode()).items()}
                req = Request(self.command, split.path, query, body, self.headers)
                status, headers, payload = fake.handle(req)
                data = b"" if payload is None else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json; charset=utf-8")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up: what it missed is in the record

            do_GET = _serve
            do_POST = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- switches -------------------------------------------------------------------

    def fault(self, method: str, path: str, **kw: Any) -> Fault:
        f = Fault(method, path, **kw)
        with self.lock:
            self.faults.append(f)
        return f

    def _take_fault(self, req: Request) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.method == req.method and re.fullmatch(f.path, req.path):
                    f.hits += 1
                    if f.hits >= f.times:
                        self.faults.remove(f)
                    return f
        return None

    # -- serving --------------------------------------------------------------------

    def route(self, req: Request) -> Callable[[], Answer]:
        raise NotImplementedError

    def error(self, status: int, message: str) -> Answer:
        raise NotImplementedError

    def handle(self, req: Request) -> Answer:
        with self.lock:
            self.requests.append((req.method, req.path, dict(req.query)))
        act = self.route(req)
        f = self._take_fault(req)
        if f is None:
            with self.lock:
                return act()
        answer: Answer | None = None
        if f.apply == "before":
            with self.lock:
                answer = act()
                self.landed.notify_all()
        if f.hold:
            time.sleep(f.hold)  # the server holding its answer: what a timeout is
        if f.apply == "after":
            with self.lock:
                answer = act()
                self.landed.notify_all()
        if f.status is not None:
            return f.status, dict(f.headers), f.body
        if answer is None:
            return self.error(502, "Server Error")
        return answer

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 15.0) -> None:
        """Wait (on the server's condition) until ``predicate()`` holds."""
        deadline = time.monotonic() + timeout
        with self.landed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {predicate}")
                self.landed.wait(min(left, 0.05))


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_iso(s: str) -> dt.datetime:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))


DOCS = "https://docs.github.com/rest"


class FakeGitHub(FakeHTTP):
    """One repository, ``owner/repo``, on a local GitHub REST API."""

    def __init__(self, owner: str = "acme", repo: str = "support") -> None:
        self.owner, self.repo = owner, repo
        self.issues: dict[int, dict[str, Any]] = {}
        self.deleted: set[int] = set()
        self.comments: list[dict[str, Any]] = []
        self.label_adds: list[tuple[int, list[str]]] = []  # every applied labels request
        self._numbers = itertools.count(1)
        self._ids = itertools.count(1000)
        super().__init__()

    # -- what happened -------------------------------------------------------------------

    def effects(self, key: str) -> list[dict[str, Any]]:
        """Every issue and comment carrying ``key``'s marker, deleted ones included."""
        mark = marker(key)
        with self.lock:
            found = [i for i in self.issues.values() if mark in (i["body"] or "")]
            found += [c for c in self.comments if mark in (c["body"] or "")]
            return found

    def seed_issue(
        self, title: str = "old", body: str = "", age: dt.timedelta | None = None
    ) -> int:
        """An issue created ``age`` ago (not an effect of any call)."""
        with self.lock:
            _, _, item = self._create_issue({"title": title, "body": body}, age=age)
            return int(item["number"])

    def delete_issue(self, number: int) -> None:
        with self.lock:
            self.deleted.add(number)

    # -- the API ------------------------------------------------------------------------

    def error(self, status: int, message: str) -> Answer:
        return (
            status,
            {"x-github-request-id": self._rid()},
            {"message": message, "documentation_url": DOCS, "status": str(status)},
        )

    def _rid(self) -> str:
        return uuid.uuid4().hex[:20].upper()

    def _ok(self, status: int, body: Any, headers: dict[str, str] | None = None) -> Answer:
        return status, {"x-github-request-id": self._rid(), **(headers or {})}, body

    def route(self, req: Request) -> Callable[[], Answer]:
        base = f"/repos/{self.owner}/{self.repo}"
        p = req.path
        if not p.startswith(base + "/") and p != base:
            return lambda: self.error(404, "Not Found")
        rest = p[len(base) :]
        m = re.fullmatch(r"/issues/(\d+)(/comments|/labels)?", rest)
        if req.method == "POST" and rest == "/issues":
            return lambda: self._create_issue(req.body or {})
        if req.method == "GET" and rest == "/issues":
            return lambda: self._list_issues(req)
        if req.method == "GET" and rest == "/issues/comments":
            return lambda: self._list_comments(req)
        if m and req.method == "GET" and m.group(2) is None:
            return lambda: self._get_issue(int(m.group(1)))
        if m and req.method == "POST" and m.group(2) == "/comments":
            return lambda: self._comment(int(m.group(1)), req.body or {})
        if m and req.method == "POST" and m.group(2) == "/labels":
            return lambda: self._add_labels(int(m.group(1)), req.body)
        return lambda: self.error(404, "Not Found")

    def _issue_url(self, n: int) -> str:
        return f"{self.url}/repos/{self.owner}/{self.repo}/issues/{n}"

    def _label(self, name: str) -> dict[str, Any]:
        return {
            "id": abs(hash(name)) % 10**9,
            "node_id": f"LA_{name}",
            "url": f"{self.url}/repos/{self.owner}/{self.repo}/labels/{name}",
            "name": name,
            "color": "ededed",
            "default": False,
            "description": None,
        }

    def _create_issue(self, body: dict[str, Any], age: dt.timedelta | None = None) -> Answer:
        title = body.get("title")
        if not title:
            return (
                422,
                {"x-github-request-id": self._rid()},
                {
                    "message": "Validation Failed",
                    "errors": [{"resource": "Issue", "code": "missing_field", "field": "title"}],
                    "documentation_url": DOCS,
                    "status": "422",
                },
            )
        n = next(self._numbers)
        now = dt.datetime.now(dt.UTC) - (age or dt.timedelta(0))
        item = {
            "id": next(self._ids),
            "node_id": f"I_{n}",
            "url": self._issue_url(n),
            "repository_url": f"{self.url}/repos/{self.owner}/{self.repo}",
            "comments_url": self._issue_url(n) + "/comments",
            "html_url": f"https://github.com/{self.owner}/{self.repo}/issues/{n}",
            "number": n,
            "state": "open",
            "title": title,
            "body": body.get("body"),
            "user": {"login": "runledger-bot", "id": 1, "type": "Bot"},
            "labels": [self._label(str(x)) for x in body.get("labels") or []],
            "assignees": [],
            "locked": False,
            "comments": 0,
            "created_at": _iso(now),
            "updated_at": _iso(now),
            "closed_at": None,
            "author_association": "OWNER",
        }
        self.issues[n] = item
        return self._ok(201, item, {"Location": item["url"]})

    def _gone(self, n: int) -> Answer | None:
        if n in self.deleted:
            return self.error(410, "This issue was deleted")
        if n not in self.issues:
            return self.error(404, "Not Found")
        return None

    def _get_issue(self, n: int) -> Answer:
        return self._gone(n) or self._ok(200, self.issues[n])

    def _comment(self, n: int, body: dict[str, Any]) -> Answer:
        gone = self._gone(n)
        if gone:
            return gone
        text = body.get("body")
        if not text:
            return self.error(422, "Validation Failed")
        now = dt.datetime.now(dt.UTC)
        cid = next(self._ids)
        item = {
            "id": cid,
            "node_id": f"IC_{cid}",
            "url": f"{self.url}/repos/{self.owner}/{self.repo}/issues/comments/{cid}",
            "html_url": f"https://github.com/{self.owner}/{self.repo}/issues/{n}#issuecomment-{cid}",
            "issue_url": self._issue_url(n),
            "body": text,
            "user": {"login": "runledger-bot", "id": 1, "type": "Bot"},
            "created_at": _iso(now),
            "updated_at": _iso(now),
            "author_association": "OWNER",
        }
        self.comments.append(item)
        self.issues[n]["comments"] += 1
        return self._ok(201, item, {"Location": item["url"]})

    def _add_labels(self, n: int, body: Any) -> Answer:
        gone = self._gone(n)
        if gone:
            return gone
        names = body.get("labels") if isinstance(body, dict) else body
        if not isinstance(names, list) or not names:
            return self.error(422, "Validation Failed")
        issue = self.issues[n]
        have = [label["name"] for label in issue["labels"]]
        for name in names:
            if name not in have:
                have.append(str(name))
        issue["labels"] = [self._label(x) for x in have]
        self.label_adds.append((n, [str(x) for x in names]))
        return self._ok(200, issue["labels"])

    def _page(self, req: Request, items: list[dict[str, Any]]) -> Answer:
        per_page = min(int(req.query.get("per_page", 30)), 100)
        page = int(req.query.get("page", 1))
        last = max(1, -(-len(items) // per_page))
        chunk = items[(page - 1) * per_page : page * per_page]
        links = []

        def link(p: int, rel: str) -> str:
            q = {**req.query, "page": str(p)}
            return f'<{self.url}{req.path}?{urlencode(q)}>; rel="{rel}"'

        if page < last:
            links += [link(page + 1, "next"), link(last, "last")]
        if page > 1:
            links += [link(1, "first"), link(page - 1, "prev")]
        headers = {"Link": ", ".join(links)} if links else {}
        return self._ok(200, chunk, headers)

    def _sorted(self, req: Request, items: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
        since = req.query.get("since")
        if since:
            items = [i for i in items if _parse_iso(i["updated_at"]) >= _parse_iso(since)]
        desc = req.query.get("direction", "desc") == "desc"
        sort = req.query.get("sort", "created")
        field_ = "updated_at" if sort == "updated" else "created_at"
        return sorted(items, key=lambda i: (i[field_], i[key]), reverse=desc)

    def _list_issues(self, req: Request) -> Answer:
        state = req.query.get("state", "open")
        items = [
            i
            for n, i in self.issues.items()
            if n not in self.deleted and (state == "all" or i["state"] == state)
        ]
        return self._page(req, self._sorted(req, items, "number"))

    def _list_comments(self, req: Request) -> Answer:
        items = [
            c for c in self.comments if int(c["issue_url"].rsplit("/", 1)[1]) not in self.deleted
        ]
        if "direction" not in req.query:
            req.query["direction"] = "asc"  # documented default for this endpoint
        return self._page(req, self._sorted(req, items, "id"))

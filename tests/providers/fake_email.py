"""Local stand-ins for the e-mail providers, each in a thread of the test's process.

- :class:`FakeSmtp`: an SMTP server (``aiosmtpd``) that records every message it
  accepts, per ``X-Runledger-Key`` header; switches (:meth:`FakeSmtp.fail_next`,
  :meth:`FakeSmtp.hold_next`, :meth:`FakeSmtp.drop_next`) make it refuse with a reply
  code at ``MAIL``, ``RCPT`` or the end of ``DATA``, hold its answer to the end of
  ``DATA`` (a timeout; the message accepted before, after or never), or drop the
  connection after the data.
- :class:`FakeImap`: a small IMAP4rev1 server of its own (``CAPABILITY``, ``LOGIN``,
  ``SELECT``/``EXAMINE``, ``APPEND`` with a literal, ``[UID] SEARCH`` with ``HEADER``,
  ``KEYWORD``, ``UNKEYWORD``, ``DELETED``, ``UNDELETED``, ``ALL``, ``[UID] FETCH`` of
  ``UID FLAGS INTERNALDATE``, ``[UID] STORE [+-]FLAGS[.SILENT]``, ``EXPUNGE``,
  ``NOOP``, ``LOGOUT``): enough for ``imaplib``. :meth:`FakeImap.purge` empties a
  folder (a retention policy).
- :class:`FakeResend`: the documented subset of Resend's REST API used: ``POST /emails``
  with ``Idempotency-Key`` (kept ``key_ttl`` seconds; a repeat with the same payload
  gets the original response, another payload ``409 invalid_idempotent_request``, a
  repeat while the first is in progress ``409 concurrent_idempotent_requests``) and
  ``GET /emails/{id}``; errors as ``{"statusCode", "message", "name"}``. Switches:
  :meth:`FakeResend.fail_next` (``429`` with ``Retry-After``, ``5xx``, any status),
  :meth:`FakeResend.hold_next` (a timeout: hold the answer, the e-mail sent before,
  after -- a request that lands after the client gave up -- or never).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import email
import email.policy
import hashlib
import json
import re
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session

KEY_HEADER = "X-Runledger-Key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


@dataclass
class _Hold:
    seconds: float
    land: str  # "before" | "after" | "never"
    released: threading.Event = field(default_factory=threading.Event)


# -- SMTP -----------------------------------------------------------------------------------


@dataclass
class Sent:
    """A message the SMTP server accepted."""

    key: str | None
    message_id: str | None
    mail_from: str
    rcpt_tos: list[str]
    raw: bytes


class FakeSmtp:
    """An SMTP server on 127.0.0.1 (``aiosmtpd`` in its own thread and event loop)."""

    def __init__(self, files_to: tuple[FakeImap, str] | None = None) -> None:
        # files_to: a submission server that files what it accepts in a sent folder
        self.files_to = files_to
        self.lock = threading.Lock()
        self.accepted: list[Sent] = []
        self.transactions = 0  # DATA ends seen (accepted or not)
        self._fail: list[tuple[str, int]] = []
        self._holds: list[_Hold] = []
        self._drops: list[bool] = []
        self.port = free_port()
        self.host = "127.0.0.1"
        self.controller = Controller(self, hostname=self.host, port=self.port)

    def __enter__(self) -> FakeSmtp:
        self.controller.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for hold in list(self._holds):
            hold.released.set()
        self.controller.stop()

    # switches
    def fail_next(self, stage: str, code: int, count: int = 1) -> None:
        """Answer the next ``count`` ``stage`` (``MAIL``, ``RCPT``, ``DATA``: its end)
        with ``code``."""
        with self.lock:
            self._fail += [(stage, code)] * count

    def hold_next(self, seconds: float, land: str = "before") -> _Hold:
        """Hold the answer to the next end of DATA ``seconds`` (or until released): the
        message is accepted ``before`` holding, ``after`` it (it lands after the client
        gave up), or ``never``."""
        hold = _Hold(seconds, land)
        with self.lock:
            self._holds.append(hold)
        return hold

    def drop_next(self, land: bool) -> None:
        """Close the connection instead of answering the next end of DATA; the message
        is accepted first when ``land``."""
        with self.lock:
            self._drops.append(land)

    def effects(self, key: str) -> list[Sent]:
        with self.lock:
            return [m for m in self.accepted if m.key == key]

    # aiosmtpd hooks
    def _refusal(self, stage: str) -> str | None:
        with self.lock:
            for i, (s, code) in enumerate(self._fail):
                if s == stage:
                    del self._fail[i]
                    return f"{code} {'Try again later' if code < 500 else 'Refused'} ({stage})"
        return None

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if refusal := self._refusal("MAIL"):
            return refusal
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return "250 OK"

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if refusal := self._refusal("RCPT"):
            return refusal
        envelope.rcpt_tos.append(address)
        return "250 OK"

    def _accept(self, envelope: Envelope) -> None:
        raw = envelope.original_content or b""
        msg = email.message_from_bytes(raw, policy=email.policy.SMTP)
        with self.lock:
            self.accepted.append(
                Sent(
                    key=msg.get(KEY_HEADER),
                    message_id=msg.get("Message-ID"),
                    mail_from=str(envelope.mail_from),
                    rcpt_tos=list(envelope.rcpt_tos),
                    raw=raw,
                )
            )
        if self.files_to is not None:
            imap, folder = self.files_to
            imap.file(folder, raw, {"\\Seen"})

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        with self.lock:
            self.transactions += 1
        if refusal := self._refusal("DATA"):
            return refusal
        with self.lock:
            hold = self._holds.pop(0) if self._holds else None
            drop = self._drops.pop(0) if self._drops else None
        if drop is not None:
            if drop:
                self._accept(envelope)
            transport = server.transport
            assert isinstance(transport, asyncio.Transport)
            transport.abort()
            return "250 OK"  # never reaches the client
        if hold is not None:
            if hold.land == "before":
                self._accept(envelope)

            def held() -> None:
                # a thread of its own: the server accepts even once the client is gone
                # (aiosmtpd cancels the session's handler when the connection closes)
                hold.released.wait(hold.seconds)
                if hold.land == "after":
                    self._accept(envelope)

            waiter = threading.Thread(target=held, daemon=True)
            waiter.start()
            await asyncio.get_running_loop().run_in_executor(None, waiter.join)
            if hold.land == "never":
                return "451 Timed out"
            return "250 OK: queued late"
        self._accept(envelope)
        return "250 OK: queued"


# -- IMAP -----------------------------------------------------------------------------------


@dataclass
class Stored:
    uid: int
    flags: set[str]
    internaldate: dt.datetime
    raw: bytes

    def header(self, name: str) -> str:
        msg = email.message_from_bytes(self.raw, policy=email.policy.compat32)
        return " ".join(str(v) for v in msg.get_all(name, []))


@dataclass
class Folder:
    messages: list[Stored] = field(default_factory=list)
    next_uid: int = 1
    uidvalidity: int = 1


_TOKEN = re.compile(rb'\s*(?:"((?:[^"\\]|\\.)*)"|(\()|(\))|\{(\d+)\}$|([^\s()"]+))')


def _tokens(line: bytes) -> list[Any]:
    """An IMAP command line as nested lists of str; a trailing literal as ``("{", n)``."""
    stack: list[list[Any]] = [[]]
    pos = 0
    line = line.rstrip(b"\r\n")
    while pos < len(line):
        m = _TOKEN.match(line, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
        quoted, opening, closing, literal, atom = m.groups()
        if quoted is not None:
            stack[-1].append(re.sub(rb"\\(.)", rb"\1", quoted).decode())
        elif opening:
            stack.append([])
        elif closing:
            inner = stack.pop()
            stack[-1].append(inner)
        elif literal is not None:
            stack[-1].append(("{", int(literal)))
        elif atom is not None:
            stack[-1].append(atom.decode())
    return stack[0]


def _uid_set(spec: str, uids: list[int]) -> set[int]:
    top = max(uids, default=0)
    chosen: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition(":")
        a = top if lo == "*" else int(lo)
        b = a if not hi else (top if hi == "*" else int(hi))
        chosen.update(range(min(a, b), max(a, b) + 1))
    return chosen


class FakeImap:
    """An IMAP4rev1 server on 127.0.0.1 holding folders in memory; one account."""

    def __init__(self, username: str = "agent", password: str = "secret") -> None:
        self.username, self.password = username, password
        self.lock = threading.Lock()
        self.folders: dict[str, Folder] = {"INBOX": Folder(), "Sent": Folder()}
        self.commands: list[str] = []
        self.permanent_keywords = True
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                outer._session(self.rfile, self.wfile)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.host = "127.0.0.1"
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeImap:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def copies(self, folder: str, message_id: str) -> list[Stored]:
        with self.lock:
            box = self.folders[folder]
            return [m for m in box.messages if message_id in m.header("Message-ID")]

    def file(self, folder: str, raw: bytes, flags: set[str]) -> None:
        with self.lock:
            box = self.folders[folder]
            box.messages.append(Stored(box.next_uid, set(flags), dt.datetime.now(dt.UTC), raw))
            box.next_uid += 1

    def purge(self, folder: str) -> None:
        with self.lock:
            self.folders[folder].messages.clear()

    # the protocol
    def _session(self, rfile: Any, wfile: Any) -> None:
        def send(text: str) -> None:
            wfile.write(text.encode() + b"\r\n")
            wfile.flush()

        send("* OK [CAPABILITY IMAP4rev1] fake IMAP ready")
        state = {"auth": False, "folder": None, "readonly": False}
        while True:
            line = rfile.readline()
            if not line:
                return
            parts = _tokens(line)
            if len(parts) < 2:
                send("* BAD empty command")
                continue
            tag, command, args = str(parts[0]), str(parts[1]).upper(), parts[2:]
            if args and isinstance(args[-1], tuple):  # a literal follows
                send("+ Ready for literal data")
                data = rfile.read(args[-1][1])
                rfile.readline()  # the CRLF ending the command
                args[-1] = data
            with self.lock:
                self.commands.append(command if command != "UID" else f"UID {args[0]}".upper())
            try:
                reply = self._command(command, args, state, send)
            except Exception as exc:  # a bad command is the client's fault: say so
                send(f"{tag} BAD {exc}")
                continue
            if reply is None:
                send(f"{tag} OK {command} completed")
            elif reply == "BYE":
                send("* BYE logging out")
                send(f"{tag} OK LOGOUT completed")
                return
            else:
                send(f"{tag} {reply}")

    def _command(
        self, command: str, args: list[Any], state: dict[str, Any], send: Callable[[str], None]
    ) -> str | None:
        if command == "CAPABILITY":
            send("* CAPABILITY IMAP4rev1")
            return None
        if command == "NOOP":
            return None
        if command == "LOGOUT":
            return "BYE"
        if command == "LOGIN":
            if [str(a) for a in args[:2]] != [self.username, self.password]:
                return "NO [AUTHENTICATIONFAILED] invalid credentials"
            state["auth"] = True
            return None
        if not state["auth"]:
            return "BAD log in first"
        if command in ("SELECT", "EXAMINE"):
            name = str(args[0])
            with self.lock:
                folder = self.folders.get(name)
                if folder is None:
                    return "NO [NONEXISTENT] no such folder"
                send(f"* {len(folder.messages)} EXISTS")
                send("* 0 RECENT")
                send(f"* OK [UIDVALIDITY {folder.uidvalidity}] UIDs valid")
                send(f"* OK [UIDNEXT {folder.next_uid}] next UID")
            send("* FLAGS (\\Answered \\Flagged \\Deleted \\Seen \\Draft)")
            keywords = " \\*" if self.permanent_keywords else ""
            send(f"* OK [PERMANENTFLAGS (\\Deleted \\Seen{keywords})] flags")
            state["folder"], state["readonly"] = name, command == "EXAMINE"
            return f"OK [{'READ-ONLY' if command == 'EXAMINE' else 'READ-WRITE'}] {command} done"
        if command == "APPEND":
            name = str(args[0])
            flags = args[1] if len(args) > 2 and isinstance(args[1], list) else []
            raw = args[-1]
            with self.lock:
                folder = self.folders.get(name)
                if folder is None:
                    return "NO [TRYCREATE] no such folder"
                uid = folder.next_uid
                folder.next_uid += 1
                folder.messages.append(
                    Stored(uid, {str(f) for f in flags}, dt.datetime.now(dt.UTC), bytes(raw))
                )
            return f"OK [APPENDUID {folder.uidvalidity} {uid}] APPEND completed"
        if state["folder"] is None:
            return "BAD select a folder first"
        by_uid = command == "UID"
        if by_uid:
            command, args = str(args[0]).upper(), args[1:]
        with self.lock:
            folder = self.folders[state["folder"]]
            if command == "SEARCH":
                found = [m for m in folder.messages if self._matches(m, list(args))]
                numbers = [str(m.uid if by_uid else folder.messages.index(m) + 1) for m in found]
                send("* SEARCH" + "".join(f" {n}" for n in numbers))
                return None
            if command == "FETCH":
                for seq, m in self._select(folder, str(args[0]), by_uid):
                    date = m.internaldate.strftime("%d-%b-%Y %H:%M:%S +0000")
                    shown = " ".join(sorted(m.flags))
                    send(f'* {seq} FETCH (UID {m.uid} FLAGS ({shown}) INTERNALDATE "{date}")')
                return None
            if command == "STORE":
                if state["readonly"]:
                    return "NO folder is read-only"
                op, change = str(args[1]).upper(), {str(f) for f in args[2]}
                for seq, m in self._select(folder, str(args[0]), by_uid):
                    if op.startswith("+"):
                        m.flags |= change
                    elif op.startswith("-"):
                        m.flags -= change
                    else:
                        m.flags = set(change)
                    if not op.endswith(".SILENT"):
                        send(f"* {seq} FETCH (UID {m.uid} FLAGS ({' '.join(sorted(m.flags))}))")
                return None
            if command == "EXPUNGE":
                folder.messages = [m for m in folder.messages if "\\Deleted" not in m.flags]
                return None
        return f"BAD unknown command {command}"

    @staticmethod
    def _select(folder: Folder, spec: str, by_uid: bool) -> Iterator[tuple[int, Stored]]:
        msgs = folder.messages
        if by_uid:
            wanted = _uid_set(spec, [m.uid for m in msgs])
            yield from ((i + 1, m) for i, m in enumerate(msgs) if m.uid in wanted)
        else:
            wanted = _uid_set(spec, list(range(1, len(msgs) + 1)))
            yield from ((i + 1, m) for i, m in enumerate(msgs) if i + 1 in wanted)

    @staticmethod
    def _matches(m: Stored, criteria: list[Any]) -> bool:
        while criteria:
            c = str(criteria.pop(0)).upper()
            if c == "ALL":
                continue
            if c == "HEADER":
                name, value = str(criteria.pop(0)), str(criteria.pop(0))
                if value.lower() not in m.header(name).lower():
                    return False
            elif c in ("KEYWORD", "UNKEYWORD"):
                flag = str(criteria.pop(0))
                if (flag in m.flags) != (c == "KEYWORD"):
                    return False
            elif c in ("DELETED", "UNDELETED"):
                if ("\\Deleted" in m.flags) != (c == "DELETED"):
                    return False
            else:
                raise ValueError(f"unsupported search key {c}")
        return True


# -- Resend ---------------------------------------------------------------------------------


@dataclass
class ResendEmail:
    id: str
    key: str | None
    body: dict[str, Any]
    created_at: str


@dataclass
class _Key:
    digest: str
    created: float
    response: tuple[int, dict[str, Any]] | None = None  # None: still in progress


class FakeResend:
    """Resend's ``/emails`` endpoints on 127.0.0.1 (``ThreadingHTTPServer``)."""

    def __init__(self, api_key: str = "re_test_key", key_ttl: float = 24 * 3600) -> None:
        self.api_key = api_key
        self.key_ttl = key_ttl
        self.lock = threading.Lock()
        self.emails: list[ResendEmail] = []
        self.keys: dict[str, _Key] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, key
        self._fail: list[tuple[int, str, dict[str, str]]] = []
        self._holds: list[_Hold] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                outer._post(self)

            def do_GET(self) -> None:
                outer._get(self)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeResend:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for hold in list(self._holds):
            hold.released.set()
        self.server.shutdown()
        self.server.server_close()

    # switches
    def fail_next(
        self, status: int, name: str = "", count: int = 1, retry_after: float | None = None
    ) -> None:
        """Answer the next ``count`` ``POST /emails`` with ``status`` before anything is
        sent (``429`` defaults to ``rate_limit_exceeded`` with ``Retry-After``)."""
        headers: dict[str, str] = {}
        if status == 429:
            name = name or "rate_limit_exceeded"
            headers["retry-after"] = f"{1 if retry_after is None else retry_after:g}"
            headers["ratelimit-limit"] = "2"
            headers["ratelimit-remaining"] = "0"
        with self.lock:
            self._fail += [(status, name or "application_error", headers)] * count

    def hold_next(self, seconds: float, land: str = "before") -> _Hold:
        """Hold the next ``POST /emails`` ``seconds`` (a timeout): the e-mail is sent
        ``before`` holding, ``after`` (it lands after the client gave up), or ``never``
        (then a 500). The key is in progress meanwhile."""
        hold = _Hold(seconds, land)
        with self.lock:
            self._holds.append(hold)
        return hold

    def expire_keys(self) -> None:
        """Forget every idempotency key (their 24 hours are over)."""
        with self.lock:
            self.keys.clear()

    def effects(self, key: str) -> list[ResendEmail]:
        with self.lock:
            return [e for e in self.emails if e.key == key]

    # the API
    @staticmethod
    def _reply(
        h: BaseHTTPRequestHandler,
        status: int,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(body).encode()
        with contextlib.suppress(OSError):  # the client may have given up
            h.send_response(status)
            h.send_header("Content-Type", "application/json; charset=utf-8")
            h.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data)

    def _error(
        self,
        h: BaseHTTPRequestHandler,
        status: int,
        name: str,
        message: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        body = {"statusCode": status, "message": message, "name": name}
        self._reply(h, status, body, headers)

    def _authorized(self, h: BaseHTTPRequestHandler) -> bool:
        auth = h.headers.get("Authorization", "")
        if not auth:
            self._error(h, 401, "missing_api_key", "Missing API key in the authorization header")
            return False
        if auth != f"Bearer {self.api_key}":
            self._error(h, 403, "invalid_api_key", "API key is invalid")
            return False
        return True

    def _get(self, h: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.requests.append(("GET", h.path, None))
        if not self._authorized(h):
            return
        m = re.fullmatch(r"/emails/([0-9a-f-]+)", h.path)
        with self.lock:
            found = next((e for e in self.emails if m and e.id == m.group(1)), None)
        if found is None:
            self._error(h, 404, "not_found", "Email not found")
            return
        b = found.body
        self._reply(
            h,
            200,
            {
                "object": "email",
                "id": found.id,
                "to": b.get("to"),
                "from": b.get("from"),
                "created_at": found.created_at,
                "subject": b.get("subject"),
                "html": b.get("html"),
                "text": b.get("text"),
                "bcc": b.get("bcc"),
                "cc": b.get("cc"),
                "reply_to": b.get("reply_to"),
                "last_event": "delivered",
            },
        )

    def _send(self, body: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any]]:
        email_id = str(uuid.uuid4())
        with self.lock:
            self.emails.append(
                ResendEmail(email_id, key, body, dt.datetime.now(dt.UTC).isoformat())
            )
        return 200, {"id": email_id}

    def _post(self, h: BaseHTTPRequestHandler) -> None:
        key = h.headers.get("Idempotency-Key")
        with self.lock:
            self.requests.append(("POST", h.path, key))
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        if h.path != "/emails":
            self._error(h, 404, "not_found", "The requested endpoint does not exist.")
            return
        if not self._authorized(h):
            return
        with self.lock:
            fail = self._fail.pop(0) if self._fail else None
        if fail is not None:
            status, name, headers = fail
            self._error(h, status, name, f"injected {status}", headers)
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._error(h, 422, "validation_error", "Invalid JSON")
            return
        missing = [f for f in ("from", "to", "subject") if not body.get(f)]
        if missing:
            self._error(h, 422, "missing_required_field", f"Missing `{missing[0]}` field.")
            return
        if key is not None and not 1 <= len(key) <= 256:
            self._error(h, 400, "invalid_idempotency_key", "The key must be between 1-256 chars.")
            return
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        entry: _Key | None = None
        if key is not None:
            with self.lock:
                now = time.monotonic()
                entry = self.keys.get(key)
                if entry is not None and now - entry.created > self.key_ttl:
                    entry = None
                if entry is not None:
                    if entry.digest != digest:
                        conflict = ("invalid_idempotent_request", "different request payload")
                    elif entry.response is None:
                        conflict = ("concurrent_idempotent_requests", "request still in progress")
                    else:
                        status, reply = entry.response
                        conflict = None
                else:
                    entry = self.keys[key] = _Key(digest, now)
                    conflict = ("", "")
            if conflict is None:
                self._reply(h, status, reply)
                return
            if conflict[0]:
                self._error(
                    h,
                    409,
                    conflict[0],
                    f"Same idempotency key used with a {conflict[1]}.",
                )
                return
        with self.lock:
            hold = self._holds.pop(0) if self._holds else None
        if hold is None:
            response = self._send(body, key)
        else:
            response = (500, {})
            if hold.land == "before":
                response = self._send(body, key)
            hold.released.wait(hold.seconds)
            if hold.land == "after":
                response = self._send(body, key)
        if entry is not None:
            with self.lock:
                if response[0] == 200:
                    entry.response = response
                else:
                    self.keys.pop(key or "", None)
        if response[0] == 200:
            self._reply(h, 200, response[1])
        else:
            self._error(h, 500, "application_error", "Something went wrong.")

"""E-mail tools: SMTP with a sent-folder lookup over IMAP, and the Resend HTTP API.

Two ways to send, each with the answer to "did key K go out?" after a crash
(docs/providers/email.md).

**SMTP** (:func:`smtp_emails`, standard library ``smtplib`` and ``imaplib``). SMTP does
not deduplicate: a message sent twice is two e-mails, so the tool is ``lookup`` and
never sends a key the lookup has not cleared. The message's ``Message-ID`` is derived
from the key (:func:`message_id`); the lookup is ``UID SEARCH HEADER Message-ID`` in
the sent folder. SMTP servers do not keep what they relay, so with ``filing="append"``
(the default) the tool files the copy itself, *before* sending, and moves it through
keywords as the send goes:

1. ``APPEND`` the exact message to the sent folder flagged ``$RunledgerQueued``;
2. ``STORE +FLAGS $RunledgerSending`` just before the SMTP ``DATA`` (the lease must
   still have room for the whole SMTP exchange, else nothing is sent);
3. after the server's ``250`` to the end of the data, ``STORE +FLAGS $RunledgerSent``;
   on a refusal (any 4xx or 5xx reply, or a failure before the final dot was written)
   ``-FLAGS $RunledgerSending`` and ``+FLAGS (\\Deleted $RunledgerFailed)``.

What the lookup concludes from the copies with the key's Message-ID (flags only
accumulate, so a late write cannot hide a later state):

| copies found                      | lookup                                          |
| --------------------------------- | ----------------------------------------------- |
| one flagged ``$RunledgerSent``    | the receipt (the e-mail went out)               |
| one ``$RunledgerSending``         | ``Unknowable``: the process died, or the        |
|                                   | connection dropped, between the start of DATA   |
|                                   | and filing the server's answer; only the        |
|                                   | recipients (or the relay's log) can tell        |
| queued / failed ones only, or     | ``None`` (send it again) within ``retention``;  |
| none                              | ``Unknowable`` past it (the folder may be       |
|                                   | purged)                                         |

So the crash windows of the worker (before and after dispatch, after the tool returned,
after completion) all settle without a person; only a death *inside* the DATA exchange
does not, and it is the one moment SMTP itself cannot answer. Before "none" the lookup
waits until the last send can no longer land: ``timeout`` seconds after ``ctx.sent_at``
(an ``APPEND`` or ``STORE`` still on its way). With ``filing="server"`` (a submission
server that files sent mail itself, such as Gmail's) nothing is appended; a copy found
is the receipt, and "none" waits ``timeout + filing_delay`` first.

**Resend** (:func:`resend_emails`, the ``resend`` SDK). Resend deduplicates the
``Idempotency-Key`` header for 24 hours and answers a repeat with the original
response, so sending again with the same key *is* the lookup; ``GET /emails/{id}``
needs an id the crashed call never received. A runledger lookup is handed the key, not
the call's arguments, and Resend answers a same-key request with a different payload
with 409, so the tool is registered ``idempotent``: recovery sends the same request
again with the same key. Past the window (judged by ``ctx.first_sent_at``) the tool
refuses to send again -- Resend would send a second e-mail -- and the call ends
``unknown`` with that reason.
"""

from __future__ import annotations

import datetime as dt
import email.message
import email.policy
import email.utils
import hashlib
import imaplib
import re
import smtplib
import ssl
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Literal

from runledger.flows import Flow, NotApplied, Receipt, Tool, ToolContext, Unknowable
from runledger.providers.base import KEY_FIELD, Retention, retry_after, wait_landing

__all__ = [
    "QUEUED",
    "RESEND_RETENTION",
    "SENDING",
    "SENT",
    "SENT_FOLDER_RETENTION",
    "EmailConfigError",
    "ImapMailbox",
    "SmtpServer",
    "message_id",
    "resend_emails",
    "smtp_emails",
]

# IMAP keywords of the sent copy (RFC 3501 flag-keyword atoms)
QUEUED = "$RunledgerQueued"
SENDING = "$RunledgerSending"
SENT = "$RunledgerSent"
FAILED = "$RunledgerFailed"

KEY_HEADER = "X-Runledger-Key"

# A sent folder has no documented retention: mail stays until someone (a person, a
# client's "delete after N days", a server policy) removes it. One day is a
# conservative default: a lookup normally runs minutes after the crash.
SENT_FOLDER_RETENTION = Retention(dt.timedelta(days=1), name="the sent folder")
# "We keep idempotency keys in our system for 24 hours." (resend.com, Idempotency Keys)
RESEND_RETENTION = Retention(dt.timedelta(hours=24), name="Resend's idempotency keys")

# RFC 5322 dot-atom-text, for the right side of a msg-id
_DOT_ATOM = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*")


class EmailConfigError(ValueError):
    """The e-mail tools are configured in a way that cannot work (one line says why)."""


def message_id(key: str, domain: str) -> str:
    """The ``Message-ID`` of the e-mail sent for ``key``: ``<rl.<sha256 of key>@domain>``
    (a valid RFC 5322 msg-id whatever characters the key has)."""
    if not _DOT_ATOM.fullmatch(domain):
        raise EmailConfigError(f"{domain!r} cannot be the right side of a Message-ID")
    return f"<rl.{hashlib.sha256(key.encode()).hexdigest()[:40]}@{domain}>"


# -- configuration --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SmtpServer:
    """Where to submit mail. ``security``: ``"starttls"`` (port 587), ``"ssl"`` (465) or
    ``"none"`` (a local relay or a test server)."""

    host: str
    port: int = 587
    security: Literal["starttls", "ssl", "none"] = "starttls"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    local_hostname: str | None = None
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class ImapMailbox:
    """The account whose sent folder the lookup searches (and the tool files into)."""

    host: str
    username: str
    password: str = field(repr=False)
    folder: str = "Sent"
    port: int = 993
    security: Literal["ssl", "starttls", "none"] = "ssl"
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False)


# -- IMAP -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Copy:
    uid: int
    flags: frozenset[str]

    @property
    def state(self) -> str:
        # flags only accumulate, the furthest one wins
        for state in (SENT, SENDING):
            if state in self.flags:
                return state
        return FAILED if FAILED in self.flags else QUEUED


_FETCH_UID = re.compile(rb"UID (\d+)")
_FETCH_FLAGS = re.compile(rb"FLAGS \(([^)]*)\)")


def _quote(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Imap:
    """One IMAP session on the sent folder (``imaplib``)."""

    def __init__(self, box: ImapMailbox, timeout: float, readonly: bool) -> None:
        self.box = box
        if box.security == "ssl":
            ctx = box.ssl_context or ssl.create_default_context()
            self.conn: imaplib.IMAP4 = imaplib.IMAP4_SSL(
                box.host, box.port, ssl_context=ctx, timeout=timeout
            )
        else:
            self.conn = imaplib.IMAP4(box.host, box.port, timeout=timeout)
            if box.security == "starttls":
                self.conn.starttls(box.ssl_context or ssl.create_default_context())
        try:
            self.conn.login(box.username, box.password)
        except imaplib.IMAP4.error as exc:
            self.close()
            raise _Refused(f"IMAP login to {box.host} refused: {exc}", retry=False) from exc
        typ, data = self.conn.select(_quote(box.folder), readonly=readonly)
        if typ != "OK":
            self.close()
            raise _Refused(f"IMAP folder {box.folder!r}: {_text(data)}", retry=False)
        if not readonly:
            _, permanent = self.conn.response("PERMANENTFLAGS")
            flags = b" ".join(p for p in permanent if isinstance(p, bytes))
            if permanent and permanent[0] is not None and b"\\*" not in flags:
                self.close()
                raise _Refused(
                    f"IMAP folder {box.folder!r} does not keep new keywords "
                    f"(PERMANENTFLAGS {flags.decode(errors='replace')}): use filing='server'",
                    retry=False,
                )

    def copies(self, mid: str) -> list[_Copy]:
        typ, data = self.conn.uid("SEARCH", "HEADER", "Message-ID", _quote(mid))
        _check(typ, data, "UID SEARCH")
        uids = [u for part in data if part for u in part.split()]
        if not uids:
            return []
        typ, data = self.conn.uid("FETCH", b",".join(uids).decode(), "(UID FLAGS)")
        _check(typ, data, "UID FETCH")
        copies = []
        for item in data:
            line = item[0] if isinstance(item, tuple) else item
            if not isinstance(line, bytes):
                continue
            uid, flags = _FETCH_UID.search(line), _FETCH_FLAGS.search(line)
            if uid and flags:
                names = frozenset(f.decode() for f in flags.group(1).split())
                copies.append(_Copy(int(uid.group(1)), names))
        return copies

    def append(self, message: bytes, flags: str) -> None:
        typ, data = self.conn.append(
            _quote(self.box.folder), f"(\\Seen {flags})", time.time(), message
        )
        _check(typ, data, "APPEND")

    def store(self, uids: Sequence[int], op: str, flags: str) -> None:
        if uids:
            typ, data = self.conn.uid(
                "STORE", ",".join(map(str, uids)), f"{op}FLAGS.SILENT", f"({flags})"
            )
            _check(typ, data, "UID STORE")

    def close(self) -> None:
        with suppress(Exception):
            self.conn.logout()


class _Refused(Exception):
    """Certainly nothing was sent (becomes NotApplied)."""

    def __init__(self, reason: str, retry: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry


def _text(data: Any) -> str:
    parts = [p.decode(errors="replace") if isinstance(p, bytes) else str(p) for p in data or []]
    return " ".join(parts)


def _check(typ: str, data: Any, what: str) -> None:
    if typ != "OK":
        raise imaplib.IMAP4.error(f"{what}: {typ} {_text(data)}")


# -- SMTP -----------------------------------------------------------------------------------


class SmtpAmbiguous(Exception):
    """The server may have accepted the message: the data was sent, its answer was not
    received (the connection dropped or timed out after the final dot)."""


def _data_payload(message: bytes) -> bytes:
    """The DATA body: CRLF line ends, leading dots doubled, the final ``.`` line."""
    body = re.sub(rb"\r?\n|\r", b"\r\n", message)
    body = re.sub(rb"(?m)^\.", b"..", body)
    if not body.endswith(b"\r\n"):
        body += b"\r\n"
    return body + b".\r\n"


def _refused(what: str, code: int, text: bytes | str) -> _Refused:
    said = text.decode(errors="replace") if isinstance(text, bytes) else text
    return _Refused(f"SMTP {what} refused: {code} {said}", retry=400 <= code < 500)


def _smtp_deliver(
    server: SmtpServer, timeout: float, sender: str, recipients: list[str], message: bytes
) -> tuple[int, str]:
    """One SMTP transaction. Raises :class:`_Refused` when the server certainly did not
    take the message, :class:`SmtpAmbiguous` when it may have; returns its ``250``."""
    conn: smtplib.SMTP | None = None
    try:
        try:
            if server.security == "ssl":
                conn = smtplib.SMTP_SSL(
                    server.host,
                    server.port,
                    local_hostname=server.local_hostname,
                    timeout=timeout,
                    context=server.ssl_context or ssl.create_default_context(),
                )
            else:
                conn = smtplib.SMTP(
                    server.host, server.port, local_hostname=server.local_hostname, timeout=timeout
                )
            conn.ehlo()
            if server.security == "starttls":
                conn.starttls(context=server.ssl_context or ssl.create_default_context())
                conn.ehlo()
            if server.username is not None:
                conn.login(server.username, server.password or "")
            code, text = conn.mail(sender)
            if code != 250:
                raise _refused("MAIL FROM", code, text)
            for rcpt in recipients:
                code, text = conn.rcpt(rcpt)
                if code not in (250, 251):
                    raise _refused(f"RCPT TO {rcpt}", code, text)
            code, text = conn.docmd("DATA")
            if code != 354:
                raise _refused("DATA", code, text)
            # a failure while writing leaves the final dot unwritten: nothing accepted
            conn.send(_data_payload(message))
        except smtplib.SMTPAuthenticationError as exc:
            raise _refused("AUTH", exc.smtp_code, exc.smtp_error) from exc
        except smtplib.SMTPResponseException as exc:  # e.g. a 421 greeting
            raise _refused("session", exc.smtp_code, exc.smtp_error) from exc
        except (OSError, smtplib.SMTPException) as exc:
            raise _Refused(f"SMTP connection failed before the data ended: {exc!r}", True) from exc
        try:
            code, text = conn.getreply()
        except (OSError, smtplib.SMTPException) as exc:
            raise SmtpAmbiguous(
                f"the message was sent to {server.host}:{server.port} but its answer was "
                f"not received ({exc!r}): the server may have accepted it"
            ) from exc
        if code != 250:
            raise _refused("end of DATA", code, text)
        return code, text.decode(errors="replace")
    finally:
        if conn is not None:
            with suppress(Exception):
                conn.quit()
            with suppress(Exception):
                conn.close()


def _addresses(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    return [str(v) for v in value]


# -- the SMTP tool --------------------------------------------------------------------------


def smtp_emails(
    flow: Flow,
    *,
    smtp: SmtpServer,
    sender: str,
    imap: ImapMailbox,
    filing: Literal["append", "server"] = "append",
    name: str = "send_email",
    domain: str | None = None,
    timeout: float = 10.0,
    filing_delay: float = 60.0,
    retention: Retention = SENT_FOLDER_RETENTION,
    max_attempts: int = 3,
) -> Tool[Any]:
    """Register ``name(to, subject, text, html=None, cc=None, reply_to=None)`` on ``flow``:
    an e-mail over SMTP from ``sender``, with its lookup in ``imap``'s sent folder.

    ``domain``: the right side of the Message-ID (default: ``sender``'s domain).
    ``timeout``: seconds for each SMTP and IMAP exchange; it is the landing bound too:
    the lookup concludes "not found" only once the last send is that much older (set
    it at least as long as your server takes to answer the end of DATA; RFC 5321
    allows a server 10 minutes). The lease must be longer than ``timeout``: with less of
    it left the tool sends nothing (``NotApplied(retry=True)``). ``filing="server"``:
    the submission server files sent mail in ``imap.folder`` itself (Gmail does); the
    lookup then also waits
    ``filing_delay``. ``retention``: how long copies stay in the sent folder.

    The crash windows this settles, and the one it does not, are in the module's
    docstring. A 4xx reply is ``NotApplied(retry=True)``, a 5xx ``NotApplied``; a
    connection lost after the data was written is ambiguous (``SmtpAmbiguous``) and
    the lookup then finds the copy ``$RunledgerSending``: ``Unknowable``.
    """
    if filing not in ("append", "server"):
        raise EmailConfigError(f"filing must be 'append' or 'server', not {filing!r}")
    _, from_addr = email.utils.parseaddr(sender)
    if "@" not in from_addr:
        raise EmailConfigError(f"sender {sender!r} has no address")
    right = domain or from_addr.rpartition("@")[2]
    message_id(KEY_FIELD, right)  # checks the domain now, not at the first send
    if timeout <= 0:
        raise EmailConfigError("timeout must be a positive number of seconds")
    landing = timeout if filing == "append" else timeout + filing_delay

    def build(
        ctx: ToolContext,
        to: list[str],
        subject: str,
        text: str,
        html: str | None,
        cc: list[str],
        reply_to: str | None,
    ) -> tuple[str, bytes]:
        mid = message_id(ctx.idempotency_key, right)
        msg = email.message.EmailMessage(policy=email.policy.SMTP)
        msg["From"] = sender
        msg["To"] = ", ".join(to)
        if cc:
            msg["Cc"] = ", ".join(cc)
        if reply_to:
            msg["Reply-To"] = reply_to
        msg["Subject"] = subject
        msg["Date"] = email.utils.formatdate(localtime=False)
        msg["Message-ID"] = mid
        msg[KEY_HEADER] = ctx.idempotency_key
        msg.set_content(text)
        if html is not None:
            msg.add_alternative(html, subtype="html")
        return mid, msg.as_bytes()

    def receipt(mid: str, copies: Sequence[_Copy], **more: Any) -> dict[str, Any]:
        return {
            "message_id": mid,
            "folder": imap.folder,
            "uids": [c.uid for c in copies],
            **more,
        }

    @flow.tool(safety="lookup", name=name, max_attempts=max_attempts)
    def send_email(
        ctx: ToolContext,
        to: str | list[str],
        subject: str,
        text: str,
        html: str | None = None,
        cc: str | list[str] | None = None,
        reply_to: str | None = None,
    ) -> Receipt:
        rcpt_to, rcpt_cc = _addresses(to), _addresses(cc)
        if not rcpt_to:
            raise NotApplied("no recipient")
        mid, raw = build(ctx, rcpt_to, subject, text, html, rcpt_cc, reply_to)
        recipients = [email.utils.parseaddr(a)[1] or a for a in rcpt_to + rcpt_cc]
        if filing == "server":
            return _send_only(ctx, mid, raw, recipients)
        try:
            box = _Imap(imap, timeout, readonly=False)
        except _Refused as exc:
            raise NotApplied(exc.reason, retry=exc.retry) from exc
        except (OSError, imaplib.IMAP4.error) as exc:
            raise NotApplied(f"IMAP {imap.host}: {exc!r}", retry=True) from exc
        try:
            return _file_and_send(ctx, box, mid, raw, recipients)
        finally:
            box.close()

    def _send_only(ctx: ToolContext, mid: str, raw: bytes, recipients: list[str]) -> Receipt:
        ctx.observe(asked=f"SMTP {smtp.host}:{smtp.port} DATA {mid}")
        try:
            code, said = _smtp_deliver(smtp, timeout, from_addr, recipients, raw)
        except _Refused as exc:
            ctx.observe(saw=exc.reason)
            raise NotApplied(exc.reason, retry=exc.retry) from exc
        ctx.observe(saw=f"{code} {said}", status=code)
        return Receipt({"message_id": mid}, {"message_id": mid, "smtp_reply": f"{code} {said}"})

    def _file_and_send(
        ctx: ToolContext, box: _Imap, mid: str, raw: bytes, recipients: list[str]
    ) -> Receipt:
        # Filing before sending: every message that may have gone out has a copy.
        try:
            earlier = box.copies(mid)
            if any(c.state == SENT for c in earlier):  # the lookup's own answer, seen late
                ctx.observe(asked=f"UID SEARCH HEADER Message-ID {mid}", saw="already sent")
                found = [c for c in earlier if c.state == SENT]
                return Receipt({"message_id": mid}, receipt(mid, found, found_by="send"))
            if any(c.state == SENDING for c in earlier):
                raise SmtpAmbiguous(f"a copy of {mid} is marked sending: not sending it again")
            box.store([c.uid for c in earlier], "+", "\\Deleted")  # stale queued copies
            box.append(raw, QUEUED)
            mine = [c for c in box.copies(mid) if c.state == QUEUED and "\\Deleted" not in c.flags]
        except (OSError, imaplib.IMAP4.error) as exc:
            raise NotApplied(f"IMAP filing failed, nothing sent: {exc!r}", retry=True) from exc
        uids = [c.uid for c in mine]
        ctx.observe(asked=f"APPEND {imap.folder} {mid}", saw=f"uids {uids}")
        if not uids:
            raise NotApplied(f"the copy of {mid} is not in {imap.folder} after APPEND", retry=True)
        # the lease must have room for the SMTP exchange: a holder that lost it may be
        # taken over, and its successor's lookup must see this send as "sending"
        if ctx.remaining() < timeout:
            _fail(box, uids)
            raise NotApplied(
                f"{ctx.remaining():.1f} s of lease left, less than the {timeout:g} s SMTP "
                "timeout: not sending now",
                retry=True,
            )
        try:
            box.store(uids, "+", SENDING)
        except (OSError, imaplib.IMAP4.error) as exc:
            raise NotApplied(f"IMAP STORE {SENDING} failed, nothing sent: {exc!r}", True) from exc
        ctx.observe(asked=f"SMTP {smtp.host}:{smtp.port} DATA {mid}")
        try:
            code, said = _smtp_deliver(smtp, timeout, from_addr, recipients, raw)
        except _Refused as exc:
            ctx.observe(saw=exc.reason)
            _fail(box, uids)
            raise NotApplied(exc.reason, retry=exc.retry) from exc
        except SmtpAmbiguous as exc:
            ctx.observe(saw=str(exc))
            raise
        ctx.observe(saw=f"{code} {said}", status=code)
        try:
            box.store(uids, "+", SENT)
        except (OSError, imaplib.IMAP4.error) as exc:
            # sent: say so; the copy stays "sending" and a lookup would find it unknowable
            ctx.observe(filing_failed=repr(exc))
        return Receipt(
            {"message_id": mid},
            receipt(mid, mine, smtp_reply=f"{code} {said}", recipients=recipients),
        )

    @send_email.lookup
    def find_email(ctx: ToolContext) -> dict[str, Any] | None:
        mid = message_id(ctx.idempotency_key, right)
        wait_landing(ctx, landing)
        asked = f"UID SEARCH HEADER Message-ID {mid} in {imap.folder}"
        box = _Imap(imap, timeout, readonly=True)
        try:
            copies = box.copies(mid)
        finally:
            box.close()
        states = {c.uid: c.state for c in copies}
        ctx.observe(asked=asked, saw=f"{len(copies)} copies {states}")
        if filing == "server":
            live = [c for c in copies if "\\Deleted" not in c.flags]
            if live:
                return receipt(mid, live, found_by="lookup")
            retention.not_found(ctx, asked=asked)
            return None
        sent = [c for c in copies if c.state == SENT]
        if sent:
            return receipt(mid, sent, found_by="lookup")
        sending = [c for c in copies if c.state == SENDING]
        if sending:
            raise Unknowable(
                f"{mid} was being sent when its sender stopped: the SMTP server may or may "
                "not have accepted it (ask a recipient, or the relay's log)",
                message_id=mid,
                uids=[c.uid for c in sending],
            )
        retention.not_found(ctx, asked=asked)
        return None

    return send_email


def _fail(box: _Imap, uids: list[int]) -> None:
    """Mark the copies as certainly not sent; a failure here only leaves them queued
    or sending (the lookup then says not sent, or cannot tell)."""
    with suppress(OSError, imaplib.IMAP4.error):
        box.store(uids, "-", SENDING)
        box.store(uids, "+", f"\\Deleted {FAILED}")


# -- Resend ---------------------------------------------------------------------------------


class ResendKeyExpired(Exception):
    """The key's first send is past Resend's idempotency window: sending again would be
    a second e-mail, so the tool does not (the call ends ``unknown``)."""


class ResendConflict(Exception):
    """Resend's 409: the key is in use (still in progress, or with another payload)."""


def _resend_key(key: str) -> str:
    # Resend takes keys of 1 to 256 characters
    return key if len(key) <= 256 else "rl-sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _configure_resend(api_key: str | None, api_url: str | None, timeout: float) -> Any:
    try:
        import resend
        from resend.http_client_requests import RequestsClient
    except ImportError as exc:  # pragma: no cover - the optional SDK
        raise EmailConfigError("the resend package is not installed: pip install resend") from exc
    # the SDK keeps one configuration per process, in module attributes
    for attr, value in (("api_key", api_key), ("api_url", api_url)):
        if value is None:
            continue
        current = getattr(resend, attr)
        default = "https://api.resend.com" if attr == "api_url" else None
        if current not in (None, default, value):
            raise EmailConfigError(
                f"resend.{attr} is already set to another value: the resend SDK holds one "
                "per process"
            )
        setattr(resend, attr, value)
    if not resend.api_key:
        raise EmailConfigError("no Resend API key: pass api_key= or set RESEND_API_KEY")
    if type(resend.default_http_client) is RequestsClient:
        resend.default_http_client = RequestsClient(timeout=max(1, round(timeout)))
    return resend


def resend_emails(
    flow: Flow,
    *,
    sender: str,
    api_key: str | None = None,
    api_url: str | None = None,
    name: str = "send_email",
    timeout: float = 30.0,
    retention: Retention = RESEND_RETENTION,
    max_attempts: int = 5,
) -> Tool[Any]:
    """Register ``name(to, subject, text=None, html=None, cc=None, bcc=None,
    reply_to=None)`` on ``flow``: ``POST /emails`` with ``Idempotency-Key`` = the call's
    key (hashed when longer than Resend's 256 characters) and the key in an
    ``X-Runledger-Key`` header of the e-mail.

    ``api_key``, ``api_url``: set on the ``resend`` module (the SDK keeps one of each
    per process; ``RESEND_API_KEY`` and ``RESEND_API_URL`` work too). ``timeout``:
    seconds the HTTP client waits.

    The tool is ``idempotent``: a call found in flight is sent again with the same key,
    which Resend answers with the original response for 24 hours (the module's
    docstring says why this is the lookup). A 4xx refusal is ``NotApplied``; a 429 waits
    ``Retry-After`` (within the lease) and is ``NotApplied(retry=True)``; a 409 for a
    request still in progress is retried within ``timeout``, then ambiguous; a 409 for
    another payload, a 5xx and a timeout are ambiguous (sent again, same key). Past the
    window the tool raises :class:`ResendKeyExpired` and the call ends ``unknown``.
    """
    sdk = _configure_resend(api_key, api_url, timeout)
    from resend.exceptions import ResendError

    @flow.tool(safety="idempotent", name=name, max_attempts=max_attempts)
    def send_email(
        ctx: ToolContext,
        to: str | list[str],
        subject: str,
        text: str | None = None,
        html: str | None = None,
        cc: str | list[str] | None = None,
        bcc: str | list[str] | None = None,
        reply_to: str | list[str] | None = None,
    ) -> Receipt:
        if ctx.first_sent_at is not None and retention.expired(ctx):
            age = ctx.since_first_sent() or dt.timedelta(0)
            ctx.observe(key_age_hours=round(age.total_seconds() / 3600, 3))
            raise ResendKeyExpired(
                f"key {ctx.idempotency_key} was first sent {age.total_seconds() / 3600:.1f} h "
                f"ago and Resend keeps idempotency keys 24 hours: a send now could be a "
                "second e-mail, so it is not sent; check the Resend dashboard's logs"
            )
        params: dict[str, Any] = {
            "from": sender,
            "to": _addresses(to),
            "subject": subject,
            "headers": {KEY_HEADER: ctx.idempotency_key},
        }
        for field_name, value in (
            ("text", text),
            ("html", html),
            ("cc", _addresses(cc) or None),
            ("bcc", _addresses(bcc) or None),
            ("reply_to", _addresses(reply_to) or None),
        ):
            if value is not None:
                params[field_name] = value
        key = _resend_key(ctx.idempotency_key)
        asked = f"POST {sdk.api_url}/emails Idempotency-Key {key}"
        give_up = time.monotonic() + timeout
        wait = 0.2
        while True:
            ctx.observe(asked=asked)
            try:
                sent = sdk.Emails.send(params, {"idempotency_key": key})
            except ResendError as exc:
                code = _status(exc.code)
                said = f"{code} {exc.error_type}: {exc.message}"
                ctx.observe(saw=said, status=code)
                if exc.error_type == "HttpClientError":  # no HTTP answer: a timeout, a reset
                    raise
                if code == 409 and exc.error_type == "concurrent_idempotent_requests":
                    # the first request with this key is still running: its answer comes
                    if time.monotonic() + wait < min(give_up, ctx.deadline):
                        time.sleep(wait)
                        wait = min(wait * 2, 2.0)
                        continue
                    raise ResendConflict(said) from exc
                if code == 409:  # the key was used with another payload: it took effect
                    raise ResendConflict(said) from exc
                if code == 429:
                    pause = retry_after(exc.headers or {}, default=1.0)
                    if pause < ctx.remaining():
                        time.sleep(pause)
                    raise NotApplied(f"Resend rate limit: {said}", retry=True) from exc
                if 400 <= code < 500:
                    raise NotApplied(f"Resend refused the e-mail: {said}") from exc
                raise  # 5xx: ambiguous, sent again with the same key
            email_id = str(sent["id"])
            ctx.observe(saw=f"200 id {email_id}", request_id=email_id)
            return Receipt({"id": email_id}, {"id": email_id, "idempotency_key": key})

    return send_email


def _status(code: Any) -> int:
    try:
        return int(code)
    except (TypeError, ValueError):
        return 500

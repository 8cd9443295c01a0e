"""The e-mail tools against local servers: SMTP (aiosmtpd) with the sent folder on an
IMAP server of our own, and a Resend REST subset (tests/providers/fake_email.py).

The first part calls the tools and lookups with a hand-made context (each switch, the
retention window); the second runs them through a real worker against a real
PostgreSQL (the ``db`` and ``start_worker`` fixtures of the integration suite).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from resend.exceptions import ResendError

from runledger.flows import Flow, NotApplied, Receipt, Tool, ToolCall, ToolContext, Unknowable
from runledger.providers.email import (
    FAILED,
    SENDING,
    SENT,
    EmailConfigError,
    ImapMailbox,
    ResendConflict,
    ResendKeyExpired,
    SmtpAmbiguous,
    SmtpServer,
    message_id,
    resend_emails,
    smtp_emails,
)
from tests.integration import conftest as integration
from tests.integration.conftest import Db, StartWorker
from tests.providers.fake_email import FakeImap, FakeResend, FakeSmtp, wait_until

# the integration suite's fixtures: a worker in this loop, reads of a fresh database
db = integration.db
start_worker = integration.start_worker

TIMEOUT = 2.0
SENDER = "Agent <agent@example.com>"
NOW = dt.datetime.now


def make_ctx(
    key: str, *, age: dt.timedelta | None = None, sent_ago: float = 60.0, lease: float = 300.0
) -> ToolContext:
    """A context as the worker builds it: ``age`` is the key's first send (None: never
    sent, the first attempt); the last send was ``sent_ago`` seconds ago."""
    now = NOW(dt.UTC)
    return ToolContext(
        run_id="r",
        flow="mail@1",
        turn=0,
        call_id="c0",
        tool="send_email",
        idempotency_key=key,
        fencing_token=1,
        attempt=1 if age is None else 2,
        lease_deadline=lambda: time.monotonic() + lease,
        first_sent_at=None if age is None else now - age,
        sent_at=None if age is None else now - dt.timedelta(seconds=sent_ago),
    )


def recovering(key: str, hours: float = 0.0) -> ToolContext:
    """The context of a lookup: the key first sent ``hours`` ago."""
    return make_ctx(key, age=dt.timedelta(hours=hours, seconds=60))


@pytest.fixture
def imap() -> Iterator[FakeImap]:
    with FakeImap() as server:
        yield server


@pytest.fixture
def smtp() -> Iterator[FakeSmtp]:
    with FakeSmtp() as server:
        yield server


@pytest.fixture
def resend_api() -> Iterator[FakeResend]:
    with FakeResend() as server:
        yield server


def smtp_tool(smtp: FakeSmtp, imap: FakeImap, flow: Flow | None = None, **kw: Any) -> Tool[Any]:
    return smtp_emails(
        flow or Flow("mail"),
        smtp=SmtpServer(smtp.host, smtp.port, security="none"),
        sender=SENDER,
        imap=ImapMailbox(imap.host, "agent", "secret", port=imap.port, security="none"),
        timeout=TIMEOUT,
        **kw,
    )


def send(tool: Tool[Any], ctx: ToolContext, **args: Any) -> Any:
    args = {"to": "bob@example.org", "subject": "Your ticket", "text": "Done.\n.\nBye", **args}
    return tool.fn(ctx, **args)


def lookup(tool: Tool[Any], ctx: ToolContext) -> Any:
    assert tool.lookup_fn is not None
    return tool.lookup_fn(ctx)


def flags_of(imap: FakeImap, key: str) -> list[set[str]]:
    return [m.flags for m in imap.copies("Sent", message_id(key, "example.com"))]


# -- SMTP + IMAP ----------------------------------------------------------------------------


def test_message_id_is_derived_from_the_key_and_valid() -> None:
    mid = message_id("run with spaces:0:c0", "example.com")
    assert mid == message_id("run with spaces:0:c0", "example.com")
    assert mid != message_id("run with spaces:0:c1", "example.com")
    assert mid.startswith("<rl.") and mid.endswith("@example.com>") and " " not in mid
    with pytest.raises(EmailConfigError):
        message_id("k", "not a domain")


def test_send_files_a_copy_then_sends_once(smtp: FakeSmtp, imap: FakeImap) -> None:
    tool = smtp_tool(smtp, imap)
    out = send(tool, make_ctx("k1"))
    assert isinstance(out, Receipt)
    [sent] = smtp.effects("k1")
    assert sent.message_id == message_id("k1", "example.com")
    assert sent.rcpt_tos == ["bob@example.org"] and sent.mail_from == "agent@example.com"
    assert b"\r\n.\r\nBye" in sent.raw.replace(b"\n", b"\r\n").replace(b"\r\r", b"\r")
    assert out.receipt is not None and out.receipt["smtp_reply"].startswith("250")
    # the copy in Sent went queued -> sending -> sent
    [flags] = flags_of(imap, "k1")
    assert SENT in flags and "$RunledgerQueued" in flags
    # the APPEND came before the SMTP transaction: the order of the IMAP commands
    assert imap.commands.index("APPEND") < imap.commands.index("UID STORE")


def test_lookup_finds_a_sent_message(smtp: FakeSmtp, imap: FakeImap) -> None:
    tool = smtp_tool(smtp, imap)
    send(tool, make_ctx("k2"))
    ctx = recovering("k2")
    found = lookup(tool, ctx)
    assert found is not None and found["found_by"] == "lookup"
    assert found["message_id"] == message_id("k2", "example.com")
    assert "EXAMINE" in imap.commands  # the lookup opens the folder read-only
    assert ctx.observed and "UID SEARCH HEADER Message-ID" in ctx.observed[0]["asked"]


def test_lookup_within_the_window_finds_nothing(smtp: FakeSmtp, imap: FakeImap) -> None:
    tool = smtp_tool(smtp, imap)
    assert lookup(tool, recovering("never-sent")) is None


def test_lookup_past_the_window_cannot_tell(smtp: FakeSmtp, imap: FakeImap) -> None:
    tool = smtp_tool(smtp, imap)
    send(tool, make_ctx("k3"))
    imap.purge("Sent")  # the folder's retention removed it
    with pytest.raises(Unknowable) as err:
        lookup(tool, recovering("k3", hours=25))
    assert err.value.facts["window_hours"] == 24
    # the copy's presence is an answer at any age
    send(tool, make_ctx("k3b"))
    assert lookup(tool, recovering("k3b", hours=25)) is not None


def test_lookup_waits_for_a_send_that_may_still_land(smtp: FakeSmtp, imap: FakeImap) -> None:
    tool = smtp_tool(smtp, imap)
    ctx = make_ctx("k4", age=dt.timedelta(seconds=1), sent_ago=0.5)
    assert lookup(tool, ctx) is None
    [waited] = [o for o in ctx.observed if "waited_for_landing_s" in o]
    assert 0 < waited["waited_for_landing_s"] <= TIMEOUT


@pytest.mark.parametrize("stage", ["MAIL", "RCPT", "DATA"])
def test_a_4xx_reply_is_not_applied_and_retried(smtp: FakeSmtp, imap: FakeImap, stage: str) -> None:
    tool = smtp_tool(smtp, imap)
    smtp.fail_next(stage, 451)
    with pytest.raises(NotApplied) as err:
        send(tool, make_ctx("k5"))
    assert err.value.retry is True and "451" in err.value.reason
    assert smtp.effects("k5") == []
    [flags] = flags_of(imap, "k5")
    assert FAILED in flags and "\\Deleted" in flags and SENDING not in flags
    assert lookup(tool, recovering("k5")) is None
    # sent again with the same key: one e-mail, the stale copy stays deleted
    send(tool, make_ctx("k5", age=dt.timedelta(seconds=5)))
    assert len(smtp.effects("k5")) == 1
    assert lookup(tool, recovering("k5")) is not None


def test_a_5xx_reply_is_not_applied_for_good(smtp: FakeSmtp, imap: FakeImap) -> None:
    tool = smtp_tool(smtp, imap)
    smtp.fail_next("DATA", 554)
    with pytest.raises(NotApplied) as err:
        send(tool, make_ctx("k6"))
    assert err.value.retry is False and "554" in err.value.reason
    assert smtp.effects("k6") == [] and smtp.transactions == 1


def test_no_server_is_not_applied(imap: FakeImap) -> None:
    with FakeSmtp() as gone:
        pass  # stopped: nothing listens on its port
    tool = smtp_tool(gone, imap)
    with pytest.raises(NotApplied) as err:
        send(tool, make_ctx("k7"))
    assert err.value.retry is True


@pytest.mark.parametrize("land", ["before", "after"])
def test_a_timeout_after_the_data_is_ambiguous_and_never_resent(
    smtp: FakeSmtp, imap: FakeImap, land: str
) -> None:
    """The server holds its answer to the end of DATA past the client's timeout; it
    accepts the message before holding, or after the client gave up (late landing)."""
    tool = smtp_tool(smtp, imap)
    hold = smtp.hold_next(30, land=land)
    with pytest.raises(SmtpAmbiguous):
        send(tool, make_ctx(f"k8{land}"))
    hold.released.set()
    wait_until(lambda: len(smtp.effects(f"k8{land}")) == 1, what="the late message")
    with pytest.raises(Unknowable) as err:
        lookup(tool, recovering(f"k8{land}"))
    assert "being sent" in err.value.reason
    # the tool itself refuses a second send of a message marked sending
    with pytest.raises(SmtpAmbiguous):
        send(tool, make_ctx(f"k8{land}", age=dt.timedelta(seconds=5)))
    assert len(smtp.effects(f"k8{land}")) == 1 and smtp.transactions == 1


@pytest.mark.parametrize("land", [True, False])
def test_a_connection_dropped_after_the_data_is_ambiguous(
    smtp: FakeSmtp, imap: FakeImap, land: bool
) -> None:
    tool = smtp_tool(smtp, imap)
    smtp.drop_next(land)
    with pytest.raises(SmtpAmbiguous):
        send(tool, make_ctx("k9"))
    assert len(smtp.effects("k9")) == int(land)
    with pytest.raises(Unknowable):  # whether or not it landed: SMTP cannot tell
        lookup(tool, recovering("k9"))


def test_a_send_found_sent_is_not_sent_again(smtp: FakeSmtp, imap: FakeImap) -> None:
    tool = smtp_tool(smtp, imap)
    send(tool, make_ctx("k10"))
    again = send(tool, make_ctx("k10", age=dt.timedelta(seconds=5)))
    assert again.receipt["found_by"] == "send"
    assert len(smtp.effects("k10")) == 1


def test_too_little_lease_sends_nothing(smtp: FakeSmtp, imap: FakeImap) -> None:
    tool = smtp_tool(smtp, imap)
    with pytest.raises(NotApplied) as err:
        send(tool, make_ctx("k11", lease=TIMEOUT / 2))
    assert err.value.retry is True and smtp.transactions == 0
    assert lookup(tool, recovering("k11")) is None


def test_a_folder_without_keywords_or_a_wrong_login_is_refused(
    smtp: FakeSmtp, imap: FakeImap
) -> None:
    imap.permanent_keywords = False
    with pytest.raises(NotApplied) as err:
        send(smtp_tool(smtp, imap), make_ctx("k12"))
    assert err.value.retry is False and "filing='server'" in err.value.reason
    imap.permanent_keywords = True
    wrong = smtp_emails(
        Flow("mail"),
        smtp=SmtpServer(smtp.host, smtp.port, security="none"),
        sender=SENDER,
        imap=ImapMailbox(imap.host, "agent", "wrong", port=imap.port, security="none"),
        timeout=TIMEOUT,
    )
    with pytest.raises(NotApplied) as err:
        send(wrong, make_ctx("k12"))
    assert err.value.retry is False and "login" in err.value.reason
    assert smtp.transactions == 0
    with pytest.raises(EmailConfigError):
        smtp_emails(
            Flow("m"), smtp=SmtpServer("h"), sender="nobody", imap=ImapMailbox("h", "u", "p")
        )


def test_a_server_that_files_sent_mail_itself(imap: FakeImap) -> None:
    with FakeSmtp(files_to=(imap, "Sent")) as gmailish:
        tool = smtp_tool(gmailish, imap, filing="server", filing_delay=0.5)
        send(tool, make_ctx("k13"))
        assert "APPEND" not in imap.commands
        assert lookup(tool, recovering("k13")) is not None
        assert lookup(tool, recovering("k13-other")) is None
        assert len(gmailish.effects("k13")) == 1


# -- Resend ---------------------------------------------------------------------------------


def resend_tool(api: FakeResend, timeout: float = TIMEOUT, **kw: Any) -> Tool[Any]:
    return resend_emails(
        Flow("mail"),
        sender="Agent <agent@example.com>",
        api_key=api.api_key,
        api_url=api.url,
        timeout=timeout,
        **kw,
    )


@pytest.fixture(autouse=True)
def _resend_module_state() -> Iterator[None]:
    """The resend SDK keeps its configuration in module attributes: each test its own."""
    import resend

    saved = (resend.api_key, resend.api_url, resend.default_http_client)
    yield
    resend.api_key, resend.api_url, resend.default_http_client = saved


def test_resend_sends_with_the_key_and_a_repeat_is_the_original(resend_api: FakeResend) -> None:
    tool = resend_tool(resend_api)
    first = send(tool, make_ctx("r1"))
    assert [k for m, _, k in resend_api.requests if m == "POST"] == ["r1"]
    [mail] = resend_api.effects("r1")
    assert mail.body["headers"] == {"X-Runledger-Key": "r1"} and first.result == {"id": mail.id}
    # recovery sends the same request with the same key: Resend answers the original
    again = send(tool, make_ctx("r1", age=dt.timedelta(minutes=5)))
    assert again.result == first.result and len(resend_api.effects("r1")) == 1


def test_resend_a_key_that_never_arrived_is_sent_once(resend_api: FakeResend) -> None:
    tool = resend_tool(resend_api)
    send(tool, make_ctx("r2", age=dt.timedelta(hours=2)))  # recovery of a lost dispatch
    assert len(resend_api.effects("r2")) == 1


def test_resend_past_the_window_is_not_sent(resend_api: FakeResend) -> None:
    tool = resend_tool(resend_api)
    ctx = make_ctx("r3", age=dt.timedelta(hours=25))
    with pytest.raises(ResendKeyExpired, match="24 hours"):
        send(tool, ctx)
    assert resend_api.requests == [] and ctx.observed[0]["key_age_hours"] > 24


def test_resend_409_for_another_payload_is_ambiguous(resend_api: FakeResend) -> None:
    tool = resend_tool(resend_api)
    send(tool, make_ctx("r4"))
    with pytest.raises(ResendConflict, match="invalid_idempotent_request"):
        send(tool, make_ctx("r4", age=dt.timedelta(minutes=1)), subject="changed")
    assert len(resend_api.effects("r4")) == 1


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_resend_409_in_progress_waits_for_the_original(resend_api: FakeResend) -> None:
    tool = resend_tool(resend_api, timeout=10)
    hold = resend_api.hold_next(30, land="before")
    first, out = in_thread(lambda: send(tool, make_ctx("r5")))
    wait_until(lambda: resend_api.effects("r5"), what="the first request in progress")
    second, out2 = in_thread(lambda: send(tool, make_ctx("r5", age=dt.timedelta(seconds=1))))
    wait_until(lambda: len(resend_api.requests) >= 3, what="a 409 and a retry")
    hold.released.set()
    first.join(15)
    second.join(15)
    assert isinstance(out[0], Receipt) and isinstance(out2[0], Receipt)
    assert out2[0].result == out[0].result and len(resend_api.effects("r5")) == 1


def test_resend_429_waits_then_is_not_applied(resend_api: FakeResend) -> None:
    tool = resend_tool(resend_api)
    resend_api.fail_next(429, retry_after=0.3)
    started = time.monotonic()
    with pytest.raises(NotApplied) as err:
        send(tool, make_ctx("r6"))
    assert err.value.retry is True and "rate_limit_exceeded" in err.value.reason
    assert time.monotonic() - started >= 0.3  # it waited what Retry-After asked
    assert resend_api.effects("r6") == []
    send(tool, make_ctx("r6", age=dt.timedelta(seconds=1)))
    assert len(resend_api.effects("r6")) == 1


def test_resend_4xx_is_not_applied(resend_api: FakeResend) -> None:
    tool = resend_tool(resend_api)
    with pytest.raises(NotApplied) as err:
        send(tool, make_ctx("r7"), to=[])
    assert err.value.retry is False and "422" in err.value.reason


def test_resend_5xx_is_ambiguous_and_a_repeat_sends_once(resend_api: FakeResend) -> None:
    tool = resend_tool(resend_api)
    resend_api.fail_next(500)
    with pytest.raises(ResendError):
        send(tool, make_ctx("r8"))
    send(tool, make_ctx("r8", age=dt.timedelta(seconds=1)))
    assert len(resend_api.effects("r8")) == 1


@pytest.mark.parametrize("land", ["before", "after"])
def test_resend_timeout_and_late_landing_end_with_one_email(
    resend_api: FakeResend, land: str
) -> None:
    tool = resend_tool(resend_api, timeout=1)
    hold = resend_api.hold_next(3, land=land)
    with pytest.raises(ResendError) as err:
        send(tool, make_ctx(f"r9{land}"))
    assert err.value.error_type == "HttpClientError"  # no answer: ambiguous
    # sent again at once: in progress (409), waited for, then the original answer
    again_tool = resend_tool(resend_api, timeout=10)
    again = send(again_tool, make_ctx(f"r9{land}", age=dt.timedelta(seconds=2)))
    hold.released.set()
    [mail] = resend_api.effects(f"r9{land}")
    assert again.result == {"id": mail.id}


def test_resend_configuration_errors(resend_api: FakeResend) -> None:
    import resend

    resend.api_key = None
    with pytest.raises(EmailConfigError, match="no Resend API key"):
        resend_emails(Flow("m"), sender="a@example.com", api_url=resend_api.url)
    resend.api_key = "re_other"
    with pytest.raises(EmailConfigError, match="one per process"):
        resend_emails(Flow("m"), sender="a@example.com", api_key="re_mine")


# -- through a worker and PostgreSQL --------------------------------------------------------


def one_call_flow(name: str, tool_name: str, args: dict[str, Any]) -> Flow:
    flow = Flow(name)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall(tool_name, args)]

    return flow


ARGS = {"to": "bob@example.org", "subject": "Hello", "text": "Hi"}


async def test_worker_sends_once_over_smtp_after_a_transient_refusal(
    db: Db, start_worker: StartWorker, smtp: FakeSmtp, imap: FakeImap
) -> None:
    flow = one_call_flow("mail-smtp", "send_email", ARGS)
    smtp_tool(smtp, imap, flow=flow)
    smtp.fail_next("RCPT", 450)
    await db.submit("m1", flow)
    await start_worker(flow)
    run = await db.wait_status("m1", "succeeded", "paused", "failed")
    assert run["status"] == "succeeded"
    [call] = await db.calls("m1")
    assert call["attempts"] == 2 and call["receipt"]["message_id"].startswith("<rl.")
    assert len(smtp.effects("m1:0:c0")) == 1


async def test_worker_pauses_an_smtp_send_dropped_after_the_data(
    db: Db, start_worker: StartWorker, smtp: FakeSmtp, imap: FakeImap
) -> None:
    flow = one_call_flow("mail-drop", "send_email", ARGS)
    smtp_tool(smtp, imap, flow=flow)
    smtp.drop_next(land=True)
    await db.submit("m2", flow)
    await start_worker(flow)
    run = await db.wait_status("m2", "paused", "succeeded", "failed")
    assert run["status"] == "paused"
    [call] = await db.calls("m2")
    assert call["status"] == "unknown" and "being sent" in call["error"]["reason"]
    steps = [s["step"] for s in call["error"]["evidence"]]
    assert steps == ["send", "lookup"]  # one send, one lookup: never sent twice
    assert len(smtp.effects("m2:0:c0")) == 1


async def test_worker_settles_a_late_landing_resend_call_with_one_email(
    db: Db, start_worker: StartWorker, resend_api: FakeResend
) -> None:
    flow = one_call_flow("mail-resend", "send_email", ARGS)
    resend_emails(
        flow, sender=SENDER, api_key=resend_api.api_key, api_url=resend_api.url, timeout=1
    )
    resend_api.hold_next(2.5, land="after")
    await db.submit("m3", flow)
    await start_worker(flow)
    run = await db.wait_status("m3", "succeeded", "paused", "failed", timeout=30)
    assert run["status"] == "succeeded"
    [call] = await db.calls("m3")
    [mail] = resend_api.effects("m3:0:c0")
    assert call["receipt"]["id"] == mail.id and call["attempts"] >= 2

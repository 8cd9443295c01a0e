"""The console end to end, in a real headless Chromium (Debian's ``chromium``, driven by
Playwright; scripts/test installs it): a run is paused on an ``unknown`` call; an operator
opens the console (``runledger console`` as a process, reading as runledger_auditor,
acting as runledger_operator), signs in, finds the call in the inbox, resolves it as
applied with a receipt, and watches the run finish on its page through the live update
(no reload). The event and the call then carry the operator's name, in SQL.

No Chromium is a failure, never a skip. ``RUNLEDGER_CONSOLE_SCREENSHOT=docs/console-run.png``
also writes the run page's screenshot there (the README's).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import async_playwright, expect

from runledger.flows import Decision, Flow, ToolCall
from tests.integration.conftest import Db, StartWorker

pytestmark = pytest.mark.timeout(150)
expect.set_options(timeout=20_000)  # a loaded 2-core machine: each wait is on a condition

CHROMIUM = os.environ.get("RUNLEDGER_TEST_CHROMIUM", "/usr/bin/chromium")
TOKEN = "console-test-token-0123456789"
RUN = "pay-77"
KEY = f"{RUN}:0:c0"


def as_role(url: str, role: str) -> str:
    """The URL of a session that takes ``role`` at its start (libpq ``options``)."""
    return url + ("&" if "?" in url else "?") + f"options=-crole%3D{role}"


def payments_flow() -> Flow:
    flow = Flow("payments", "1")

    @flow.tool(safety="unsafe")
    def charge(ctx: Any, amount: int, card: str) -> dict[str, Any]:
        # the card network never answers the first attempt: unsafe, so the call is
        # unknown and the run pauses for a person
        raise ConnectionResetError("no answer from the card network")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> Decision:
        if not history:
            return Decision(
                calls=[ToolCall("charge", {"amount": 42, "card": "4242-xxxx"})],
                record={"role": "assistant", "content": "charging the card"},
            )
        charged = history[-1].calls[0].result
        return Decision(
            calls=[], record={"role": "assistant", "content": "done"}, output={"charged": charged}
        )

    return flow


class ConsoleProcess:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runledger", "console", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = re.match(r"runledger console: (http://\S+?)/ ", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def wait_url(self, timeout: float = 30.0) -> str:
        self._ready.wait(timeout)
        assert self.url is not None, f"the console did not start: {self.lines}"
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def console_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLEDGER_")}
    env["RUNLEDGER_CONSOLE_TOKEN"] = TOKEN
    return env


@pytest.fixture
def console_process(database_url: str, console_env: dict[str, str]) -> Iterator[ConsoleProcess]:
    process = ConsoleProcess(
        [
            "--database-url",
            as_role(database_url, "runledger_auditor"),
            "--operator-url",
            as_role(database_url, "runledger_operator"),
            "--allow-actions",
            "--port",
            "0",
        ],
        console_env,
    )
    try:
        yield process
    finally:
        process.stop()


async def test_resolve_an_unknown_call_and_watch_the_run_finish(
    db: Db, start_worker: StartWorker, console_process: ConsoleProcess, tmp_path: Path
) -> None:
    assert os.path.exists(CHROMIUM), (
        f"no Chromium at {CHROMIUM}: apt-get install chromium (scripts/test does), or set "
        "RUNLEDGER_TEST_CHROMIUM"
    )
    flow = payments_flow()
    worker = await start_worker(flow, worker_id="worker-a")
    await db.submit(RUN, flow, {"order": 77})
    await db.wait_status(RUN, "paused")
    await worker.stop()
    assert [c["status"] for c in await db.calls(RUN)] == ["unknown"]
    base = console_process.wait_url()

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox"]
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))

            # the console asks for a name and the token first
            await page.goto(base + "/inbox")
            assert "/login" in page.url
            await page.fill("input[name=name]", "alice")
            await page.fill("input[name=token]", TOKEN)
            await page.click("form.login button[type=submit]")
            await page.wait_for_url(re.compile(r"/inbox$"))

            # the inbox lists the unknown call; its button leads to the call on the run page
            row = page.locator("tr.waiting", has_text=KEY)
            await expect(row).to_contain_text("unknown")
            await expect(row).to_contain_text("charge")
            await row.get_by_role("link", name="Resolve").click()
            await page.wait_for_url(re.compile(rf"/runs/{RUN}#call-"))
            await expect(page.locator("#run-status")).to_have_text("paused")

            form = page.locator("form.resolve")
            await form.locator("select[name=resolution]").select_option("applied")
            await form.locator("input[name=receipt]").fill('{"charge_id": "ch_3PqL"}')
            await form.locator("input[name=note]").fill("seen in the card network's dashboard")
            await form.get_by_role("button", name="Resolve").click()
            await page.wait_for_url(re.compile(rf"/runs/{RUN}$"))
            await expect(page.locator(".flash.ok")).to_contain_text(
                f"{KEY} resolved as applied by console:alice"
            )
            # no worker runs the flow: the run waits, queued, with the call settled
            await expect(page.locator("#run-status")).to_have_text("queued")
            await expect(page.locator("body")).to_have_attribute("data-live", "on")

            # a worker comes up and finishes the run; the page follows without a reload
            await page.evaluate("window.__same_page = true")
            await start_worker(flow, worker_id="worker-b")
            await expect(page.locator("#run-status")).to_have_text("succeeded", timeout=40_000)
            assert await page.evaluate("window.__same_page") is True
            assert int(await page.locator("body").get_attribute("data-refreshes") or 0) >= 1
            call = page.locator("tr.call", has_text=KEY)
            await expect(call).to_contain_text("succeeded")
            await expect(call).to_contain_text("resolved by console:alice")
            await expect(call).to_contain_text('"charge_id": "ch_3PqL"')
            timeline = page.locator("tr.event")
            await expect(timeline.filter(has_text="call_resolved")).to_contain_text("console:alice")
            await expect(page.locator("tr.event[data-kind=run_succeeded]")).to_contain_text(
                "worker-b"
            )

            shot = tmp_path / "console-run.png"
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            wanted = os.environ.get("RUNLEDGER_CONSOLE_SCREENSHOT")
            if wanted:
                shutil.copyfile(shot, wanted)
            assert errors == []
        finally:
            await browser.close()

    # in SQL: the event and the call name the operator; the run finished with the receipt
    resolved = await db.events(RUN, "call_resolved")
    assert [
        (e["actor"], e["detail"]["resolution"], e["detail"]["idempotency_key"]) for e in resolved
    ] == [("console:alice", "applied", KEY)]
    assert resolved[0]["detail"]["note"] == "seen in the card network's dashboard"
    (call_row,) = await db.calls(RUN)
    assert (call_row["status"], call_row["resolved_by"], call_row["receipt"]) == (
        "succeeded",
        "console:alice",
        {"charge_id": "ch_3PqL"},
    )
    run = await db.run(RUN)
    assert run["status"] == "succeeded"
    assert run["result"] == {"charged": {"charge_id": "ch_3PqL"}}
    kinds = await db.kinds(RUN)
    assert kinds.index("call_resolved") < kinds.index("run_succeeded")

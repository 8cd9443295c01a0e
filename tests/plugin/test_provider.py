"""The gated fake provider that users hold calls in flight with (in-process server, no DB)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from runledger.testing import ProviderClient, ProviderError, make_server


@pytest.fixture
def client() -> Iterator[ProviderClient]:
    server = make_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ProviderClient(f"http://127.0.0.1:{server.server_address[1]}", timeout=30)
    finally:
        server.shutdown()
        server.server_close()


def test_gate_holds_the_answer_until_opened(client: ProviderClient) -> None:
    answers: list[dict[str, Any]] = []
    caller = threading.Thread(
        target=lambda: answers.append(client.apply("k1", "refund", {"n": 1}, 3, gate="g 1/x"))
    )
    caller.start()
    assert client.wait_for_held("g 1/x", timeout=10) == 1
    assert client.gate("g 1/x") == {"gate": "g 1/x", "open": False, "held": 1}
    assert [e["key"] for e in client.effects("k1")] == ["k1"]  # applied, answer held
    assert answers == []
    client.open_gate("g 1/x")
    caller.join(timeout=10)
    assert not caller.is_alive()
    assert answers[0]["effect_id"] == 1 and answers[0]["duplicate"] is False
    assert client.held("g 1/x") == 0
    # an opened gate stays open: the retry of the same key passes and is deduplicated
    again = client.apply("k1", "refund", {"n": 1}, 4, gate="g 1/x")
    assert again["duplicate"] is True
    assert len(client.effects("k1")) == 1
    assert client.effects("other") == []


def test_wait_for_held_fails_with_a_deadline(client: ProviderClient) -> None:
    with pytest.raises(AssertionError, match="held at gate 'g9'"):
        client.wait_for_held("g9", timeout=0.2)


def test_from_env(monkeypatch: pytest.MonkeyPatch, client: ProviderClient) -> None:
    monkeypatch.delenv("RUNLEDGER_PROVIDER_URL", raising=False)
    with pytest.raises(RuntimeError, match="RUNLEDGER_PROVIDER_URL is not set"):
        ProviderClient.from_env()
    monkeypatch.setenv("RUNLEDGER_PROVIDER_URL", client.url)
    assert ProviderClient.from_env().health()["ok"] is True


def test_injected_failure_after_apply_is_an_error_with_the_effect(
    client: ProviderClient,
) -> None:
    client.configure(fail_after_apply=1)
    with pytest.raises(ProviderError) as info:
        client.apply("k2", "ticket", {}, 1)
    assert info.value.status == 500
    assert client.find("k2") is not None


def test_demo_provider_is_a_re_export() -> None:
    from runledger.demo import provider as old
    from runledger.testing import provider as new

    assert old.ProviderClient is new.ProviderClient
    assert old.FakeProvider is new.FakeProvider


@pytest.mark.parametrize("module", ["runledger.testing.provider", "runledger.demo.provider"])
def test_runs_as_a_module_without_warnings(module: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", "-m", module, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("provider listening on http://127.0.0.1:"), (
            line,
            proc.stderr.read() if proc.poll() is not None and proc.stderr else "",
        )
        client = ProviderClient(line.rsplit(" ", 1)[1].strip(), timeout=10)
        assert client.health()["ok"] is True
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

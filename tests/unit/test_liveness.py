"""Whether a worker's process is certainly gone, as a peer on the same host sees it: only
a process of this boot and PID namespace that no longer runs counts; anything that
cannot be told from here is never taken for a dead process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runledger.worker import liveness
from runledger.worker.liveness import process_gone, process_identity

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="process identities are read from /proc"
)


def test_this_process_is_named_and_alive() -> None:
    me = process_identity()
    assert me is not None
    prefix, boot, namespace, pid, start = me.split("/")
    assert prefix == "linux" and boot and namespace.startswith("pid:[") and start.isdigit()
    assert int(pid) == os.getpid()
    assert process_gone(me) is False


def test_an_exited_process_is_gone() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    identity = process_identity(child.pid)
    assert identity is not None and process_gone(identity) is False
    assert child.stdin is not None
    child.stdin.close()
    child.wait(timeout=30)  # reaped: no such pid any more (until it is reused)
    assert process_gone(identity) is True


def test_a_zombie_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = process_identity(child.pid)
    assert identity is not None
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        assert process_gone(identity) is True
    finally:
        child.wait()


def test_another_process_under_the_same_pid_is_not_the_one_registered() -> None:
    me = process_identity()
    assert me is not None
    *head, start = me.split("/")
    assert process_gone("/".join([*head, str(int(start) + 1)])) is True


@pytest.mark.parametrize(
    "identity",
    [
        None,
        "",
        "garbage",
        "linux/other-boot/pid:[1]/1/1",  # another host (or reboot): nothing to tell
        "windows/a/b/1/1",
        "linux/{boot}/pid:[0]/999999999/1",  # another PID namespace
        "linux/{boot}/{ns}/notapid/1",
    ],
)
def test_what_cannot_be_told_from_here_is_never_gone(identity: str | None) -> None:
    host = liveness._host()
    assert host is not None
    if identity is not None:
        identity = identity.format(boot=host[0], ns=host[1])
    assert process_gone(identity) is False

"""Network namespaces for partition tests: a worker behind a veth pair whose link a test
cuts and restores (``ip netns``, root). Everything made here is removed on exit, also
when the test fails; where namespaces cannot be made, the test is skipped, saying so."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from runledger.testing import WorkerPool

_serial = itertools.count()


def _ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True, slots=True)
class Namespace:
    """``name``: the namespace; the worker's side of the link has ``worker_addr``, the
    host's ``host_addr`` (a private /30 that only this veth pair carries)."""

    name: str
    host_if: str
    ns_if: str
    host_addr: str
    worker_addr: str

    def cut(self) -> None:
        """The link goes down on the worker's side: nothing passes either way, and
        neither end is told (no reset): packets are dropped."""
        _ip("link", "set", self.ns_if, "down", ns=self.name)

    def heal(self) -> None:
        _ip("link", "set", self.ns_if, "up", ns=self.name)


def _free_subnet() -> tuple[str, str]:
    """A /30 of 10.213.0.0/16 that no interface of this machine has: (host, worker)."""
    used = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=False
    ).stdout
    start = os.getpid() * 7 + next(_serial)
    for n in range(16384):
        b = (start + n) % 16384
        prefix = f"10.213.{b // 64}.{(b % 64) * 4}"
        host, worker = prefix[: prefix.rfind(".") + 1], (b % 64) * 4
        pair = f"{host}{worker + 1}", f"{host}{worker + 2}"
        if all(f" {addr}/" not in used for addr in pair):
            return pair
    raise RuntimeError("no free /30 in 10.213.0.0/16 for a veth pair")


@contextlib.contextmanager
def namespace() -> Iterator[Namespace]:
    """A namespace with a veth pair to the host, up; removed on exit. Skips the test
    (with the reason) where the machine cannot make one (not root, no ``ip``)."""
    tag = f"{os.getpid() % 100000}{next(_serial)}"
    name, host_if, ns_if = f"rl-part-{tag}", f"rlh{tag}", f"rlw{tag}"
    made: list[list[str]] = []
    try:
        _ip("netns", "add", name)
        made.append(["netns", "del", name])
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        made.append(["link", "del", host_if])
    except (OSError, subprocess.SubprocessError) as exc:
        for undo in reversed(made):
            with contextlib.suppress(Exception):
                _ip(*undo)
        said = getattr(exc, "stderr", None) or str(exc)
        pytest.skip(
            f"network namespaces cannot be created here ({str(said).strip()}): the "
            "partition tests need root and `ip netns`"
        )
    try:
        host_addr, worker_addr = _free_subnet()
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("addr", "add", f"{worker_addr}/30", "dev", ns_if, ns=name)
        _ip("link", "set", ns_if, "up", ns=name)
        _ip("link", "set", "lo", "up", ns=name)
        yield Namespace(name, host_if, ns_if, host_addr, worker_addr)
    finally:
        for undo in reversed(made):
            with contextlib.suppress(Exception):
                _ip(*undo)


class NamespacedPool(WorkerPool):
    """Workers started with ``ip netns exec NS python -m runledger worker ...`` (the
    same process: ``ip`` execs the command), with ids ``<prefix><i>``."""

    def __init__(self, *args: Any, netns: str, id_prefix: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.netns = netns
        self.id_prefix = id_prefix

    def worker_id(self, i: int) -> str:
        return f"{self.id_prefix}{i}"

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        cmd: Sequence[str] = [
            "ip",
            "netns",
            "exec",
            self.netns,
            sys.executable,
            "-m",
            "runledger",
            "worker",
            "--worker-id",
            self.worker_id(i),
        ]
        for spec in self.flows:
            cmd = [*cmd, "--flows", spec]
        cmd = [*cmd, *self.args, *self.extra_args[i]]
        env = {
            **os.environ,
            **self.env,
            **self.extra_env[i],
            "RUNLEDGER_DATABASE_URL": self.database_url,
            "PYTHONUNBUFFERED": "1",
            "RUNLEDGER_TESTING": "1",
        }
        log = self.logs[i].open("ab")
        try:
            return subprocess.Popen(
                list(cmd), env=env, stdout=log, stderr=log, cwd=self.cwd, start_new_session=True
            )
        finally:
            log.close()

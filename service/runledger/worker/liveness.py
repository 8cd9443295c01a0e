"""Whether another worker's process is certainly gone, as a peer on the same host sees it.

A worker registers its process as its host names it (:func:`process_identity`, stored as
``workers.process``): the kernel's boot id, the PID namespace, the pid and the process's
start time. A peer that finds the same boot id and the same PID namespace as its own can
look the process up in ``/proc``: no such pid, another process under that pid (another
start time) or a zombie (it has exited; only its parent has not reaped it yet) means the
process is gone, its threads with it, and nothing of it can still be sending a request.

Anything else proves nothing, and :func:`process_gone` says False: another host, another
container's PID namespace, a process registered without an identity, no ``/proc``. The
peer then waits for what the database can tell (the sender's release or its lease's
expiry, docs/leases.md). A session that ended is never taken for a dead process.
"""

from __future__ import annotations

import os
from functools import cache

__all__ = ["process_gone", "process_identity"]

PREFIX = "linux"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _start_and_state(pid: int) -> tuple[str, str] | None:
    """The start time (clock ticks since boot) and the state letter of ``pid``, or None
    when there is no such process."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # the command name is in parentheses and may hold spaces or parentheses itself
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19], fields[0]  # starttime is field 22 of the line, state field 3


@cache
def _host() -> tuple[str, str] | None:
    """This process's boot id and PID namespace, or None where they cannot be read."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    if boot is None or not boot.strip():
        return None
    return boot.strip(), namespace


def process_identity(pid: int | None = None) -> str | None:
    """``linux/<boot id>/<pid namespace>/<pid>/<start time>`` of ``pid`` (this process by
    default), or None where the host does not say."""
    host = _host()
    pid = os.getpid() if pid is None else pid
    found = _start_and_state(pid)
    if host is None or found is None:
        return None
    return "/".join((PREFIX, host[0], host[1], str(pid), found[0]))


def process_gone(identity: str | None) -> bool:
    """True only when ``identity`` names a process of this host's boot and PID namespace
    that no longer runs; False when it runs or nothing can be told from here."""
    if not identity:
        return False
    parts = identity.split("/")
    host = _host()
    if len(parts) != 5 or parts[0] != PREFIX or host is None:
        return False
    _, boot, namespace, pid, start = parts
    if (boot, namespace) != host or not pid.isdigit():
        return False
    found = _start_and_state(int(pid))
    if found is None:
        return True  # no such process
    started, state = found
    return started != start or state in ("Z", "X")  # another process, or an exited one

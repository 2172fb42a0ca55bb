"""Two "nodes" on one machine, each in a Linux network namespace of its own, joined by a veth pair.

Node 0 is 10.231.0.1/24 and node 1 10.231.0.2/24, each on an interface named :data:`IFNAME` (the same
name on both, as ``eth0`` on every node of a cluster), so a job started in them talks over that link
and nothing else: no shared loopback hides a wrong rendezvous address or interface, and the link can be
cut (:meth:`TwoNodes.cut`). Only these two namespaces and their addresses are created or addressed.

Names carry this process's id and a counter (parallel runs do not collide); :meth:`TwoNodes.close`
kills what still runs inside the namespaces and deletes them (the veth pair goes with them), and is
called from ``atexit`` too. Namespaces left by a process that was killed are removed by the next
:meth:`TwoNodes.open` (their owner's pid no longer exists).

Needs root, ``ip`` (iproute2; installed with apt-get under ``CI=true``, as the SLURM fixture installs
slurm) and a kernel with network namespaces and veth: :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import time

PREFIX = "spnet"  # namespace names: spnet-<pid>-<n>-<node>
IFNAME = "eth32"
ADDRESSES = ("10.231.0.1", "10.231.0.2")
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why two namespaced nodes cannot be made here (None: they can): tried for real, then removed."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        subprocess.run(["apt-get", "install", "-y", "-q", "iproute2"], capture_output=True, timeout=600)
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install iproute2"
    try:
        with TwoNodes() as nodes:
            nodes.run(1, ["true"])
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"cannot create network namespaces with a veth pair: {detail.strip()}"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces of this harness whose creating process is gone (a run killed before cleanup)."""
    listed = _ip("netns", "list", check=False).stdout
    stale = [
        m.group(0)
        for m in re.finditer(rf"^{PREFIX}-(\d+)-\d+-[01]\b", listed, re.MULTILINE)
        if not _pid_alive(int(m.group(1)))
    ]
    for name in stale:
        _kill_inside(name)
        _ip("netns", "del", name, check=False)
    return stale


def _kill_inside(namespace: str) -> None:
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(int(p)) and os.path.exists(f"/proc/{p}/ns/net")]
        if pids:
            time.sleep(0.05)


class TwoNodes:
    """``with TwoNodes() as nodes: subprocess.Popen(nodes.prefix(1) + cmd, ...)``."""

    def __init__(self) -> None:
        pid, n = os.getpid(), next(_counter)
        self.namespaces = (f"{PREFIX}-{pid}-{n}-0", f"{PREFIX}-{pid}-{n}-1")
        self.addresses = ADDRESSES
        # temporary names in the root namespace (unique, at most 15 characters), renamed once inside
        self._temp = (f"sp{pid % 10**7}x{n % 1000}a", f"sp{pid % 10**7}x{n % 1000}b")
        self._open = False

    # ------------------------------------------------------------------ set-up and clean-up
    def open(self) -> TwoNodes:
        remove_stale()
        atexit.register(self.close)
        self._open = True
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            _ip("link", "add", self._temp[0], "type", "veth", "peer", "name", self._temp[1])
            for ns, temp, address in zip(self.namespaces, self._temp, self.addresses, strict=True):
                _ip("link", "set", temp, "netns", ns)
                _ip("-n", ns, "link", "set", temp, "name", IFNAME)
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
                _ip("-n", ns, "link", "set", "lo", "up")  # gloo binds its own listening sockets too
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        for ns in self.namespaces:
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)  # deleting a namespace deletes its end of the veth
        _ip("link", "del", self._temp[0], check=False)  # if creation stopped before the move
        atexit.unregister(self.close)

    def __enter__(self) -> TwoNodes:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ use
    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def run(self, node: int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.prefix(node), *cmd], check=True, capture_output=True, text=True, **kwargs
        )

    def pids(self, node: int) -> list[int]:
        """Every process inside ``node``'s namespace (a launcher and the ranks it started in their own
        sessions alike)."""
        return [int(p) for p in _ip("netns", "pids", self.namespaces[node], check=False).stdout.split()]

    def signal(self, node: int, sig: int) -> list[int]:
        """Send ``sig`` to every process of ``node``, as a node failure (SIGKILL) or hang (SIGSTOP) hits
        them all; returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def cut(self, node: int) -> None:
        """Take ``node``'s end of the link down: a partition (no packet crosses; no socket is closed)."""
        _ip("-n", self.namespaces[node], "link", "set", IFNAME, "down")

    def mend(self, node: int) -> None:
        _ip("-n", self.namespaces[node], "link", "set", IFNAME, "up")

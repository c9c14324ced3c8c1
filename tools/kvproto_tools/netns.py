"""Network namespaces as test and chaos hosts: make, enter, run inside, clean up.

The primitives every namespace user shares: whether namespaces work here
(root, ``ip``, iptables inside a namespace), running ``ip``/``iptables``
(:func:`run_tool`), moving a thread into a namespace (:func:`enter`), a
socket of a namespace (:func:`socket_in`), a spawned child that runs inside
one with that namespace's ``/sys`` (:func:`spawn_in`), and deleting the
namespaces of a run that crashed (:func:`remove_stale`).

Every namespace made with them is named ``<PREFIX>-<pid>-<tag>-<host>``, so a
later run deletes those whose process is gone. Nothing here reaches outside
the namespaces its caller made. tests/netfault builds two-host links on these
(spec/fault-testing.md); ``kvproto chaos`` a switched network of engine hosts
(spec/chaos.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

PREFIX = "kvnf"
"""Prefix of every namespace (and interface) made by kvproto's tests and tools."""
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 1 << 19, 2
_NETNS_DIR = "/run/netns"
CMD_TIMEOUT_S = 10.0
"""Longest one ``ip`` or ``iptables`` command may take."""


class NetnsUnavailable(Exception):
    """Namespaces cannot be made here (not root, no ``ip netns``, no iptables)."""


def unavailable_reason() -> str | None:
    """Why namespace tests cannot run here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 iptables)"
    name = f"{PREFIX}-probe-{os.getpid()}"
    try:
        run_tool("ip", "netns", "add", name)
    except NetnsUnavailable as exc:
        return f"`ip netns add` failed: {exc}"
    try:
        run_tool("ip", "netns", "exec", name, "iptables", "-w", "-L", "INPUT", "-n")
    except NetnsUnavailable as exc:
        return f"iptables does not work inside a namespace: {exc}"
    finally:
        with contextlib.suppress(NetnsUnavailable):
            run_tool("ip", "netns", "del", name)
    return None


def run_tool(*argv: str) -> str:
    """Run ``argv`` (``ip``, ``iptables``...); its stdout, or :class:`NetnsUnavailable`."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsUnavailable(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def netns_names() -> list[str]:
    """Names of every namespace ``ip netns`` knows."""
    out = run_tool("ip", "netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete this module's namespaces left by a run whose process is gone; returns their names.

    Names are ``kvnf-<pid>-<n>-<host>``: a namespace whose pid is not alive
    is stale (deleting a namespace also deletes the veth ends inside it).
    """
    removed = []
    for name in netns_names():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # that run is alive: not ours to delete
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(NetnsUnavailable):
            run_tool("ip", "netns", "del", name)
            removed.append(name)
    return removed


def enter(netns: str) -> None:
    """Move the calling thread into namespace ``netns`` (``setns(CLONE_NEWNET)``)."""
    fd = os.open(os.path.join(_NETNS_DIR, netns), os.O_RDONLY)
    try:
        _setns(fd, netns)
    finally:
        os.close(fd)


def _setns(fd: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """The calling thread in namespace ``netns`` for the block, back in its own after.

    Threads and processes the block starts begin in ``netns`` too (a new task takes
    its creator's namespaces), so a client thread pool made inside talks to the
    servers of that namespace."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(netns)
        try:
            yield
        finally:
            _setns(own, "back to the thread's own namespace")
    finally:
        os.close(own)


def socket_in(netns: str, family: int, kind: int) -> socket.socket:
    """A socket of namespace ``netns``, made by a short-lived thread that entered it."""
    made: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            enter(netns)
            made.append(socket.socket(family, kind))
        except BaseException as exc:
            made.append(exc)

    t = threading.Thread(target=make, name=f"socket-in-{netns}")
    t.start()
    t.join(CMD_TIMEOUT_S)
    if not made:
        raise TimeoutError(f"no socket from {netns}")
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _private_sysfs() -> None:
    """Give the calling (single-threaded) process its own mount namespace with this netns's /sys.

    What ``ip netns exec`` does: /sys/class/net lists the devices of the
    namespace that mounted sysfs, and UCX finds its network devices there.
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs /sys")


def _child_entry(
    netns: str, env: dict[str, str], target: Callable[..., None], args: tuple[Any, ...]
) -> None:
    enter(netns)
    _private_sysfs()
    os.environ.update(env)
    target(*args)


def spawn_in(
    netns: str,
    target: Callable[..., None],
    args: tuple[Any, ...],
    *,
    env: dict[str, str] | None = None,
    name: str = "netns-child",
) -> multiprocessing.process.BaseProcess:
    """Start ``target(*args)`` in a spawned child that first enters ``netns``.

    ``env`` is set in the child before ``target`` imports anything (UCX reads
    ``UCX_NET_DEVICES`` and ``UCX_TLS`` when its context is made). The child
    is a daemon: it dies with the test process.
    """
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=_child_entry, args=(netns, dict(env or {}), target, args), name=name, daemon=True
    )
    proc.start()
    return proc


def transport_env(ifname: str) -> dict[str, str]:
    """UCX (NIXL's backend too) over TCP on the namespace's link only.

    Without ``UCX_TLS=tcp`` UCX would pick shared memory or CMA, which cross
    network namespaces (they share /dev/shm and the pid space) and would
    bypass the faulty link; ``UCX_NET_DEVICES`` keeps it off ``lo``.
    """
    return {
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": ifname,
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        "KVPROTO_NIXL_PROGRESS_THREAD": "0",
    }


def answers(netns: str, addr: str, *, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connect from namespace ``netns`` to ``addr`` gets an answer.

    Nothing listens on port 9 (discard) there: a refusal (RST) proves the path works both
    ways; a timeout or an unreachable network says it does not (yet)."""
    sock = socket_in(netns, socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect((addr, 9))
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        sock.close()
    return True

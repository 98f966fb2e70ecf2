"""A seccomp-bpf filter built by hand (no libseccomp): the network layer that needs no privilege.

Creating any socket other than ``AF_UNIX`` kills the process at once (``SIGSYS``), so a network
attempt is both stopped and visible in the exit status. ``AF_UNIX`` sockets are refused too (see
:func:`program` for why and how), except connected pairs from ``socketpair``. A few syscalls
that reach outside the sandbox or widen the kernel's attack surface (ptrace, cross-process
memory access, io_uring, which can open sockets without the ``socket`` syscall, bpf, perf
events, userfaultfd) fail with ``EPERM``. A syscall of a foreign ABI (i386 or x32 on x86_64)
is killed, since its numbers differ and would slip past the filter.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_KILL_PROCESS = 0x80000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_LD_ABS_W = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_JSET_K = 0x45
_ALU_AND_K = 0x54
_AF_UNIX = 1
_SOCK_DGRAM = 2
_SOCK_TYPE_MASK = 0xF
_SOCK_NONBLOCK = 0o4000  # O_NONBLOCK: the same value on x86_64 and aarch64
_EAFNOSUPPORT = 97
_X32_BIT = 0x40000000

# arch id, socket, socketpair, [denied syscalls]
_TABLES = {
    "x86_64": (0xC000003E, 41, 53, [101, 310, 311, 425, 426, 427, 321, 298, 323]),
    "aarch64": (0xC00000B7, 198, 199, [117, 270, 271, 425, 426, 427, 280, 241, 282]),
}


def supported() -> bool:
    """Whether this machine's architecture has a filter table here."""
    return platform.machine() in _TABLES


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def program() -> bytes:
    """The filter as raw ``struct sock_filter`` instructions for this architecture.

    ``socket`` never succeeds. Any family but ``AF_UNIX`` kills the process. ``AF_UNIX`` is
    refused as well: a pathname socket that the host left in a folder the sandbox can traverse
    (``/dev/shm``, ``/tmp``, ``/run``) would otherwise be a channel out, and neither Landlock
    (it governs ``bind`` through ``MAKE_SOCK``, not ``connect``) nor the network namespace
    (it separates only abstract sockets) covers its ``connect``; the filter cannot read the
    socket address either, so the socket itself is refused. Libraries probe host daemons with
    non-blocking ``AF_UNIX`` sockets and fall back when that fails (glibc's nscd client and
    ``nss-systemd``, on every user or host name lookup, as in ``ls -l``): those get
    ``EAFNOSUPPORT``, so ordinary tools keep working, and a program that reports the error is
    recorded from its message. Any other ``AF_UNIX`` socket (Python's ``socket.socket``,
    ``nc -U``, ``socat``) kills the process, which records the attempt for certain in the
    exit status. ``socketpair`` stays allowed for ``AF_UNIX`` streams (asyncio and
    multiprocessing use it): such a pair is connected only to itself. A datagram pair is
    refused, since ``sendto`` on it could name a host socket as its destination."""
    machine = platform.machine()
    if machine not in _TABLES:
        raise OSError(f"no seccomp table for architecture {machine}")
    arch, socket_nr, socketpair_nr, denied = _TABLES[machine]
    eperm = _RET_ERRNO | 1
    no_family = _RET_ERRNO | _EAFNOSUPPORT
    out = [
        _insn(_LD_ABS_W, 0, 0, 4),  # seccomp_data.arch
        _insn(_JEQ_K, 1, 0, arch),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_ABS_W, 0, 0, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":
        out += [_insn(_JGE_K, 0, 1, _X32_BIT), _insn(_RET_K, 0, 0, _RET_KILL_PROCESS)]
    for nr in denied:
        out += [_insn(_JEQ_K, 0, 1, nr), _insn(_RET_K, 0, 0, eperm)]
    out += [
        # socket(family, type, protocol)
        _insn(_JEQ_K, 0, 6, socket_nr),
        _insn(_LD_ABS_W, 0, 0, 16),  # low half of args[0], the address family
        _insn(_JEQ_K, 0, 3, _AF_UNIX),
        _insn(_LD_ABS_W, 0, 0, 24),  # low half of args[1], the type and its flags
        _insn(_JSET_K, 0, 1, _SOCK_NONBLOCK),
        _insn(_RET_K, 0, 0, no_family),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        # socketpair(family, type, protocol, sv)
        _insn(_JEQ_K, 0, 6, socketpair_nr),
        _insn(_LD_ABS_W, 0, 0, 16),
        _insn(_JEQ_K, 1, 0, _AF_UNIX),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_ABS_W, 0, 0, 24),
        _insn(_ALU_AND_K, 0, 0, _SOCK_TYPE_MASK),
        _insn(_JEQ_K, 1, 0, _SOCK_DGRAM),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
        _insn(_RET_K, 0, 0, no_family),
    ]
    return b"".join(out)


class _Prog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def install() -> None:
    """Install the filter on the calling thread; inherited by every child and exec, for good.
    ``no_new_privs`` must already be set."""
    code = program()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Prog(len(code) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")

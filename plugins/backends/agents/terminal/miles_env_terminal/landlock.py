"""Landlock (Linux >= 5.13) through ctypes: confine writes to one directory and reads to the
system's programs, deny TCP, scope
signals and abstract unix sockets to the sandbox.

Landlock needs no privilege (only ``no_new_privs``), so it is the filesystem layer that works
for root and non-root alike.
Newer ABIs add TCP bind/connect control (ABI 4) and signal / abstract-socket scoping (ABI 6);
each is used when the running kernel has it.
"""

from __future__ import annotations

import ctypes
import os

_SYS_CREATE_RULESET = 444  # the same number on x86_64 and aarch64 (generic syscall table)
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# filesystem access rights
EXECUTE = 1 << 0
READ_FILE = 1 << 2
READ_DIR = 1 << 3
WRITE_FILE = 1 << 1
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
# network access rights (ABI 4)
NET_BIND_TCP = 1 << 0
NET_CONNECT_TCP = 1 << 1
# scopes (ABI 6)
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

_WRITES_V1 = (
    WRITE_FILE
    | REMOVE_DIR
    | REMOVE_FILE
    | MAKE_CHAR
    | MAKE_DIR
    | MAKE_REG
    | MAKE_SOCK
    | MAKE_FIFO
    | MAKE_BLOCK
    | MAKE_SYM
)


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # the kernel struct is __attribute__((packed))
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is absent or disabled."""
    version = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION)
    return max(int(version), 0)


def set_no_new_privs() -> None:
    """Forbid gaining privileges through exec (setuid binaries); Landlock and seccomp need it."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")


def restrict(
    writable: list[str], device_files: list[str], readable: list[str], *, deny_tcp: bool
) -> list[str]:
    """Restrict the calling thread (and everything it execs or forks) for good.

    ``writable`` directories get every right beneath them; ``readable`` ones (the system's
    programs and libraries) may be read and executed; ``device_files`` (single files such as
    ``/dev/null``, never a folder: ``/dev`` itself stays unlistable, so ``/dev/shm`` and the
    host's other devices are out of reach) may be opened for reading and writing. Nothing
    else may be read, created,
    written, removed or renamed: the rest of the machine (the repository, the home folder, the
    grader's hidden tests) is invisible. With ``deny_tcp`` and ABI >= 4 every TCP bind and
    connect is refused. Returns the features applied (``fs``, ``tcp``, ``scope``). Call
    :func:`set_no_new_privs` first.
    """
    abi = abi_version()
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    writes = _WRITES_V1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    reads = EXECUTE | READ_FILE | READ_DIR
    fs = writes | reads
    net = (NET_BIND_TCP | NET_CONNECT_TCP) if deny_tcp and abi >= 4 else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    try:
        for path, rights in [
            *((p, fs) for p in writable),
            *((p, reads) for p in readable),
            *((p, READ_FILE | WRITE_FILE | (TRUNCATE if abi >= 3 else 0)) for p in device_files),
        ]:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(rights, fd)
                if _libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0):
                    err = ctypes.get_errno()
                    raise OSError(err, f"landlock_add_rule({path}): {os.strerror(err)}")
            finally:
                os.close(fd)
        if _libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(ruleset)
    return ["fs", *(["tcp"] if net else []), *(["scope"] if scoped else [])]

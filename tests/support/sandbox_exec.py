"""Run a command under an emulation of a systemd unit's sandbox, where systemd itself cannot run it (in CI PID 1 is
not systemd): ``python sandbox_exec.py UNIT -- COMMAND...``.

What is emulated is what could break the broker itself, as the unit's own lines say it:
- ``SystemCallFilter=`` (allow list, then ``~`` lines taken out of it) with ``SystemCallErrorNumber=``, through
  libseccomp, the groups expanded from ``systemd-analyze syscall-filter`` (the libzmq abort on
  ``~@resources`` is what this catches);
- ``RestrictAddressFamilies=`` (``socket()`` of another family fails: with the error number here, systemd says
  EAFNOSUPPORT);
- ``MemoryDenyWriteExecute=`` (the kernel's ``PR_SET_MDWE``, where it has it);
- ``NoNewPrivileges=`` (needed for the filter anyway).
The filter is inherited by everything the command starts, workers included.  The file-system and namespace
directives are not emulated (they need privileges a test does not have).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import subprocess
import sys

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def directives(unit: str) -> list[tuple[str, str]]:
    out = []
    for line in open(unit):
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def syscall_groups() -> dict[str, list[str]]:
    text = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True).stdout
    groups: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        if name.startswith("@"):
            out |= expand(groups[name], groups)
        else:
            out.add(name)
    return out


def apply(unit: str) -> None:
    lines = directives(unit)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if ("MemoryDenyWriteExecute", "yes") in lines and libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0):
        print("sandbox_exec: this kernel has no PR_SET_MDWE; MemoryDenyWriteExecute= not emulated", file=sys.stderr)
    groups = syscall_groups()
    allowed: set[str] | None = None
    for key, value in lines:
        if key != "SystemCallFilter":
            continue
        if value.startswith("~"):
            allowed = (allowed or set()) - expand(value[1:].split(), groups)
        else:
            allowed = (allowed or set()) | expand(value.split(), groups)
    err = dict(lines).get("SystemCallErrorNumber", "EPERM")
    families = [f for k, v in lines if k == "RestrictAddressFamilies" for f in v.split()]
    seccomp = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(ArgCmp)]
    seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
    deny = 0x00050000 | getattr(errno, err)   # SCMP_ACT_ERRNO(err)
    ctx = seccomp.seccomp_init(deny if allowed is not None else SCMP_ACT_ALLOW)
    socket_nr = seccomp.seccomp_syscall_resolve_name(b"socket")
    for name in sorted(allowed or ()):
        nr = seccomp.seccomp_syscall_resolve_name(name.encode())
        if nr < 0 or (families and nr == socket_nr):
            continue   # not on this architecture; socket() is filtered by family below
        if seccomp.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, nr, 0, None) != 0:
            raise OSError(f"seccomp_rule_add {name}")
    if families:
        for family in families:
            cmp = (ArgCmp * 1)(ArgCmp(0, SCMP_CMP_EQ, getattr(socket, family), 0))
            if seccomp.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, socket_nr, 1, cmp) != 0:
                raise OSError(f"seccomp_rule_add socket {family}")
    if seccomp.seccomp_load(ctx) != 0:
        raise OSError(ctypes.get_errno(), "seccomp_load")


def main() -> None:
    unit, sep, *command = sys.argv[1:]
    assert sep == "--", "usage: sandbox_exec.py UNIT -- COMMAND..."
    apply(unit)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()

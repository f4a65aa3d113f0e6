"""The sandbox's seccomp filter: no new namespaces for the program, in either of bwrap's modes.

Nested user, mount and network namespaces are the kernel surface most container escapes start
from. As another user, bwrap's `--disable-userns` already stops a nested user namespace; as
root (privileged bwrap, no user namespace of its own) nothing did. This filter, handed to bwrap
with `--seccomp FD` and inherited by everything the program starts, makes

    unshare(...)                      fail with EPERM
    setns(...)                        fail with EPERM
    clone(flags) with a CLONE_NEW*    fail with EPERM (threads and forks are untouched)
      or CLONE_PARENT                 (a child made a sibling of its parent would escape the
                                      process tree that is killed with the test)
    memfd_create, memfd_secret        fail with EPERM: memory that no process maps and no file
                                      system bounds (RLIMIT_AS does not count it)
    keyctl, add_key, request_key      fail with EPERM: the kernel keyrings outlive a test and are
                                      keyed by uid, so one test could leave data for the next
    clone3(...)                       fail with ENOSYS (its flags sit in memory a filter cannot
                                      read; the C library then falls back to clone)
    x32 system calls (x86_64)         fail with EPERM (another numbering, not checked here)

and lets every other call through. A call from another architecture than the node's kills the
process. The program is classic BPF (struct sock_filter, 8 bytes an instruction), written
here because no kept library builds one (libseccomp's Python binding is not on PyPI).
"""
from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0 = 0, 4, 16            # args[0]'s low 32 bits (little-endian)
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_X32_BIT = 0x40000000

CLONE_PARENT = 0x8000
CLONE_NEW = {"NEWTIME": 0x80, "NEWNS": 0x20000, "NEWCGROUP": 0x2000000, "NEWUTS": 0x4000000,
             "NEWIPC": 0x8000000, "NEWUSER": 0x10000000, "NEWPID": 0x20000000,
             "NEWNET": 0x40000000}
_NS_MASK = sum(CLONE_NEW.values()) | CLONE_PARENT

# machine -> (AUDIT_ARCH_*, unshare, setns, clone, clone3, checks x32)
_ARCHES = {
    "x86_64": (0xC000003E, 272, 308, 56, 435, True),
    "aarch64": (0xC00000B7, 97, 268, 220, 435, False),
}
# machine -> calls refused outright: memfd_create, memfd_secret, keyctl, add_key, request_key
_DENIED = {
    "x86_64": (319, 447, 250, 248, 249),
    "aarch64": (279, 447, 219, 217, 218),
}


def supported() -> bool:
    return platform.machine() in _ARCHES


def program(machine: str | None = None) -> bytes:
    """The filter for `machine` (default: this node's) as bwrap reads it from --seccomp."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise ValueError(f"no seccomp filter for {machine} (only {', '.join(_ARCHES)})")
    arch, unshare, setns, clone, clone3, x32 = _ARCHES[machine]
    # (opcode, k, true label, false label); labels name the return instructions at the end
    code: list[tuple[int, int, str | None, str | None]] = [
        (_LD_W_ABS, _ARCH, None, None),
        (_JEQ, arch, None, "kill"),
        (_LD_W_ABS, _NR, None, None),
        *([(_JGE, _X32_BIT, "eperm", None)] if x32 else []),
        (_JEQ, unshare, "eperm", None),
        *[(_JEQ, nr, "eperm", None) for nr in _DENIED[machine]],
        (_JEQ, setns, "eperm", None),
        (_JEQ, clone3, "enosys", None),
        (_JEQ, clone, None, "allow"),
        (_LD_W_ABS, _ARG0, None, None),
        (_JSET, _NS_MASK, "eperm", "allow"),
    ]
    returns = {"allow": _ALLOW, "eperm": _ERRNO | errno.EPERM, "enosys": _ERRNO | errno.ENOSYS,
               "kill": _KILL_PROCESS}
    where = {name: len(code) + i for i, name in enumerate(returns)}
    out = []
    for i, (op, k, t, f) in enumerate(code):
        jt = where[t] - i - 1 if t else 0
        jf = where[f] - i - 1 if f else 0
        out.append(struct.pack("<HBBI", op, jt, jf, k))
    out += [struct.pack("<HBBI", _RET, 0, 0, k) for k in returns.values()]
    return b"".join(out)

"""A seccomp-BPF filter, installed by a sandboxed process on itself just before the untrusted program
runs: no new processes, no sockets, no signals or limits aimed at other processes, no tracing, no
mounts or namespaces. The kernel enforces it for every later system call, ctypes or not, and a filter
can never be removed. Standard library only: this file runs inside the sandbox, outside the package."""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
CLONE_THREAD = 0x00010000
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ALLOW = 0x80000000, 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
REFUSE, ALLOW = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ALLOW
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl), refused with EPERM.
DENIED = {
    "socket": 41, "socketpair": 53, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322,
    "tkill": 200, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "process_madvise": 440,
    "process_mrelease": 448, "setsid": 112, "setpgid": 109, "setpriority": 141, "sched_setparam": 142,
    "sched_setscheduler": 144, "sched_setaffinity": 203, "sched_setattr": 314, "ioprio_set": 251,
    "migrate_pages": 256, "move_pages": 279, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "unshare": 272, "setns": 308, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "name_to_handle_at": 303,
    "open_by_handle_at": 304, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250,
    "add_key": 248, "request_key": 249, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "syslog": 103, "acct": 163, "swapon": 167, "swapoff": 168,
    "reboot": 169, "sethostname": 170, "setdomainname": 171, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "iopl": 172, "ioperm": 173, "quotactl": 179,
}
CLONE, CLONE3 = 56, 435
# Allowed only when the target (first argument) is this process; prlimit64 also for pid 0 (self).
SELF_ONLY = {"kill": 62, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "prlimit64": 302}
# Refused commands (second argument): a file owner set to another process gets SIGIO/SIGURG signals.
FCNTL, F_SETOWN, F_SETOWN_EX = 72, 8, 15
IOCTL, FIOSETOWN, SIOCSPGRP = 16, 0x8901, 0x8902


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _arg_low(index: int) -> bytes:
    """Load the low 32 bits of argument `index` (seccomp_data.args at offset 16, little-endian):
    pids and clone flags are ints to the kernel, so the high half cannot matter."""
    return _insn(LD_W_ABS, 16 + 8 * index)


def _arg_rule(number: int, index: int, values: list[int], is_allow_list: bool) -> list[bytes]:
    """For syscall `number`: allow (is_allow_list) or refuse exactly when argument `index` is in `values`."""
    refuse, allow = _insn(RET_K, REFUSE), _insn(RET_K, ALLOW)
    tests = [_insn(JEQ_K, value & 0xFFFFFFFF, jt=len(values) - i) for i, value in enumerate(values)]
    body = [_arg_low(index), *tests, *((refuse, allow) if is_allow_list else (allow, refuse))]
    return [_insn(JEQ_K, number, jf=len(body)), *body]


def _threads_only() -> list[bytes]:
    """clone is allowed for threads (CLONE_THREAD), never for processes; clone3 passes its flags in
    memory the filter cannot read, so it answers ENOSYS and glibc falls back to clone."""
    body = [_arg_low(0), _insn(JSET_K, CLONE_THREAD, jt=1), _insn(RET_K, REFUSE), _insn(RET_K, ALLOW)]
    return [_insn(JEQ_K, CLONE, jf=len(body)), *body,
            _insn(JEQ_K, CLONE3, jf=1), _insn(RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS)]


def build_filter(own_pid: int) -> bytes:
    """The BPF program; the accumulator holds the syscall number between the blocks."""
    if platform.machine() != "x86_64":
        raise OSError(f"no syscall table for {platform.machine()} (x86_64 only)")
    # Another ABI (32-bit int 0x80 or x32 numbers) would bypass the table: kill the process instead.
    program = [_insn(LD_W_ABS, 4), _insn(JEQ_K, AUDIT_ARCH_X86_64, jt=1),
               _insn(RET_K, SECCOMP_RET_KILL_PROCESS), _insn(LD_W_ABS, 0),
               _insn(JGE_K, X32_SYSCALL_BIT, jf=1), _insn(RET_K, SECCOMP_RET_KILL_PROCESS)]
    program += _threads_only()
    for name, number in SELF_ONLY.items():
        program += _arg_rule(number, 0, [own_pid, 0] if name == "prlimit64" else [own_pid], True)
    program += _arg_rule(FCNTL, 1, [F_SETOWN, F_SETOWN_EX], False)
    program += _arg_rule(IOCTL, 1, [FIOSETOWN, SIOCSPGRP], False)
    for number in DENIED.values():
        program += [_insn(JEQ_K, number, jf=1), _insn(RET_K, REFUSE)]
    return b"".join(program + [_insn(RET_K, ALLOW)])


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_filter() -> None:
    """Irreversible for this process; no_new_privs is what lets a process without CAP_SYS_ADMIN
    install a filter."""
    code = build_filter(os.getpid())
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    for args in ((PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
                 (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0)):
        if libc.prctl(*[ctypes.c_ulong(a) for a in args]) != 0:
            raise OSError(ctypes.get_errno(), f"prctl: {os.strerror(ctypes.get_errno())}")

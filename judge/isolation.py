"""The sandboxed side: a fresh `python -I` (judge/sandbox.py) calls main here, which reads the program from
stdin, confines its own process, then runs the program in the same interpreter. Confinement, in order:
new user, mount, network, IPC and UTS namespaces; a new root that holds only read-only system and Python
folders and a size-limited writable tmpfs at /tmp (the program's folder); no capabilities; the seccomp
filter; resource limits. Any failure before the program starts exits with one line on stderr and never
runs the program. Standard library only, no package imports: the launcher puts this folder on sys.path."""
from __future__ import annotations

import builtins
import ctypes
import json
import os
import resource
import sys

import seccomp

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH, SYS_PIVOT_ROOT, SYS_CAPSET = 2, 155, 126
# Mount flags a user namespace may not change on a bind of a mount it inherited (the kernel locks them).
LOCKED_FLAGS = 2 | 4 | 8 | 1024 | 2048 | 4096     # nosuid nodev noexec noatime nodiratime relatime
SYSTEM_FOLDERS = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin"]
SYSTEM_FILES = ["/etc/ld.so.cache", "/etc/localtime", "/dev/null", "/dev/zero", "/dev/urandom"]
STAGING = "/tmp"          # where the new root is assembled, inside our private mount namespace

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data)),
           f"mount {target}")


def enter_namespaces() -> None:
    """Root inside a new user namespace is mapped to our own uid/gid outside: no new privilege there."""
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)


def _bind_read_only(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND)
    locked = os.statvfs(source).f_flag & LOCKED_FLAGS
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | locked)


def _place(path: str, root: str) -> None:
    """Symbolic links (merged /usr: /lib -> usr/lib) are recreated, the rest bound read-only."""
    target = root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(path), target)
    elif os.path.exists(path):
        _bind_read_only(os.path.realpath(path), target)


def visible_paths() -> list[str]:
    """Everything the program can see besides its own /tmp: system folders and this Python's own
    installation (even when it lives in a home folder); the rest of the host (home folders, /tmp, /proc,
    the repository and its virtualenv, sockets in /run) does not exist inside."""
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    is_covered = lambda path: any(path == f or path.startswith(f + "/") for f in SYSTEM_FOLDERS)
    return SYSTEM_FOLDERS + sorted(p for p in prefixes if not is_covered(p)) + SYSTEM_FILES


def build_root(folder_bytes: int) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("sandbox-root", STAGING, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in visible_paths():
        _place(path, STAGING)
    os.makedirs(STAGING + "/tmp")
    _mount("sandbox-tmp", STAGING + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={folder_bytes},nr_inodes=1024,mode=0777")
    os.chdir(STAGING)
    # pivot_root(".", ".") stacks the old root on top of the new one; detaching it leaves only ours.
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/tmp")


def drop_capabilities() -> None:
    """Root of the user namespace keeps no capability (no mount, no chown...); without exec, none
    can come back."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)            # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()                            # effective, permitted, inheritable x 2
    _check(_libc.syscall(SYS_CAPSET, header, data), "capset")


def set_limits(limits: dict) -> None:
    """Soft and hard limits alike, so the program cannot raise them back (capped by our own hard limits)."""
    for name, value in (("RLIMIT_CPU", limits["max_cpu_seconds"]), ("RLIMIT_FSIZE", limits["max_file_bytes"]),
                        ("RLIMIT_NOFILE", limits["max_open_files"]), ("RLIMIT_CORE", 0),
                        ("RLIMIT_AS", limits["max_memory_bytes"])):
        kind = getattr(resource, name)
        hard = resource.getrlimit(kind)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def confine(limits: dict) -> None:
    """Raises OSError whose message names the step the kernel refused."""
    steps = (("user and network namespaces", enter_namespaces),
             ("read-only root", lambda: build_root(limits["folder_bytes"])),
             ("dropping capabilities", drop_capabilities), ("seccomp filter", seccomp.install_filter))
    for step, run in steps:
        try:
            run()
        except OSError as error:
            detail = error.strerror or str(error)
            raise OSError(f"{step} refused ({error.filename + ': ' if error.filename else ''}{detail})") from error


def main(limits_json: str) -> None:
    limits = json.loads(limits_json)
    program = sys.stdin.read()
    try:
        if limits["confine"]:
            confine(limits)
        set_limits(limits)
    except OSError as error:
        print(f"sandbox: {error.strerror or error}", file=sys.stderr)   # read by available_isolation
        raise SystemExit(125)
    sys.setrecursionlimit(10000)
    sys.argv = ["program.py"]
    exec(compile(program, "program.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})

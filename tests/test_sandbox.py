"""The sandbox for generated code, attacked: each escape attempt below must be refused by the kernel or
contained, and this test process must survive all of them. Programs print what happened (REFUSED, or a
marker such as CONNECTED when they got through) so each test asserts the precise containment."""
import os
import pwd
import socket
import time
import uuid

import pytest

from judge import sandbox
from judge.sandbox import IsolationReport, SandboxConfig, SandboxUnavailable, available_isolation, run_program

REPORT = available_isolation()
confined_only = pytest.mark.skipif(not REPORT.is_available, reason=REPORT.missing)

LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def attempt(action: str, success: str, timeout: float = 5.0, **limits) -> sandbox.RunResult:
    """Runs `action` confined; prints `success` when it completed, REFUSED <error> when it raised."""
    program = f"try:\n    {action}\n    print({success!r})\nexcept OSError as error:\n    print('REFUSED', error)\n"
    return run_program(program, timeout, SandboxConfig(**limits))


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server.getsockname()[1]
    with pytest.raises(BlockingIOError):
        server.accept()                                       # nobody ever reached us
    server.close()


@confined_only
def test_a_correct_program_passes_and_a_failing_assert_fails():
    assert run_program("def f(x):\n    return x + 1\n\nassert f(1) == 2", 5) == sandbox.RunResult(True, "passed", "")
    assert run_program("assert 1 == 2", 5).reason == "failed"


@confined_only
@pytest.mark.parametrize("connect", [
    "__import__('socket').create_connection(('127.0.0.1', PORT), timeout=2)",
    "__import__('_socket').socket().connect(('127.0.0.1', PORT))",
    LIBC.replace("\n", "; ") + "import struct, socket; fd = libc.socket(2, 1, 0); "
    "address = struct.pack('=HH4s8x', 2, socket.htons(PORT), socket.inet_aton('127.0.0.1')); "
    "assert fd >= 0 and libc.connect(fd, address, 16) == 0, OSError(ctypes.get_errno(), 'libc')",
    LIBC.replace("\n", "; ") + "fd = libc.syscall(41, 2, 1, 0); assert fd >= 0, OSError(ctypes.get_errno(), 'syscall')",
], ids=["socket", "_socket", "ctypes-connect", "raw-syscall"])
def test_no_network(listener, connect):
    result = run_program(f"PORT = {listener}\ntry:\n    {connect}\n    print('CONNECTED')\n"
                         f"except (OSError, AssertionError) as error:\n    print('REFUSED', error)\n", 5)
    assert "REFUSED" in result.output and "CONNECTED" not in result.output


@confined_only
@pytest.mark.parametrize("where", ["home", "tmp", "repository"])
@pytest.mark.parametrize("how", ["open", "ctypes"])
def test_writes_outside_its_folder_never_reach_the_host(where, how):
    folder = {"home": pwd.getpwuid(os.getuid()).pw_dir, "tmp": "/tmp", "repository": os.path.dirname(__file__)}[where]
    path = os.path.join(folder, f"sandbox-escape-{uuid.uuid4().hex}")
    write = {"open": f"open({path!r}, 'w').write('ESCAPED')",
             "ctypes": LIBC.replace("\n", "; ") + f"assert libc.open({path.encode()!r}, 0o101, 0o644) >= 0, "
                       "OSError(ctypes.get_errno(), 'open')"}[how]
    try:
        result = run_program(f"try:\n    {write}\n    print('WROTE')\n"
                             "except (OSError, AssertionError) as error:\n    print('REFUSED', error)\n", 5)
        assert not os.path.exists(path)
        # /tmp inside is the program's own tmpfs: the write lands there and vanishes with it.
        assert ("WROTE" if where == "tmp" else "REFUSED") in result.output
    finally:
        if os.path.exists(path):
            os.remove(path)


@confined_only
def test_host_files_and_other_processes_cannot_be_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(f"TOPSECRET-{uuid.uuid4().hex}")
    for path in (secret, f"/proc/{os.getpid()}/environ", "/etc/shadow"):
        result = attempt(f"print(open({str(path)!r}, 'rb').read())", "READ")
        assert "REFUSED" in result.output and "READ" not in result.output and "TOPSECRET" not in result.output


@confined_only
@pytest.mark.parametrize("spawn", [
    "__import__('subprocess').run(['echo', 'CHILD'])",
    "assert __import__('os').system('echo CHILD-$((1+1))') == 0, OSError('system failed')",
    "import os\n    for _ in range(50):\n"
    "        if os.fork() == 0:\n            print('CHILD', flush=True); os._exit(0)",
    LIBC.replace("\n", "\n    ") + "pid = libc.fork()\n    if pid == 0: print('CHILD', flush=True); libc._exit(0)\n"
    "    assert pid > 0, OSError(ctypes.get_errno(), 'fork')",
    "__import__('os').execv('/bin/echo', ['echo', 'CHILD'])",
], ids=["subprocess", "os.system", "fork-loop", "ctypes-fork", "exec"])
def test_no_new_processes(spawn):
    result = run_program(f"try:\n    {spawn}\n    print('SPAWNED')\nexcept (OSError, AssertionError) as error:\n"
                         f"    print('REFUSED', error)\n", 5)
    assert "REFUSED" in result.output and "CHILD" not in result.output and "SPAWNED" not in result.output


@confined_only
@pytest.mark.parametrize("fill, limit, error", [
    ("fd = os.open('fill', os.O_WRONLY | os.O_CREAT)\n        while True: written += os.write(fd, chunk)",
     "max_file_bytes", "File too large"),
    ("for i in range(10 ** 6):\n"
     "            fd = os.open(f'fill{i}', os.O_WRONLY | os.O_CREAT); written += os.write(fd, chunk)",
     "folder_bytes", "No space left"),
    ("for i in range(10 ** 6): os.close(os.open(f'empty{i}', os.O_WRONLY | os.O_CREAT))",
     "folder_bytes", "No space left"),
], ids=["one-file", "many-files", "many-inodes"])
def test_filling_the_disk_is_contained(fill, limit, error):
    limits = {"max_file_bytes": 2 << 20, "folder_bytes": 6 << 20}
    program = (f"import os\nwritten, chunk = 0, b'x' * (256 << 10)\ntry:\n    if True:\n        {fill}\n"
               f"except OSError as error:\n    print('STOPPED', written, error)\n")
    result = run_program(program, 10, SandboxConfig(**limits))
    stopped, written, *message = result.output.split()
    assert stopped == "STOPPED" and int(written) <= limits[limit] and error in " ".join(message)


@confined_only
@pytest.mark.parametrize("send", [
    "os.kill(os.getppid(), signal.SIGKILL)",
    "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    LIBC.replace("\n", "; ") + "assert libc.syscall(234, os.getppid(), os.getppid(), 9) == 0, OSError('tgkill')",
    "import fcntl; r, w = os.pipe(); fcntl.fcntl(r, fcntl.F_SETOWN, os.getppid()); "
    "fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC); os.write(w, b'x')",               # SIGIO to the owner
    LIBC.replace("\n", "; ") + "assert libc.ptrace(16, os.getppid(), 0, 0) == 0, OSError('ptrace')",
    "import resource; resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE)",
], ids=["kill-parent", "killpg-parent", "tgkill", "sigio-owner", "ptrace", "prlimit"])
def test_the_parent_cannot_be_signalled_or_touched(send):
    result = run_program(f"import os, signal\ntry:\n    {send}\n    print('SIGNALLED')\n"
                         f"except (OSError, AssertionError) as error:\n    print('REFUSED', error)\n", 5)
    assert "REFUSED" in result.output and "SIGNALLED" not in result.output
    assert os.getpid()                                          # still here


@confined_only
def test_kill_minus_one_is_refused():
    """kill(-1) reaches every process this uid may signal; prove it is refused with the harmless signal 0
    first, so a broken sandbox fails this test instead of taking the machine down."""
    harmless = attempt("__import__('os').kill(-1, 0)", "SIGNALLED")
    if "REFUSED" not in harmless.output:
        pytest.fail(f"kill(-1, 0) was not refused: {harmless.output!r}")
    result = attempt("__import__('os').kill(-1, __import__('signal').SIGKILL)", "SIGNALLED")
    assert "REFUSED" in result.output


@confined_only
def test_mounts_and_namespaces_cannot_undo_the_read_only_root():
    remount = LIBC.replace("\n", "; ") + (
        "assert libc.mount(None, b'/', None, ctypes.c_ulong(32), None) == 0 or "    # MS_REMOUNT, read-write
        "libc.unshare(0x10000000 | 0x20000) == 0, OSError(ctypes.get_errno(), 'mount')")     # new user + mount ns
    result = run_program(f"try:\n    {remount}\n    print('REMOUNTED')\nexcept AssertionError as error:\n"
                         f"    print('REFUSED', error)\ntry:\n    open('/usr/escape', 'w')\n    print('WROTE')\n"
                         f"except OSError:\n    pass\n", 5)
    assert "REFUSED" in result.output and "REMOUNTED" not in result.output and "WROTE" not in result.output


@confined_only
@pytest.mark.parametrize("call", [
    # i386 fork through `int 0x80` from executable memory: mov eax, 2; int 0x80; ret
    "import mmap; code = mmap.mmap(-1, 4096, prot=7); code.write(bytes.fromhex('b802000000cd80c3')); "
    "pid = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()",
    "pid = libc.syscall(0x40000000 | 57)",                                 # x32 fork
], ids=["int80-fork", "x32-fork"])
def test_other_syscall_abis_are_killed(call):
    report = "print('CHILD' if pid == 0 else 'SURVIVED', pid)"
    result = run_program(f"{LIBC}print('CALLING', flush=True)\n{call}\n{report}", 5)
    assert result.output == "CALLING\n" and result.reason == "failed"


@confined_only
def test_a_sleeper_times_out_and_its_process_group_is_gone():
    started = time.monotonic()
    result = run_program("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)", 1)
    assert result.reason == "timeout" and time.monotonic() - started < 5
    pid = int(result.output.split()[0])
    for probe in (os.kill, os.killpg):
        with pytest.raises(ProcessLookupError):
            probe(pid, 0)


@confined_only
@pytest.mark.parametrize("bomb", ["x = bytearray(8 << 30)", "x = []\nwhile True: x.append(b'x' * (16 << 20))"])
def test_a_memory_bomb_fails_with_memory_error(bomb):
    result = run_program(bomb, 10, SandboxConfig(max_memory_bytes=256 << 20))
    assert not result.passed and "MemoryError" in result.output


def test_without_isolation_run_program_refuses_unless_unconfined(monkeypatch):
    missing = "user and network namespaces refused (unshare: Operation not permitted)"
    monkeypatch.setattr(sandbox, "available_isolation", lambda: IsolationReport((), missing))
    message = (f"cannot sandbox generated code here: {missing} "
               "(pass unconfined=True to run it with resource limits only)")
    with pytest.raises(SandboxUnavailable) as refusal:
        run_program("assert True", 5)
    assert str(refusal.value) == message
    assert run_program("assert True", 5, unconfined=True).passed


def test_sandbox_config_names_the_bad_limit():
    with pytest.raises(ValueError, match="max_open_files must be positive, got 0"):
        SandboxConfig(max_open_files=0)

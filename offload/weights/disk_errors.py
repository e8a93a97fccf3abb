"""Writes that run out of disk. A full disk (ENOSPC), a full quota (EDQUOT) or a failing one (EIO) is not
a bug: it becomes one line naming the file, what is safe on disk and the command that continues.

Every writer that keeps long work on disk (batch output, quantize and distill checkpoints, the GGUF cache,
bench journals) wraps its writes in `writing(path, saved=..., resume=...)`; the CLI prints the
StorageFullError it raises as one `error:` line. `append_text` and `write_text_atomic` are the two write
shapes those writers need: neither leaves a torn line or a half-written file behind.
"""
from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


class StorageFullError(OSError):
    """A write failed for lack of space or a failing disk; str() is the one line the user reads."""

    def __init__(self, cause: OSError, path: str | Path, saved: str, resume: str) -> None:
        super().__init__(cause.errno, cause.strerror)
        self.path, self.saved, self.resume = Path(path), saved, resume
        what = "I/O error" if cause.errno == errno.EIO else "disk full"
        then = "check the disk" if cause.errno == errno.EIO else "free space"
        self.message = (f"{what} writing {path} ({cause.strerror or os.strerror(cause.errno)}); saved: {saved}; "
                        f"{then}, then {resume}").replace("\n", " ")

    def __str__(self) -> str:
        return self.message


def is_storage_error(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


@contextlib.contextmanager
def writing(path: str | Path, saved: str | Callable[[], str], resume: str) -> Iterator[None]:
    """Turns a storage OSError raised inside into StorageFullError. The file named is the one the error
    names (writers below set it), else `path`; `saved` may be a callable, asked only on failure."""
    try:
        yield
    except StorageFullError:
        raise
    except OSError as err:
        if not is_storage_error(err):
            raise
        raise StorageFullError(err, err.filename or path, saved() if callable(saved) else saved, resume) from err


def append_text(path: str | Path, text: str) -> None:
    """Appends whole lines and fsyncs them. On a failed write the file is cut back to its old length, so
    a reader never meets a torn line; the error names `path`."""
    data = memoryview(text.encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except OSError as err:
            # shrinking needs no space; if even that fails, readers of these files skip a torn last line
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise naming(err, path)
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes a whole file through a fsynced temp file renamed into place: the old file stays intact
    until the new one is complete; a failed write removes the temp file and names `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise naming(err, path)


def naming(err: OSError, path: str | Path) -> OSError:
    """The error, naming the file meant (not its temp file) when it names none."""
    if err.filename is None or str(err.filename).endswith(".tmp"):
        err.filename = str(path)
    return err

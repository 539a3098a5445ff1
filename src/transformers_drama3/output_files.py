"""Writing a user's files without ever losing one.

Every output the package writes for a user (a take, a streamed take, a report, an exported model
folder) goes through here: the target is checked before any work starts, the bytes go to a
temporary file in the target's own folder, and only a finished write replaces the target
(`os.replace`, atomic on one file system). A failure at any point leaves the old file as it was
and no stray temporary behind.

    check_output_path("take.wav", "-o")            # before generating: folder exists, is writable
    with atomic_output("take.wav") as temporary:  # write to `temporary`; renamed on success
        soundfile.write(temporary, samples, 44100)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


def check_output_path(path: str | os.PathLike, name: str) -> str:
    """The absolute path of an output file after checking it can be written, or a ValueError
    naming `name`: the folder must exist and be writable, and `path` must not be a folder.
    A symlink is checked where it points, where `atomic_output` writes."""
    path = os.path.realpath(os.fspath(path))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise ValueError(f"{name} {path}: is a folder; expected a file path")
    if not os.path.isdir(folder):
        raise ValueError(f"{name} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path}: the folder {folder} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{name} {path}: the file exists and is read-only")
    return path


def same_file(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    """Whether two paths name one file (through symlinks and hard links when both exist)."""
    if os.path.exists(first) and os.path.exists(second):
        return os.path.samefile(first, second)
    return os.path.realpath(first) == os.path.realpath(second)


def _file_mode(path: str) -> int:
    """The permissions a replaced file keeps, or what a new file would get under the umask."""
    if os.path.exists(path):
        return os.stat(path).st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside `path` (same extension, so writers pick the same format);
    on a normal exit it replaces `path`, on an exception it is removed and `path` is untouched.
    A symlink is followed: the file it points to is replaced and the link kept."""
    path = os.path.realpath(os.fspath(path))
    folder, base = os.path.split(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{base}.", suffix=os.path.splitext(base)[1], dir=folder)
    os.close(descriptor)
    try:
        yield temporary
        os.chmod(temporary, _file_mode(path))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a UTF-8 text file through `atomic_output`."""
    with atomic_output(path) as temporary, open(temporary, "w", encoding="utf-8") as writer:
        writer.write(text)


@contextlib.contextmanager
def atomic_folder(destination: str | os.PathLike) -> Iterator[str]:
    """Yield an empty temporary folder beside `destination`; on a normal exit it takes
    `destination`'s place (the old folder is removed only after the new one is in place), on an
    exception it is removed and `destination` is untouched."""
    destination = os.path.abspath(os.fspath(destination))
    parent, base = os.path.split(destination)
    building = tempfile.mkdtemp(prefix=f".{base}.new.", dir=parent)
    try:
        yield building
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    if not os.path.exists(destination):
        os.replace(building, destination)
        return
    retired = tempfile.mkdtemp(prefix=f".{base}.old.", dir=parent)
    os.rmdir(retired)
    os.replace(destination, retired)
    try:
        os.replace(building, destination)
    except BaseException:
        os.replace(retired, destination)
        shutil.rmtree(building, ignore_errors=True)
        raise
    shutil.rmtree(retired)


__all__ = ["atomic_folder", "atomic_output", "check_output_path", "same_file", "write_text_atomic"]

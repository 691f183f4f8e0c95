"""Output files and folders of every command: atomic writes, and an ``--out`` that is safe.

- :func:`atomic_write_text` and :func:`atomic_file` write to a temporary file
  beside the target and rename it over the target only once it is complete,
  so a reader (or a Ctrl-C) never sees half a report: the target holds the
  old content or the new, never a mix, and an interrupted write leaves no
  temporary file behind.
- :func:`file_argument` is the ``argparse`` type of a file to read: it refuses
  an empty path, which would name the current folder.
- :func:`out_dir_argument` is the ``argparse`` type of ``--out``: it refuses
  an empty path (which would mean the current folder) and one that is not
  UTF-8 text.
- :func:`prepare_out_dir` refuses a folder that holds an earlier run's
  files unless ``force`` (then it deletes exactly those files, and refuses
  a folder by one of their names), and checks that the folder can be
  created and written before the run starts; any ``OSError`` is one line.
- :func:`claim_new_folder` creates a default output folder that no other
  run has: two runs started in the same second get ``NAME`` and ``NAME-2``.

Complexity: O(size written); :func:`prepare_out_dir` O(files in the folder).
Thread safety: each call writes its own temporary file; two writers of one
target race only on the final rename (the last one wins, whole).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, TextIO

from veloxquant_mlx.commandline.bad_input import BadInputError

__all__ = [
    "atomic_file",
    "atomic_write_text",
    "claim_new_folder",
    "file_argument",
    "out_dir_argument",
    "prepare_out_dir",
]


#: Mode asked for a new file, as ``open()`` asks; the kernel takes the umask off
#: (``mkstemp`` would make it 0600, private, unlike the files it replaces).
_FILE_MODE: Final = 0o666
_TEMPORARY_NAME_TRIES: Final = 100


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new, empty file beside ``path`` with the usual mode: ``(descriptor, its path)``.

    ``O_EXCL`` makes the name this call's alone, as ``mkstemp`` does; the
    umask is applied by the kernel at creation, so the process's umask is
    never read (reading it means setting it, a race with other threads).
    """
    for _ in range(_TEMPORARY_NAME_TRIES):
        temporary = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            return os.open(temporary, flags, _FILE_MODE), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[TextIO]:
    """Open a temporary text file beside ``path``; on a clean exit it replaces ``path``.

    On an exception (``KeyboardInterrupt`` included) the temporary file is
    removed and ``path`` is left as it was. The new file has the mode
    ``open()`` would give it (0666 less the umask).
    """
    descriptor, temporary = _create_temporary(path)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as file:
        file.write(text)


def out_dir_argument(text: str) -> Path:
    """The ``argparse`` type of ``--out``: any non-empty path that is UTF-8 text (the
    reports name it, and are written in UTF-8)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected a folder path, got {text!r} (use '.' for the current folder)"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"expected a folder path in UTF-8, got {text!r} (bytes that are not UTF-8)"
        ) from None
    return Path(text)


def file_argument(text: str) -> Path:
    """The ``argparse`` type of a file to read: any non-empty path (an empty one would
    be read as the current folder, and named ``'.'``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    return Path(text)


def earlier_run_files(folder: Path, is_run_file: Callable[[str], bool]) -> list[Path]:
    """The files in ``folder`` (not below it) that ``is_run_file`` claims, sorted by name."""
    if not folder.is_dir():
        return []
    return sorted(entry for entry in folder.iterdir() if is_run_file(entry.name))


def prepare_out_dir(
    folder: Path, *, force: bool, is_run_file: Callable[[str], bool], option: str = "--out"
) -> None:
    """Make ``folder`` ready for a new run's files, or refuse it.

    Args:
        folder: The run's output folder; created (with its parents) if missing.
        force: Delete an earlier run's files there instead of refusing.
        is_run_file: Whether a file name is one a run writes (``report.json``...).
        option: The option's name, for messages.

    Raises:
        BadInputError: ``folder`` is not a folder, cannot be created or written
            (a name too long, say), holds a folder by the name of a run's file, or
            holds an earlier run's files and ``force`` is false. Nothing is
            created or deleted then.
    """
    try:
        _prepare_out_dir(folder, force=force, is_run_file=is_run_file, option=option)
    except OSError as error:
        reason = error.strerror or str(error)
        raise BadInputError(f"{option} {str(folder)!r} cannot be used: {reason}") from None


def _prepare_out_dir(
    folder: Path, *, force: bool, is_run_file: Callable[[str], bool], option: str
) -> None:
    if folder.exists() and not folder.is_dir():
        raise BadInputError(f"{option} {str(folder)!r} is a file; expected a folder")
    earlier = earlier_run_files(folder, is_run_file)
    in_the_way = [path for path in earlier if path.is_dir() and not path.is_symlink()]
    if in_the_way:
        raise BadInputError(
            f"{option} {str(folder)!r} holds a folder named {in_the_way[0].name!r}, a file a "
            "run writes; expected no folder by that name (--force deletes files only)"
        )
    if earlier and not force:
        raise BadInputError(
            f"{option} {str(folder)!r} holds an earlier run's files ({_names(earlier)}); "
            "expected a new or empty folder, or --force to delete them"
        )
    _require_writable(folder, option)
    for path in earlier:
        path.unlink()


#: How many names :func:`claim_new_folder` tries before it gives up.
_MOST_CLAIMS: Final = 1000


def claim_new_folder(folder: Path) -> Path:
    """Create ``folder``, or the first of ``folder-2``, ``folder-3``... that no one has.

    Each is made with one ``mkdir``, which fails if it exists, so two processes
    never claim the same folder.

    Raises:
        BadInputError: Its parent cannot be created, or a folder cannot be made there.
    """
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        for number in range(1, _MOST_CLAIMS + 1):
            claimed = folder if number == 1 else folder.with_name(f"{folder.name}-{number}")
            with contextlib.suppress(FileExistsError):
                claimed.mkdir()
                return claimed
    except OSError as error:
        reason = error.strerror or str(error)
        raise BadInputError(f"{str(folder)!r} cannot be created: {reason}") from None
    raise BadInputError(f"{str(folder)!r} and {_MOST_CLAIMS - 1} more like it exist; give --out")


def _names(paths: Sequence[Path], limit: int = 3) -> str:
    names = [path.name for path in paths[:limit]]
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(names) + more


def _require_writable(folder: Path, option: str) -> None:
    """Create ``folder`` and a probe file in it; refuse (removing what was made) on failure."""
    missing = [folder, *folder.parents]
    missing = [path for path in missing if not path.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor, probe = tempfile.mkstemp(prefix=".write-probe.", dir=folder)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        for path in missing:  # innermost first: undo what this call created
            with contextlib.suppress(OSError):
                path.rmdir()
        reason = error.strerror or str(error)
        raise BadInputError(
            f"{option} {str(folder)!r} cannot be created or written: {reason}"
        ) from None

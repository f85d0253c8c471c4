"""Atomic file writes: a file is either its old content or its complete new content, never half.

Every writer of a result, checkpoint, weights file or cache manifest in the project goes through
:func:`atomic_write`: the content goes to a temporary file next to the target (same file system),
is flushed to disk, and replaces the target with one ``os.replace``. The temporary's name,
``.NAME.tmpPID-RANDOM``, cannot be guessed, and it is created exclusively (``O_EXCL``, ``O_NOFOLLOW``):
a file or symbolic link planted in the folder is never written through, and never becomes the target.
A writer that fails removes its temporary file; one killed outright (``kill -9``) leaves a temporary
whose name carries its process id, which :func:`remove_stale_temporaries` deletes on the next run
once that process is gone.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any, Callable

_TMP_MARK = ".tmp"


_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_temporary(path: Path) -> Path:
    """Create a new, empty temporary for writing ``path``: ``.NAME.tmpPID-RANDOM`` in the same folder.

    The random part (64 bits) makes the name unpredictable, and the file is created exclusively without
    following links, so whatever is planted in the folder (a symbolic link, a file) is never opened; a
    name that exists already is simply drawn again. Mode ``0o666`` less the umask, as for ``open(..., "w")``.
    """
    while True:
        tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(8)}")
        try:
            os.close(os.open(tmp, _CREATE_FLAGS, 0o666))
        except FileExistsError:
            continue
        return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp)`` to produce the file, then move it onto ``path`` in one step.

    ``write`` receives the temporary path (created empty by :func:`create_temporary`) and writes the
    content there (``torch.save``, ``Path.write_bytes``, ``Path.write_text``...). Only a regular file
    is moved onto ``path``: a temporary replaced by a link meanwhile is refused (``OSError``). On any
    exception the temporary is removed and ``path`` keeps its previous content (or stays absent).
    """
    path = Path(path)
    tmp = create_temporary(path)
    try:
        write(tmp)
        if not stat.S_ISREG(os.lstat(tmp).st_mode):
            raise OSError(f"{tmp}: the temporary of {path.name} is no longer a regular file; not moved into place")
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_gzip(path: str | Path, data: bytes) -> None:
    """Write ``data`` gzip-compressed (level 9, no time stamp: the same bytes give the same file under one Python
    version), atomically like :func:`atomic_write`."""
    packed = gzip.compress(data, compresslevel=9, mtime=0)
    atomic_write(path, lambda tmp: tmp.write_bytes(packed))


def atomic_write_json(path: str | Path, data: Any, *, indent: int | None = 1,
                      default: Callable[[Any], Any] | None = None) -> None:
    """Atomically write ``data`` as JSON to ``path`` (``default`` as in :func:`json.dumps`)."""
    atomic_write_text(path, json.dumps(data, indent=indent, default=default))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this process counts; one owned by another user too)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


#: ``.NAME.tmpPID-RANDOM`` (:func:`create_temporary`), and ``.NAME.tmpPID`` left by writers before the random part
_TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)(?:-[0-9a-f]+)?$")


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete the temporaries that writers killed in ``folder`` left behind (their process is gone).

    Returns the removed paths. Temporaries of live processes (a concurrent writer) are kept.
    """
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        m = _TMP_RE.match(entry.name)
        if m is None or entry.is_symlink() or not entry.is_file():
            continue
        if not pid_alive(int(m.group("pid"))):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def recorded_path(path: str | Path) -> str:
    """``path`` as metadata written into a file records it: relative to the working directory when it lies below
    it (a head file committed from a checkout then names no host's folders; ``./name`` one level down), else as
    given."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    for mine, here in ((lambda: Path(os.path.abspath(p)), lambda: Path(os.path.abspath(os.getcwd()))),
                       (p.resolve, lambda: Path.cwd().resolve())):  # as written first: a linked cache stays inside
        try:
            rel = mine().relative_to(here())
        except (ValueError, OSError):
            continue
        # "./" keeps a one-part name a path (a bare name reads as a corpus inside the cache: distill's --corpus)
        return str(rel) if len(rel.parts) > 1 else f"./{rel}"
    return str(p)

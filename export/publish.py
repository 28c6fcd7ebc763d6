"""Publishing an artifact: a directory that holds, at every instant, the previous complete artifact or the new one.

The export writes the new artifact whole into a staging directory beside the artifact directory (same filesystem),
syncs it, and swaps the two in one ``renameat2(RENAME_EXCHANGE)``: a reader, a server loading, or an export killed
at any instant (SIGKILL, an OOM, a power cut) finds one complete artifact or the other, never a mix and never none.
What else the directory held (a parity report, say) is hard-linked into the new one first. The old artifact, now in
the staging directory, is removed after the swap; a staging directory left by an export that died is removed by the
next export into the same directory.

Where the swap cannot be made (the artifact directory is a mount point, the filesystem has no RENAME_EXCHANGE, the
parent directory is not writable) the files are moved in one by one, the manifest last: a reader never sees a
manifest describing another graph, but an export killed mid-way leaves no manifest; that is logged.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from addnorm.model.artifact import MANIFEST_FILE

log = logging.getLogger("addnorm.export")
RENAME_EXCHANGE = 2  # linux/fs.h
STALE_S = 3600  # a staging directory of unknown owner (an older export's) this old is abandoned


def staging_for(out_dir: Path) -> tuple[Path, bool]:
    """A new staging directory for ``out_dir``, and whether it sits beside it (a swap can publish it) rather than
    inside it. Removes what dead exports left behind first."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out_dir)
    prefix = f".{out_dir.name}.staging-{os.getpid()}-"
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir.parent)), True
    except OSError as exc:  # the parent is not writable (a volume mounted at out_dir): stage inside it
        log.warning("cannot stage beside %s (%s): publishing file by file", out_dir, exc.strerror)
        out_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".staging-{os.getpid()}-", dir=out_dir)), False


def clean_stale(out_dir: Path) -> None:
    """Remove the staging directories of exports into ``out_dir`` whose process is gone."""
    candidates = list(out_dir.parent.glob(f".{out_dir.name}.staging-*"))
    if out_dir.is_dir():
        candidates += out_dir.glob(".staging-*")
    for path in candidates:
        if path.is_dir() and not _owner_alive(path):
            log.info("removing %s, left by an export that did not finish", path)
            shutil.rmtree(path, ignore_errors=True)


def _owner_alive(path: Path) -> bool:
    parts = path.name.split("staging-", 1)[1].split("-", 1)
    if len(parts) == 2 and parts[0].isdigit():
        try:
            os.kill(int(parts[0]), 0)  # signal 0: whether the process exists (this one included)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            pass
        return True
    with contextlib.suppress(OSError):  # an older export's name, without its pid
        return time.time() - path.stat().st_mtime < STALE_S
    return False


def publish(staging: Path, out_dir: Path, files: tuple[str, ...], beside: bool) -> None:
    """Make ``staging``'s ``files`` (the manifest among them) the artifact in ``out_dir``, durably."""
    for name in files:
        os.chmod(staging / name, 0o644)  # readable by the serving user (safetensors writes 0600)
        _fsync(staging / name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # a directory as mkdir makes it (mkdtemp's is 0700)
    if beside and not out_dir.exists():
        _fsync(staging)
        os.rename(staging, out_dir)
        _fsync(out_dir.parent)
        return
    if beside:
        _link_the_rest(out_dir, staging, files)
        _fsync(staging)
        try:
            _exchange(staging, out_dir)
        except OSError as exc:
            log.warning("cannot swap %s in one step (%s): publishing file by file", out_dir, exc.strerror)
        else:
            _fsync(out_dir.parent)
            shutil.rmtree(staging, ignore_errors=True)  # the previous artifact
            return
    _file_by_file(staging, out_dir, files)


def _file_by_file(staging: Path, out_dir: Path, files: tuple[str, ...]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # never an old manifest beside a new graph
    for name in (*[f for f in files if f != MANIFEST_FILE], MANIFEST_FILE):
        os.replace(staging / name, out_dir / name)
    _fsync(out_dir)


def _link_the_rest(out_dir: Path, staging: Path, files: tuple[str, ...]) -> None:
    """Hard-link into ``staging`` whatever ``out_dir`` holds besides the artifact's own files (a report directory,
    a README of the user's), so the swap keeps it."""
    for entry in out_dir.iterdir():
        if entry.name in files or entry.name.startswith(".staging-"):
            continue
        target = staging / entry.name
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, copy_function=os.link, symlinks=True)
        else:
            os.link(entry, target, follow_symlinks=False)


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); raises OSError where it cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

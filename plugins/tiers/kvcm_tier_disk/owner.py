"""Crash safety of the disk tier: per-owner directories held by an ``flock``, and the sweep
that removes those whose owner died.

Every disk tier keeps its temporary (anonymous) pool files in an *owner directory* that
holds a file named ``lock``, ``flock``-ed for as long as the tier is open. The kernel drops
the lock when the process dies, however it dies (``kill -9`` included), so a directory
whose lock can be taken belongs to nobody and is removed by the next tier that starts in
the same place: its sweep.

- With ``path``: the owner directory is ``<path>/kvcm-owner-<random>``; the sweep looks at
  ``<path>/kvcm-owner-*``. Named pools stay in ``path`` itself (they persist by design).
- Without ``path``: the private temporary directory ``<tmp>/kvcm-disk-<random>`` is the
  owner directory; the sweep looks at ``<tmp>/kvcm-disk-*``.

The lock file is created under a temporary name, locked, then renamed to ``lock``, so a
sweep never sees an unlocked ``lock`` of a live owner; a directory without ``lock`` (one
being created) is left alone. Only directories owned by this user are considered.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile

import attrs

__all__ = ["OWNER_PREFIX", "PRIVATE_PREFIX", "OwnerLock", "Swept", "sweep"]

#: Owner directories under a tier's ``path``.
OWNER_PREFIX = "kvcm-owner-"
#: Private directories (tiers without ``path``) under the system temporary directory.
PRIVATE_PREFIX = "kvcm-disk-"
LOCK_NAME = "lock"

log = logging.getLogger("kvcm.disk")


@attrs.frozen
class Swept:
    """What one sweep removed: directories of dead owners and the bytes they held."""

    directories: tuple[str, ...] = ()
    nbytes: int = 0
    failures: tuple[str, ...] = ()


def _open_flags() -> int:
    return os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class OwnerLock:
    """The ``lock`` file of one owner directory, held locked until :meth:`release`.

    Args:
        directory: the owner directory (just created, empty, ours).
    """

    def __init__(self, directory: str) -> None:
        staging = os.path.join(directory, f".{LOCK_NAME}-{os.getpid()}")
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(staging, os.path.join(directory, LOCK_NAME))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise
        self.fd: int | None = fd

    def release(self) -> None:
        """Close the lock file (the kernel drops the lock); idempotent."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def make_private_directory() -> str:
    """A new ``kvcm-disk-*`` directory (mode 0700) in the system temporary directory."""
    return tempfile.mkdtemp(prefix=PRIVATE_PREFIX)


def make_owner_directory(parent_fd: int, parent: str) -> str:
    """A new ``kvcm-owner-*`` directory (mode 0700) in ``parent``; returns its name."""
    for _ in range(100):
        name = OWNER_PREFIX + os.urandom(6).hex()
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            continue
        return name
    raise FileExistsError(f"no free owner directory name in {parent}")


def _dead(path: str) -> bool:
    """True when ``path`` is our directory whose ``lock`` exists and is free."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), _open_flags())
    except OSError:
        return False  # no lock yet (being created), or not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its owner is alive (in this process or another)
    finally:
        os.close(fd)
    return True


def _bytes_under(path: str) -> int:
    total = 0
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def sweep(parent: str, prefix: str) -> Swept:
    """Remove the directories ``parent/<prefix>*`` whose owner died (lock free).

    Never raises: what could not be removed is listed in ``failures``. Logs one warning
    (logger ``kvcm.disk``) when it removed anything.
    """
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix))
    except OSError:
        return Swept()
    removed: list[str] = []
    failures: list[str] = []
    nbytes = 0
    for name in names:
        path = os.path.join(parent, name)
        if not _dead(path):
            continue
        size = _bytes_under(path)
        try:
            shutil.rmtree(path)
        except OSError as exc:
            failures.append(f"{path}: {exc}")
            continue
        removed.append(path)
        nbytes += size
    if removed or failures:
        log.warning("kvcm disk tier: removed %d directories left by dead processes (%d "
                    "bytes) in %s%s", len(removed), nbytes, parent,
                    f"; could not remove: {'; '.join(failures)}" if failures else "")
    return Swept(tuple(removed), nbytes, tuple(failures))

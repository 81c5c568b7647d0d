"""Single-file helpers for code that keeps ``torch.save``."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["atomic_save", "atomic_write", "fsync_path"]


def atomic_save(obj: Any, path: str | os.PathLike[str], *, replace: bool = True) -> None:
    """``torch.save(obj, path)`` that is never seen half-written.

    The object is written to a temporary file in the same directory (so the final rename
    cannot turn into a copy across filesystems), fsynced, renamed over ``path`` with
    ``os.replace`` and the directory fsynced, so after a crash ``path`` holds either the old
    file or the new one, whole. Readers that open ``path`` while it is being saved keep
    reading the old file: the ``failed finding central directory`` race cannot happen.
    With ``replace=False`` an existing ``path`` is left as it is (see :func:`atomic_write`).
    """

    def write(tmp: str) -> None:
        with open(tmp, "xb") as f:
            torch.save(obj, f)

    atomic_write(path, write, replace=replace)


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[str], None], *, replace: bool = True
) -> None:
    """Run ``write(tmp_path)``, then make ``tmp_path`` durable and rename it to ``path``.

    The temporary file is in ``path``'s directory and removed if anything fails; the
    directory is fsynced after the rename, which is durable only then (rename(2), fsync(2)).

    With ``replace=False`` a file at ``path`` is never replaced, also one made while
    ``write`` ran: the file is published with ``link(2)``, which fails where ``path``
    exists (on a filesystem without hard links, checked just before a rename).

    Raises:
        PathExistsError: ``replace`` is false and ``path`` exists (nothing is changed).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        write(tmp)
        fsync_path(tmp)
        if replace:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(directory, directory=True)


def _publish_new(tmp: str, path: str) -> None:
    """Give ``tmp`` the name ``path`` where nothing is at ``path`` (``tmp`` is removed)."""
    from ..errors import PathExistsError

    exists = PathExistsError(f"{path}: already exists; nothing was replaced", path=path)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise exists from None
    except OSError:  # no hard links here (some FUSE and network filesystems)
        if os.path.lexists(path):
            raise exists from None
        os.rename(tmp, path)
        return
    with contextlib.suppress(OSError):  # published: a leftover name is no failure
        os.unlink(tmp)


def fsync_path(path: str, *, directory: bool = False) -> None:
    """Make a file, or a directory's entries, durable by path.

    A rename or unlink is durable only once its directory is fsynced (rename(2), fsync(2)).
    """
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

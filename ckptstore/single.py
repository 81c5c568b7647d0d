"""Single-file helpers for code that keeps ``torch.save``."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import torch

__all__ = ["atomic_save"]


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` that is never seen half-written.

    The object is written to a temporary file in the same directory (so the final rename
    cannot turn into a copy across filesystems), fsynced, renamed over ``path`` with
    ``os.replace`` and the directory fsynced, so after a crash ``path`` holds either the old
    file or the new one, whole. Readers that open ``path`` while it is being saved keep
    reading the old file: the ``failed finding central directory`` race cannot happen.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

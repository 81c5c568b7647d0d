"""fsspec backend for object stores and other filesystems without an atomic rename.

Commits are manifest-last: payloads go straight into ``step-N/`` and ``manifest.json`` is
put last, in one request; readers look only at manifests, so the step is invisible until
that request completes. Deletion removes the manifest first.
"""

from __future__ import annotations

import io
import posixpath
from typing import IO, Any, ClassVar

from .base import Storage

__all__ = ["FsspecStorage"]


class FsspecStorage(Storage):
    """A store on any fsspec filesystem (``s3://``, ``gs://``, ``memory://`` ...)."""

    atomic_rename: ClassVar[bool] = False
    lockable: ClassVar[bool] = False

    def __init__(self, fs: Any, path: str, url: str) -> None:
        super().__init__(url.rstrip("/"))
        self.fs = fs
        self.path = path.rstrip("/")

    def _p(self, rel: str) -> str:
        return posixpath.join(self.path, rel) if rel else self.path

    def _list(self, rel: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(rel), detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except TypeError:  # filesystems whose ls takes no refresh
            try:
                entries = self.fs.ls(self._p(rel), detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
        base = self._p(rel).rstrip("/")
        names = []
        for e in entries:
            e = str(e).rstrip("/")
            name = posixpath.basename(e)
            if name and e != base:
                names.append(name)
        return names

    def list_steps(self) -> list[int]:
        """One listing of ``step-*/manifest.json`` instead of a request per step."""
        from ..layout import MANIFEST_NAME, parse_step_dirname

        try:
            found = self.fs.find(self.path, maxdepth=2, withdirs=False)
        except FileNotFoundError:
            return []
        root = self.path.strip("/")
        steps = set()
        for p in found:
            p = str(p)
            parent = posixpath.dirname(p)
            if (
                posixpath.basename(p) != MANIFEST_NAME
                or posixpath.dirname(parent).strip("/") != root
            ):
                continue
            step = parse_step_dirname(posixpath.basename(parent))
            if step is not None:
                steps.add(step)
        return sorted(steps)

    def _exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._p(rel)))

    def _is_regular_file(self, rel: str) -> bool:
        try:
            return bool(self.fs.isfile(self._p(rel)))
        except (FileNotFoundError, OSError):
            return False

    def _size(self, rel: str) -> int:
        return int(self.fs.size(self._p(rel)))

    def _mkdir(self, rel: str) -> None:
        self.fs.makedirs(self._p(rel), exist_ok=True)

    def _open_write(self, rel: str) -> IO[bytes]:
        return self.fs.open(self._p(rel), "wb")  # type: ignore[no-any-return]

    def _finish_write(self, f: IO[bytes], rel: str) -> None:
        f.close()  # for object stores, close() is the (final part of the) upload

    def _put_small(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(rel), data)

    def _open_read(self, rel: str) -> IO[bytes]:
        f = self.fs.open(self._p(rel), "rb")
        if not hasattr(f, "readinto"):
            f = io.BufferedReader(f)
        return f  # type: ignore[no-any-return]

    def _remove(self, rel: str) -> None:
        self.fs.rm_file(self._p(rel))

    def _rmtree(self, rel: str) -> None:
        self.fs.rm(self._p(rel), recursive=True)

"""Reading a committed step's ``manifest.json`` (bounded, validated) and its rank table.

:meth:`ckptstore.storage.base.Storage.read_manifest` is this, for every backend.
"""

from __future__ import annotations

from typing import Any

from .. import ranktable
from ..errors import CkptStoreError, ManifestError
from ..layout import MANIFEST_NAME, step_dirname
from ..manifest import MAX_MANIFEST_BYTES, Manifest
from .reach import unanswered

__all__ = ["read", "read_bytes"]


def read(storage: Any, step: int, *, table: bool = True) -> Manifest:
    """The manifest of ``step`` in ``storage``, validated; with ``table`` its rank table too.

    ``storage``: a :class:`~ckptstore.storage.base.Storage` (its primitives are what is used).

    Raises:
        ManifestError: absent, unreadable, malformed or hostile.
    """
    rel = f"{step_dirname(step)}/{MANIFEST_NAME}"
    where = storage.describe(step, MANIFEST_NAME)
    try:
        if not storage._is_regular_file(rel):
            raise ManifestError(f"{where}: missing or not a regular file")
        data = read_bytes(storage, rel, where)
    except CkptStoreError:  # the store gave no answer (StoreUnreachableError): not a bad step
        raise
    except OSError as e:
        refused = unanswered(storage, e, rel)  # an object store's 403 or failing 5xx
        if refused is not None:
            raise refused from e
        raise ManifestError(f"{where}: unreadable ({e})") from None
    m = Manifest.from_bytes(data, where=where)
    if m.step != step:
        raise ManifestError(f"{where}: manifest says step {m.step}, directory says {step}")
    return ranktable.read_table(storage, m) if table else m


def read_bytes(storage: Any, rel: str, where: str) -> bytes:
    """The bytes of the manifest at ``rel``, at most :data:`MAX_MANIFEST_BYTES` (+1) of them.

    Raises:
        ManifestError: larger than any real manifest (``where`` names it).
        OSError: it could not be read.
    """
    size = storage._size(rel)
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {size} bytes is larger than any real manifest")
    with storage._open_read(rel) as f:
        # Ask for the size it has, not the most it may have: a raw read allocates all it
        # is asked for (64 MiB a manifest); one that grew is read on.
        data: bytes = f.read(size + 1)
        if len(data) > size:
            data += f.read(MAX_MANIFEST_BYTES - size)
    return data

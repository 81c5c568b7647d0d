"""Opening an existing store from outside a training job, and saying why when there is none.

A training job's :class:`~ckptstore.CheckpointManager` creates its root. Everything that
reads or maintains a store afterwards (``ckptstore ls``, ``verify``, ``prune``, ``gc``,
``rm``, ``inspect``, ...) must not: a mistyped path, ``/etc`` or a bucket that does not
exist is "no store there", never an empty store with a fresh lock file in it (issue 12).

A root is a store when it holds an entry of the layout (``step-N``, ``.tmp-``/``.trash-``
entries, the lock or the listing cache), or (a local directory) nothing at all: a store with
no checkpoint yet. An object store has no empty directories, so a prefix with nothing under
it is no store (a mistyped prefix says so, as a missing bucket does).
A directory that holds none of those but has stores inside it, one per ``*.ckpt`` name as
the Lightning integration writes them, is listed by :func:`find_stores`.

Errors reaching an object store (no credentials, an endpoint that does not answer, access
denied) become one :class:`~ckptstore.errors.CkptStoreError` line that says what to check.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import IntegrityError, NoCheckpointError
from ..layout import (
    INDEX_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    is_garbage_name,
    parse_old_dirname,
    parse_step_dirname,
)
from ..manifest import Manifest
from ..storage import LocalStorage, Storage, open_storage
from ..storage.reach import reaching, remote_error
from ..tiers import nodes

__all__ = [
    "committed_step",
    "find_stores",
    "is_local",
    "missing_bucket",
    "open_store",
    "reaching",
    "remote_error",
]


def is_local(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` names a local path (a plain path or a ``file://`` URL)."""
    protocol, sep, _ = os.fspath(root).partition("://")
    return not sep or protocol in ("file", "local")


def _is_store_entry(name: str) -> bool:
    return (
        parse_step_dirname(name) is not None
        or is_garbage_name(name)
        or parse_old_dirname(name) is not None
        or name in (LOCK_NAME, INDEX_NAME)
    )


def _names(storage: Storage) -> list[str]:
    """The entries of the store's root (none when it does not exist)."""
    # The base class lists only what it knows (steps, garbage); whether a root is a store
    # at all is decided by every name in it, so this reads the backend's own listing.
    if isinstance(storage, LocalStorage):
        return storage._list("")
    with reaching(storage.root):
        return storage._list("")


def missing_bucket(storage: Storage) -> str | None:
    """The bucket of an object-store root, when that bucket does not exist."""
    fs = getattr(storage, "fs", None)
    split = getattr(fs, "split_path", None)
    if fs is None or split is None:
        return None
    with reaching(storage.root):
        bucket = str(split(getattr(storage, "path", ""))[0])
        return bucket if bucket and not fs.exists(bucket) else None


def _child_stores(
    storage: Storage, names: list[str], storage_options: Mapping[str, Any] | None
) -> list[Storage]:
    """The stores directly inside ``storage``'s root, by name (Lightning's ``*.ckpt`` ones)."""
    out = []
    for name in sorted(names):
        if name.startswith("."):  # hidden: Lightning's `.P.tmp-<uuid>` siblings, and others
            continue
        if isinstance(storage, LocalStorage):
            path = os.path.join(storage.root, name)
            if os.path.islink(path) or not os.path.isdir(path):
                continue
            child: Storage = LocalStorage(path)
        else:
            child = open_storage(posixpath.join(storage.root, name), storage_options)
        try:
            names_in = _names(child)
        except OSError:  # a subdirectory we may not read (``ls /etc``) holds no store of ours
            continue
        if any(_is_store_entry(n) for n in names_in):
            out.append(child)
    return out


def find_stores(
    root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> tuple[Storage, list[Storage]]:
    """``root`` if it is a store, else the stores directly inside it; creates nothing.

    Returns:
        ``(storage of root, stores)``: ``stores`` is ``[storage of root]`` when ``root`` is a
        store (an empty local directory counts, an empty prefix does not), else the stores
        one level below it (never empty).

    Raises:
        NoCheckpointError: no such directory or bucket, nothing under an object-store
            prefix, a file, a step directory, or a directory that is neither a store nor
            holds any.
        CkptStoreError: the object store cannot be reached (credentials, endpoint, access).
        ValueError: ``storage_options`` given for a local path.
        ImportError: the fsspec backend of the URL is not installed.
    """
    storage = _open(root, storage_options)
    names = _names(storage)
    if not names or any(_is_store_entry(n) for n in names):
        if not names and not isinstance(storage, LocalStorage):
            bucket = missing_bucket(storage)
            if bucket is not None:
                raise NoCheckpointError(
                    f"{storage.root}: no store there: the bucket {bucket!r} does not exist; "
                    "check the bucket name (and the endpoint_url and region storage options)"
                )
            # An object store has no empty directories: nothing under the prefix is a typo
            # as often as not, and a store that was never saved to holds nothing to read.
            raise NoCheckpointError(
                f"{storage.root}: no store there: nothing is stored under this prefix; check "
                "the path (on an object store a store exists once its first step is saved)"
            )
        return storage, [storage]
    base = posixpath.basename(storage.root.rstrip("/"))
    step = parse_step_dirname(base)
    if step is not None and MANIFEST_NAME in names:
        parent = storage.root.rstrip("/").rpartition("/")[0]
        raise NoCheckpointError(
            f"{storage.root} is the checkpoint of step {step}, not a store; the store is {parent}"
        )
    children = _child_stores(storage, names, storage_options)
    if children:
        return storage, children
    raise NoCheckpointError(
        f"{storage.root}: no store there (it holds no step-* checkpoints and no ckptstore "
        "files); check the path"
    )


def open_store(
    root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Storage:
    """The storage of an existing store (an empty local directory counts); creates nothing.

    Raises:
        NoCheckpointError: no such directory or bucket, a file, a step directory, or a
            directory that is not a store (if it holds stores, the message names them).
        CkptStoreError: the object store cannot be reached (credentials, endpoint, access).
        ValueError: ``storage_options`` given for a local path.
        ImportError: the fsspec backend of the URL is not installed.
    """
    storage, stores = find_stores(root, storage_options)
    if stores == [storage]:
        return storage
    names = ", ".join(posixpath.basename(s.root.rstrip("/")) for s in stores)
    n = len(stores)
    raise NoCheckpointError(
        f"{storage.root}: no store there, but it holds {n} store{'s' * (n != 1)} ({names}); "
        "give one of them (`ckptstore ls` on this directory lists them all)"
    )


def _open(root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> Storage:
    storage = open_storage(root, storage_options)
    if isinstance(storage, LocalStorage):
        if not os.path.lexists(storage.root):
            raise NoCheckpointError(f"{storage.root}: no such directory")
        if not os.path.isdir(storage.root):
            raise NoCheckpointError(
                f"{storage.root}: not a directory; a store is the directory that holds the "
                "step-* checkpoints"
            )
    return storage


def committed_step(storage: Storage, step: int | None) -> int:
    """``step`` if it is committed in ``storage``; for ``None`` the newest committed step.

    Raises:
        NoCheckpointError: the store is empty, or ``step`` is not committed.
    """
    steps = storage.list_steps()
    if step is None:
        if not steps:
            raise NoCheckpointError(f"{storage.root}: no committed checkpoint")
        return steps[-1]
    if step not in steps:
        have = f"{steps[0]}..{steps[-1]} ({len(steps)} steps)" if steps else "none"
        raise NoCheckpointError(
            f"{storage.describe(step)}: no committed checkpoint (have {have}); "
            "`ckptstore ls` lists them"
        )
    return step


#: What a command run on a node's partial copy can do instead.
_COMMAND_ADVICE = (
    "Run it on the replica (the manager's replica= URL), or on a directory holding every "
    "node's files of the step"
)


@contextlib.contextmanager
def partial_copies_explained(storage: Storage, *manifests: Manifest) -> Iterator[None]:
    """Say so when a read fails on a node's partial copy of a step (node-local roots).

    ``inspect``, ``diff`` and the HF and DCP exports read a DTensor step's index parts and
    shards: on one node's root, the other nodes' ranks' files are elsewhere, and their
    absence read as damage ("missing or not a regular file") where ``verify`` said OK.

    Raises:
        IntegrityError: naming the ranks whose files live on other nodes; else the error.
    """
    try:
        yield
    except (FileNotFoundError, IntegrityError) as e:
        for m in manifests:
            err = nodes.missing_error(storage, m.step, m, e, advice=_COMMAND_ADVICE)
            if err is not e:
                raise err from e
        raise

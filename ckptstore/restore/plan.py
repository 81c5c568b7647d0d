"""Restore stage 2, plan: what this rank reads of a checkpoint.

In: the step's manifest (and, for DTensor state, its chunk index and state tree), this
rank, the world size. Out: the state file and the payload files by group that this rank
reads (:func:`layout_of`), and the DTensor leaves of the entries to decode with their chunk
index entries (:func:`dtensor_leaves`); which byte ranges of them overlap this rank's
targets is the resharding arithmetic of :mod:`ckptstore.sharded.plan`.
"""

from __future__ import annotations

from typing import Any

from ..codec import payload as payload_codec
from ..codec.tree import is_key
from ..errors import IntegrityError, ManifestError, StateMismatchError
from ..layout import state_file
from ..manifest import Manifest
from ..session import Session
from ..sharded.chunks import ChunkIndex, TensorEntry

__all__ = ["dtensor_leaves", "layout_of", "unwrap"]


def layout_of(
    session: Session, manifest: Manifest, rank: int, *, explicit: bool = False
) -> tuple[str, dict[str, list[str]]]:
    """The state file and payload files (by group) that ``rank`` reads.

    Per-rank state (``sharded=True`` without DTensors) is opaque: it restores only on
    the world size that saved it. Asking for one rank's part explicitly
    (``load(rank=r)``) is the only way to read it anywhere else.
    """
    where = session.storage.describe(manifest.step)
    per_rank = manifest.sharded and not manifest.dtensor
    if per_rank:
        if manifest.world_size != session.coord.world_size and not explicit:
            raise StateMismatchError(
                f"{where} holds per-rank state saved with sharded=True by "
                f"{manifest.world_size} ranks, and this job has {session.coord.world_size}: "
                "each rank's part is opaque, so it restores only on the same world size. "
                "Relaunch with that many ranks, or load(step, rank=r) to read one rank's "
                "part (DTensor/FSDP2 state restores on any world size)"
            )
        if not 0 <= rank < manifest.world_size:
            raise StateMismatchError(
                f"{where} has shards for ranks 0..{manifest.world_size - 1}, not {rank}"
            )
    want_rank = rank if per_rank else None
    groups = payload_codec.groups_of(manifest, want_rank)
    sname = state_file(want_rank)
    if sname not in manifest.files:
        raise ManifestError(f"{where}: manifest lists no {sname}")
    return sname, groups


def dtensor_leaves(  # noqa: PLR0917 - recursion
    node: Any,
    path: tuple[Any, ...],
    index: ChunkIndex,
    out: dict[str, tuple[tuple[Any, ...], TensorEntry]],
    where: str,
    depth: int = 0,
) -> None:
    """Collect the DTensor leaves under ``node`` (name -> (path, index entry))."""
    if depth > 300:
        raise IntegrityError(f"{where}: state nested too deeply; the file is hostile")
    if isinstance(node, list):
        for i, x in enumerate(node):
            dtensor_leaves(x, (*path, i), index, out, where, depth + 1)
        return
    if not isinstance(node, dict):
        return
    t = node.get("t")
    if t == "dtensor":
        name = node.get("name")
        entry = index.tensors.get(name) if isinstance(name, str) else None
        if entry is None or list(entry.shape) != node.get("shape"):
            raise IntegrityError(
                f"{where}: sharded tensor {name!r} at {path} is not in the chunk index as saved"
            )
        out[str(name)] = (path, entry)
    elif t in ("dict", "odict"):
        keys, vals = node.get("keys"), node.get("vals")
        if isinstance(keys, list) and isinstance(vals, list):
            if len(keys) != len(vals) or not all(is_key(k) for k in keys):
                # As the decoder refuses it, before a key is used to find a target.
                raise IntegrityError(
                    f"{where}: state at {path}: dict keys must be str or int, as many as its values"
                )
            for k, v in zip(keys, vals, strict=True):
                dtensor_leaves(v, (*path, k), index, out, where, depth + 1)
    elif t == "tuple":
        vs = node.get("v")
        if isinstance(vs, list):
            for i, x in enumerate(vs):
                dtensor_leaves(x, (*path, i), index, out, where, depth + 1)


def unwrap(node: Any) -> tuple[str | None, Any]:
    """The kind of a top-level entry (``"optimizer"``, ...; None: plain data) and its tree."""
    if isinstance(node, dict) and node.get("t") == "stateful":
        kind = node.get("kind")
        return (kind if isinstance(kind, str) else "stateful"), node.get("v")
    return None, node

"""Save stage 4, write: payload files and ``state.json`` into a pending checkpoint.

In: a pending checkpoint (its tmp directory is open) and an :class:`~.encode.Encoded`
state, or a :class:`~.jobs.ShardJob` (this rank's DTensor boxes). Out: durable files, each
with its block CRCs computed in the same pass as the write (``pending.files``), and the
manifest that describes them (:func:`make_manifest`). Nothing here makes a step visible.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._version import __version__
from ..codec import payload as payload_codec
from ..layout import state_file
from ..manifest import (
    DTENSOR_FORMAT_VERSION,
    FORMAT_VERSION,
    RANKS_FORMAT_VERSION,
    SPLIT_FORMAT_VERSION,
    STRIDED_FORMAT_VERSION,
    FileEntry,
    Manifest,
    RankTable,
    utc_now,
)
from ..sharded import plan as sharding
from ..sharded import split_index
from ..storage import Pending
from ..storage.directio import run_all
from .encode import Encoded
from .jobs import SaveOptions, ShardJob

__all__ = ["make_manifest", "versions", "write_dtensor", "write_files"]

#: Payload files written at once; more only adds contention on 2-4 cores per rank.
_WRITE_THREADS = 3
#: Below this many payload bytes a save writes its files one after another on the caller's
#: thread (a thread start costs ~0.5 ms here, longer than writing a few small files).
_INLINE_WRITE_BYTES = 4 << 20


def versions() -> dict[str, str]:
    """The versions a manifest records: ckptstore, torch, Python, safetensors."""
    out = {"ckptstore": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        import safetensors

        out["safetensors"] = safetensors.__version__
    return out


def write_files(pending: Pending, encoded: Encoded, rank: int | None, opts: SaveOptions) -> None:
    """Write every payload file and the state tree; each is durable on return.

    Files are written concurrently (the model and the optimizer, say): while one thread
    copies into its buffers, another's checksum or write runs, since both release the GIL.
    """

    def write(group: str, tensors: Mapping[str, torch.Tensor]) -> None:
        name = payload_codec.payload_name(group, opts.fmt, opts.compression, rank)
        payload_codec.write_group(
            pending, name, tensors, fmt=opts.fmt, compression=opts.compression, rank=rank
        )

    def write_tree() -> None:
        pending.write_bytes(state_file(rank), encoded.tree, codec="json", rank=rank)

    # Largest first; state.json alongside, so its fsync overlaps the payloads' too.
    groups = sorted(encoded.groups.items(), key=lambda kv: -_group_bytes(kv[1]))
    calls: list[Callable[[], None]] = [functools.partial(write, g, t) for g, t in groups]
    calls.append(write_tree)
    if sum(_group_bytes(t) for _, t in groups) < _INLINE_WRITE_BYTES:
        # A few KB to a few MB: starting threads (and handing the GIL around) costs more
        # than the writes; ext4 commits them in one journal transaction either way.
        for call in calls:
            call()
        return
    errors = run_all(calls, max_workers=_WRITE_THREADS)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def write_dtensor(
    pending: Pending, job: ShardJob, rank: int, is_leader: bool, opts: SaveOptions
) -> tuple[str, Any]:
    """Phase 1 of a DTensor save: this rank's boxes, and rank 0 the rest of the state."""
    plain = None
    if is_leader:
        # Rank 0's plain part is written alongside its shards, not after them; so is its
        # description of the DTensors made (job.describe), on a first save of the layout.
        plain = functools.partial(write_files, pending, job.encoded, None, opts)
    table = sharding.write_shards(
        pending, rank, job.boxes, job.layout, also=_in_turn(job.describe, plain)
    )
    told: dict[str, Any] = {}
    if job.split:
        # This rank's part of the index, beside its shards; rank 0 hears only how much of
        # each tensor it wrote (one number a tensor, whatever the world size).
        part = split_index.part_bytes(rank, table["chunks"])
        pending.write_bytes(split_index.part_file(rank), part, codec="json", rank=rank)
        names = job.md["meta"] if is_leader else job.md["names"]
        told["volumes"] = split_index.volumes(sorted(names), table["chunks"])
    else:
        told["packed"] = sharding.pack_table(table)
    files = {
        n: e for n, e in pending.files.items() if e.rank == rank or (is_leader and e.rank is None)
    }
    # Rank 0 keeps what it writes the index from (not sent: finish_sharded takes it out).
    md = job.md if is_leader else None
    return ("ok", {"files": files, "md": md, "split": job.split, **told})


def _in_turn(*calls: Callable[[], None] | None) -> Callable[[], None] | None:
    """One call that makes ``calls`` (the Nones left out) one after another; None if none."""
    todo = [c for c in calls if c is not None]
    if len(todo) <= 1:
        return todo[0] if todo else None

    def run() -> None:
        for c in todo:
            c()

    return run


def make_manifest(  # noqa: PLR0917 - private to the pipeline
    step: int,
    files: Mapping[str, FileEntry],
    metrics: dict[str, float],
    metadata: dict[str, Any],
    opts: SaveOptions,
    world_size: int,
    sharded: bool,
    dtensor: bool = False,
    split: bool = False,
    rank_table: RankTable | None = None,
    strided: bool = False,
) -> Manifest:
    """The manifest of a checkpoint holding ``files`` (every rank's, with a ``rank_table``).

    ``strided``: its split index spells ``_StridedShard`` placements (format 5).
    """
    return Manifest(
        step=step,
        files=dict(files),
        created=utc_now(),
        format=opts.fmt,
        world_size=world_size,
        sharded=sharded or dtensor,
        dtensor=dtensor,
        metrics=metrics,
        metadata=metadata,
        versions=versions(),
        format_version=(
            STRIDED_FORMAT_VERSION
            if rank_table is not None and strided
            else RANKS_FORMAT_VERSION
            if rank_table is not None
            else SPLIT_FORMAT_VERSION
            if split
            else DTENSOR_FORMAT_VERSION
            if dtensor
            else FORMAT_VERSION
        ),
        rank_table=rank_table,
    )


def _group_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())

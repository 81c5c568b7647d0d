"""A committed step as ``torch.distributed.checkpoint`` (DCP) items, read on demand.

Shared by ``export --dcp`` (:mod:`ckptstore.ops.export_dcp`) and the DCP ``StorageReader``
(:mod:`ckptstore.dcp`): each leaf of the stored state is an item named ``".".join(path)``,
as DCP's ``flatten_state_dict`` names the same state; a DTensor's saved chunks are its
pieces, a plain tensor is one piece, and a piece (or any box of it) is read with every byte
checked against its CRC32C first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ..codec.tree import SUPPORTED_DTYPES
from ..errors import CkptStoreError, IntegrityError
from .chunks import Chunk, read_box, read_box_into
from .consolidate import StepTensors, TensorRef

__all__ = ["DCPItem", "dcp_items", "read_piece", "read_piece_into"]


@dataclasses.dataclass(frozen=True)
class DCPItem:
    """One leaf of a step as DCP sees it.

    Attributes:
        fqn: its DCP name (``".".join(path)``).
        path: where it is in the state (top-level key first).
        ref: the tensor, not read yet; ``None`` for a value.
        value: the value (``None`` for a tensor).
        chunks: ``(offsets, sizes, chunk)`` of each saved piece: a DTensor's saved chunks;
            one piece covering a plain tensor (``chunk`` None); empty for a value.
    """

    fqn: str
    path: tuple[Any, ...]
    ref: TensorRef | None
    value: Any
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], Chunk | None], ...]

    def metadata(self) -> TensorStorageMetadata | BytesStorageMetadata:
        """DCP's description of the item."""
        if self.ref is None:
            return BytesStorageMetadata()
        return TensorStorageMetadata(
            TensorProperties(dtype=SUPPORTED_DTYPES[self.ref.dtype]),
            torch.Size(self.ref.shape),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in self.chunks],
        )


def dcp_items(src: StepTensors) -> Iterator[DCPItem]:
    """Every leaf of ``src``'s state as a DCP item, in the state's order (nothing read).

    A stored numpy array is a value (DCP's bytes item), as DCP saves one.

    Raises:
        CkptStoreError: two leaves have one DCP name (a key holding a dot).
        IntegrityError: a DTensor leaf missing from the chunk index, an unknown dtype.
    """
    seen: dict[str, tuple[Any, ...]] = {}
    for key in src.keys:
        for path, leaf in src.dcp_leaves(key):
            fqn = ".".join(map(str, path))
            if fqn in seen:
                raise CkptStoreError(
                    f"{src.where}: {path} and {seen[fqn]} have the same DCP name {fqn!r}; "
                    "DCP cannot hold both"
                )
            seen[fqn] = path
            if not isinstance(leaf, TensorRef) or leaf.node.get("t") == "ndarray":
                value = src.load(leaf) if isinstance(leaf, TensorRef) else leaf
                yield DCPItem(fqn, path, None, value, ())
                continue
            if leaf.dtype not in SUPPORTED_DTYPES:
                raise IntegrityError(f"{src.where}: tensor at {path} has dtype {leaf.dtype!r}")
            yield DCPItem(fqn, path, leaf, None, tuple(_pieces(src, leaf)))


def _pieces(
    src: StepTensors, ref: TensorRef
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], Chunk | None]]:
    if not ref.sharded:
        yield (0,) * len(ref.shape), tuple(ref.shape), None
        return
    name = ref.node.get("name")
    entry = src.index.tensors.get(name) if src.index is not None and name else None
    if entry is None:
        raise IntegrityError(f"{src.where}: sharded tensor {name!r} is not in the chunk index")
    for c in sorted(entry.chunks, key=lambda c: c.offsets):
        yield c.offsets, c.sizes, c


def read_piece(
    src: StepTensors,
    item: DCPItem,
    piece: tuple[tuple[int, ...], tuple[int, ...], Chunk | None],
    offsets: tuple[int, ...] | None = None,
    lengths: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A box of one saved piece of ``item``, every byte checked against its CRC32C first.

    ``offsets``/``lengths`` are relative to the piece (default: all of it).
    """
    _, sizes, chunk = piece
    assert item.ref is not None
    rel = offsets if offsets is not None else (0,) * len(sizes)
    size = lengths if lengths is not None else sizes
    if chunk is None:  # a plain tensor: read whole (payload files hold tensors whole)
        t: torch.Tensor = src.load(item.ref)
        for d, (o, n) in enumerate(zip(rel, size, strict=True)):
            t = t.narrow(d, o, n)
        return t
    assert src.index is not None
    dtype = SUPPORTED_DTYPES[item.ref.dtype]
    return read_box(src._read, chunk, dtype, rel, size, block=src.index.block, where=src.where)


def read_piece_into(
    src: StepTensors,
    item: DCPItem,
    piece: tuple[tuple[int, ...], tuple[int, ...], Chunk | None],
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    *,
    dest: torch.Tensor,
) -> bool:
    """Read a box of a saved DTensor chunk straight into ``dest``, then check its blocks.

    Only where ``chunks.read_box_into`` can (the box one contiguous byte range of the chunk,
    ``dest`` a contiguous CPU tensor of its dtype); returns False, having read nothing,
    otherwise (and for plain tensors, read whole from their payloads by :func:`read_piece`).
    A block that fails its CRC32C raises ``IntegrityError`` with its bytes already in
    ``dest``.
    """
    _, _, chunk = piece
    if chunk is None or item.ref is None or src.index is None:
        return False
    got = read_box_into(
        src._read_to,
        chunk,
        SUPPORTED_DTYPES[item.ref.dtype],
        offsets,
        lengths,
        dest=dest,
        block=src.index.block,
        where=src.where,
    )
    return got is not None

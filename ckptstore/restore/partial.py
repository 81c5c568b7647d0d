"""Partial loads: only the tensors asked for, read as byte ranges, each range checked.

A payload file holds every tensor of its group; an entry of the state may reference only
some of them (a tensor shared with another entry is stored once, in the first entry's
file). When a load needs only part of a file, :func:`read_some` reads its safetensors
header, then only the byte ranges of the wanted tensors, rounded out to whole blocks of
:data:`~ckptstore.integrity.BLOCK` bytes and checked against the manifest's per-block CRCs
before a byte is used. Files without block CRCs (one block or less, older manifests),
compressed files and ``torch.save`` zips are read whole instead (see :func:`can_read_some`).

Reads are ranged requests through :meth:`~ckptstore.storage.base.Storage.range_reader`
(ranged GETs on object stores), at most :data:`PIECE` bytes each, so memory stays bounded
whatever the tensors' sizes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..codec import payload as payload_codec
from ..codec import safetensors as st
from ..errors import IntegrityError
from ..integrity import BLOCK, check_blocks
from ..manifest import FileEntry

if TYPE_CHECKING:
    import torch

    from ..storage.base import Storage

__all__ = ["PIECE", "can_read_some", "read_some", "tensor_refs"]

#: Most bytes one ranged read brings in (a whole number of blocks).
PIECE = 16 * BLOCK


def tensor_refs(tree: Any) -> dict[str, set[str]]:
    """The payload entries a part of a state tree references: ``{group: {key, ...}}``.

    Tensors, arrays and views alike (a view references the tensor it views). Malformed
    nodes are skipped here; decoding them fails later with the real error.
    """
    out: dict[str, set[str]] = {}
    for node in payload_codec.payload_nodes(tree, ("tensor", "ndarray", "view")):
        group, key = node.get("file"), node.get("key")
        if isinstance(group, str) and isinstance(key, str):
            out.setdefault(group, set()).add(key)
    return out


def can_read_some(entry: FileEntry) -> bool:
    """Whether parts of this payload file can be read and checked on their own."""
    return entry.codec == "safetensors" and entry.compression is None and entry.blocks is not None


def _checked(  # noqa: PLR0917 - private, positional as RangeReader.read
    reader: Any, name: str, entry: FileEntry, lo: int, hi: int, where: str
) -> bytearray:
    """Bytes ``[lo, hi)`` of a file (``lo`` block-aligned, ``hi`` a block end), checked."""
    data: bytearray = reader.read(name, lo, hi - lo)
    if check_blocks(entry, lo, data, where) != hi - lo:
        raise IntegrityError(f"{where}: bytes {lo}..{hi} are not whole blocks")
    return data


def _spans(header: st.Header, keys: Collection[str], where: str) -> list[tuple[int, int, str]]:
    entries = header.codes
    missing = sorted(k for k in keys if k not in entries)
    if missing:
        raise IntegrityError(f"{where}: tensors {missing[:5]} missing from the payload")
    return sorted(
        (header.data_start + entries[k][2], header.data_start + entries[k][3], k) for k in keys
    )


def _pieces(spans: list[tuple[int, int, str]], size: int) -> Iterator[tuple[int, int]]:
    """Block-aligned ranges, at most :data:`PIECE` long, covering every non-empty span."""
    cur: tuple[int, int] | None = None
    for a, b, _ in spans:
        if a == b:
            continue
        lo = a // BLOCK * BLOCK
        hi = min(size, -(-b // BLOCK) * BLOCK)
        if cur is not None and lo <= cur[1]:
            cur = (cur[0], max(cur[1], hi))
            continue
        if cur is not None:
            yield from _split(*cur)
        cur = (lo, hi)
    if cur is not None:
        yield from _split(*cur)


def _split(lo: int, hi: int) -> Iterator[tuple[int, int]]:
    for a in range(lo, hi, PIECE):
        yield a, min(hi, a + PIECE)


def read_some(  # noqa: PLR0917 - as payload.read_group
    storage: Storage,
    step: int,
    name: str,
    entry: FileEntry,
    keys: Collection[str],
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the tensors ``keys`` of one payload file, and nothing else of it.

    The header's blocks are read and checked first; then the blocks around the wanted
    tensors, a :data:`PIECE` at a time, each checked before its bytes are copied into the
    tensor (one of ``into`` where dtype, shape and layout match, else a fresh one).

    Args:
        storage: the store.
        step: the checkpoint.
        name: the payload file (see :func:`can_read_some`).
        entry: its manifest row.
        keys: the tensors wanted.
        into: tensors to fill in place, by key.

    Returns:
        ``{key: tensor}`` for exactly ``keys``.

    Raises:
        IntegrityError: a block does not match its CRC, the header is invalid, or a key is
            not in the file.
    """
    import torch

    where = storage.describe(step, name)
    if not can_read_some(entry):
        msg = f"{where}: parts of it cannot be checked on their own"
        raise ValueError(msg)
    size = entry.bytes
    with storage.range_reader(step, {name: entry}) as reader:
        head = _checked(reader, name, entry, 0, min(size, BLOCK), where)
        if len(head) < 8:
            st.parse_header(head, size, where)  # raises the real problem
        n = int.from_bytes(head[:8], "little")
        if n > st.MAX_HEADER_BYTES or 8 + n > size:
            st.parse_header(head, size, where)  # raises
        if 8 + n > len(head):  # a header of more than one block (many tensors)
            hi = min(size, -(-(8 + n) // BLOCK) * BLOCK)
            head += _checked(reader, name, entry, len(head), hi, where)
        header = st.parse_header(head, size, where)
        spans = _spans(header, keys, where)
        out: dict[str, torch.Tensor] = {}
        dests: list[tuple[int, int, memoryview]] = []
        for a, b, key in spans:
            dtype, shape, _, _ = header.entries[key]
            t = (into or {}).get(key)
            if t is None or not st.fits(t, dtype, shape):
                t = torch.empty(shape, dtype=dtype)
            out[key] = t
            if b > a:
                dests.append((a, b, st.tensor_bytes(t)))
        for lo, hi in _pieces(spans, size):
            if hi <= len(head):
                data = head[lo:hi]  # already read and checked with the header
            elif lo < len(head):
                data = head[lo:] + _checked(reader, name, entry, len(head), hi, where)
            else:
                data = _checked(reader, name, entry, lo, hi, where)
            mv = memoryview(data)
            for a, b, dest in dests:
                x, y = max(a, lo), min(b, hi)
                if x < y:
                    dest[x - a : y - a] = mv[x - lo : y - lo]
    return out

"""Payload files: one group of tensors <-> one file, in either format, optionally zstd.

File names are ``<group>.safetensors`` or ``<group>.pt``, with ``.rankNNNNN`` before the
extension for per-rank shards and ``.zst`` after it when compressed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import IntegrityError
from ..integrity import BLOCK
from ..manifest import FileEntry, Manifest
from . import safetensors as st
from . import torchzip, zipstream, zstd
from .dtypes import ITEMSIZE

if TYPE_CHECKING:
    import torch

__all__ = [
    "group_of",
    "groups_of",
    "max_payload_bytes",
    "payload_name",
    "read_group",
    "stored_tensors",
    "write_group",
]

EXT = {"safetensors": ".safetensors", "torch": ".pt"}


def payload_name(group: str, fmt: str, compression: str | None, rank: int | None = None) -> str:
    """The file name of a payload group."""
    shard = f".rank{rank:05d}" if rank is not None else ""
    return f"{group}{shard}{EXT[fmt]}" + (".zst" if compression == "zstd" else "")


def group_of(name: str) -> str:
    """The group a payload file name belongs to (its first dot-separated part)."""
    return name.split(".", 1)[0]


def groups_of(manifest: Manifest, rank: int | None) -> dict[str, list[str]]:
    """The payload files of ``rank``'s state (None: the files of no rank), by group.

    What a restore reads for a state file and what ``verify`` holds it against. Files of no
    rank come from the manifest itself: a lean manifest's rank table stays unread.
    """
    groups: dict[str, list[str]] = {}
    for name, fe in (manifest.files if rank is not None else manifest.plain_files()).items():
        if fe.codec != "json" and fe.rank == rank:
            groups.setdefault(group_of(name), []).append(name)
    return groups


def _covering(t: torch.Tensor) -> torch.Tensor:
    """``torch.save`` writes a tensor's whole storage; copy views into a larger one."""
    if t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes():
        return t
    return t.clone()


@contextlib.contextmanager
def _maybe_zstd(w: Any, compression: str | None) -> Iterator[Any]:
    if compression != "zstd":
        yield w
        return
    z = zstd.ZstdSink(w)
    yield z
    z.close()


def write_group(
    pending: Any,
    name: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    fmt: str,
    compression: str | None,
    rank: int | None = None,
) -> None:
    """Write one payload file into a pending checkpoint (durable on return)."""
    with (
        pending.open(name, codec=fmt, compression=compression, rank=rank) as w,
        _maybe_zstd(w, compression) as sink,
    ):
        if fmt == "safetensors":
            st.write_safetensors(sink, tensors)
        else:
            torchzip.write_torch(sink, {k: _covering(v) for k, v in tensors.items()})


#: What a payload file may hold beyond its tensors' data, per file and per tensor: far more
#: than a safetensors header entry (name, dtype, shape, offsets) or a ``torch.save`` zip
#: member (64-byte alignment, local and central headers, its share of data.pkl) takes.
_FILE_ALLOWANCE = 1 << 20
_TENSOR_ALLOWANCE = 4096


#: How deep :func:`stored_tensors` walks (the tree codec nests at most 200 levels).
_MAX_TREE_DEPTH = 205


def payload_nodes(tree: Any, kinds: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """The nodes of a state tree whose ``"t"`` is one of ``kinds``, not descending into them.

    Bounded: nodes nested deeper than the tree codec ever writes are not visited.
    """
    todo: list[tuple[Any, int]] = [(tree, 0)]
    while todo:
        node, depth = todo.pop()
        if depth > _MAX_TREE_DEPTH:
            continue
        if isinstance(node, list):
            todo.extend((x, depth + 1) for x in node)
            continue
        if not isinstance(node, dict):
            continue
        if node.get("t") in kinds:
            yield node
            continue
        todo.extend((v, depth + 1) for v in node.values() if isinstance(v, list | dict))


def stored_tensors(tree: Any) -> dict[str, dict[str, tuple[int, int]]]:
    """The tensors a state tree keeps in payload files: ``{group: {key: (bytes, ndim)}}``.

    Read from the JSON tree alone, before any payload is: it bounds how far a compressed
    payload may inflate. Malformed nodes are skipped here; decoding them fails later with
    the real error. ``"view"`` nodes add nothing: they reference an entry stored by a
    ``"tensor"`` (or ``"ndarray"``) node. Needs no torch (``verify`` runs without it).
    """
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for node in payload_nodes(tree, ("tensor", "ndarray")):
        try:
            group, key = node["file"], node["key"]
            shape = [int(d) for d in node["shape"]]
            itemsize = ITEMSIZE[node["dtype"]]
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        if isinstance(group, str) and isinstance(key, str):
            size = (max(0, math.prod(shape)) * itemsize, len(shape))
            entries = out.setdefault(group, {})
            entries[key] = max(entries.get(key, (0, 0)), size)
    return out


def max_payload_bytes(tensors: Mapping[str, tuple[int, int]]) -> int:
    """The most bytes a payload file of ``tensors`` can hold, decompressed.

    Args:
        tensors: ``{key: (data bytes, ndim)}``, as :func:`stored_tensors` gives them.

    Returns:
        Their data, plus a generous allowance for the container of either format.
    """
    return _FILE_ALLOWANCE + sum(
        size + _TENSOR_ALLOWANCE + 4 * len(key) + 64 * ndim for key, (size, ndim) in tensors.items()
    )


def decompressed(data: bytearray, entry: FileEntry, where: str, limit: int | None) -> bytearray:
    """The payload file inside ``data`` (the bytes on disk, already checksummed).

    A compressed file is inflated only as far as ``limit`` (see :func:`max_payload_bytes`)
    and, for safetensors, as its own header declares: anything beyond is corruption.

    Raises:
        IntegrityError: the stream is corrupt or truncated, or inflates past its bound.
    """
    if entry.compression != "zstd":
        return data
    declared = None
    if entry.codec == "safetensors":

        def declared(out: bytearray) -> int | None:
            return st.declared_size(out, where)

    return zstd.decompress(
        data, where, limit=limit, why="its tensors in the state file can take", declared=declared
    )


def decode_payload(
    data: bytearray, entry: FileEntry, where: str, *, limit: int | None = None
) -> dict[str, torch.Tensor]:
    """Decode the (already checksummed) bytes of a payload file into tensors.

    ``limit`` bounds a compressed file (see :func:`decompressed`); pass it for every file
    that comes from a store.
    """
    data = decompressed(data, entry, where, limit)
    if entry.codec == "safetensors":
        return st.read_tensors(data, where)
    if entry.codec == "torch":
        return torchzip.load_tensor_dict(data, where)
    raise IntegrityError(f"{where}: codec {entry.codec!r} does not hold tensors")


def read_group(
    storage: Any,
    step: int,
    name: str,
    entry: FileEntry,
    into: Mapping[str, torch.Tensor] | None = None,
    *,
    limit: int | None = None,
    checked: bool = True,
) -> dict[str, torch.Tensor]:
    """Read, checksum and decode one payload file.

    An uncompressed file is decoded while it streams in, each tensor's bytes going straight
    into the matching tensor of ``into`` (same dtype, shape, contiguous, CPU) or a fresh one.
    With ``checked`` (the default) a tensor of ``into`` receives only bytes whose checksum
    passed: a file with per-block CRCs (``entry.blocks``) streams block by block, each one
    checked before its bytes are copied; a file of one block is read whole and checked
    first; an old file of several blocks without block CRCs is decoded into fresh tensors
    (checked when its last byte is in). ``checked=False`` (``restore(in_place=True)``)
    streams into ``into`` in every case. Compressed payloads inflate as they stream (see
    :func:`_read_zstd`), the compressed bytes checked the same way before they inflate, at
    most to ``limit`` bytes (see :func:`max_payload_bytes`).

    Raises:
        IntegrityError: the file is missing, corrupt or malformed (the message names the
            file, and the block where there are block CRCs).
    """
    where = storage.describe(step, name)
    if entry.compression is None and entry.codec in ("safetensors", "torch"):
        if checked and entry.blocks is None:
            if entry.bytes <= BLOCK:  # read and checked whole, then copied into the targets
                data = storage.read_file(step, name, entry)
                return _decode_buffer(data, entry, where, into)
            into = None  # an old manifest: fresh tensors, trusted once the file checks out
        if entry.codec == "safetensors":
            dec: Any = st.StreamDecoder(entry.bytes, where, into, prefault=True)
        else:
            dec = zipstream.open_stream(storage, step, name, entry, into)
            if dec is None:  # not laid out as torch.save writes: the whole-file path
                data = storage.read_file(step, name, entry)
                return decode_payload(data, entry, where, limit=limit)
        try:
            storage.stream_file(step, name, entry, dec)
        except zipstream.NotStreamable:  # found out while streaming: read it whole
            data = storage.read_file(step, name, entry)
            return decode_payload(data, entry, where, limit=limit)
        finally:
            if isinstance(dec, st.StreamDecoder):
                dec.close()  # its prefault thread, joined before a tensor it fills may go
        return dict(dec.result())
    if entry.compression == "zstd" and entry.codec in ("safetensors", "torch"):
        if checked and entry.blocks is None and entry.bytes > BLOCK:
            into = None  # an old manifest: checked only at its end, so fresh tensors
        try:
            return _read_zstd(storage, step, name, entry, into, limit)
        except zipstream.NotStreamable:  # not laid out as torch.save writes: read it whole
            data = storage.read_file(step, name, entry)
            return decode_payload(data, entry, where, limit=limit)
    data = storage.read_file(step, name, entry)
    return decode_payload(data, entry, where, limit=limit)


class _ZstdTarget:
    """Where a compressed payload's content goes as it inflates.

    A safetensors file streams into its tensors (``into``'s own where they match) through
    :class:`~ckptstore.codec.safetensors.StreamDecoder`, made once the header has declared
    the file's size; a ``torch.save`` zip, whose directory is at its end, through
    :class:`~ckptstore.codec.zipstream.SequentialDecoder`, which follows its members front
    to back and checks the directory last. Neither holds the file.
    """

    def __init__(
        self,
        entry: FileEntry,
        where: str,
        into: Mapping[str, torch.Tensor] | None,
        declared: _Declared | None = None,
        limit: int | None = None,
    ) -> None:
        self.entry = entry
        self.where = where
        self.into = into
        self.declared = declared
        self.inflater: zstd.Inflater | None = None
        self.decoder: st.StreamDecoder | None = None
        self.zip: zipstream.SequentialDecoder | None = None
        if entry.codec == "torch":
            self.zip = zipstream.SequentialDecoder(where, into, limit)
        self.buf = bytearray()

    def __call__(self, piece: memoryview) -> None:
        assert self.inflater is not None
        if self.zip is not None:
            self.zip(self.inflater.out, piece)
            return
        size = self.inflater.declared_size
        if size is not None:
            if self.decoder is None:
                header = self.declared.header if self.declared is not None else None
                self.decoder = st.StreamDecoder(size, self.where, self.into, header=header)
            self.decoder(self.inflater.out, piece)
        else:
            self.buf += piece

    def result(self) -> dict[str, torch.Tensor]:
        assert self.inflater is not None
        if self.zip is not None:
            return self.zip.result()
        size = self.inflater.declared_size
        if self.decoder is None or size is None:
            return st.read_tensors(self.buf, self.where)  # raises what is wrong with it
        if self.inflater.out != size:
            raise IntegrityError(
                f"{self.where}: zstd stream inflates to {self.inflater.out} bytes, its "
                f"safetensors header declares {size}; the file is truncated or corrupt"
            )
        return self.decoder.result()


def _read_zstd(  # noqa: PLR0917 - private, one call site
    storage: Any,
    step: int,
    name: str,
    entry: FileEntry,
    into: Mapping[str, torch.Tensor] | None,
    limit: int | None,
) -> dict[str, torch.Tensor]:
    """Stream a compressed payload through :class:`~ckptstore.codec.zstd.Inflater`.

    The compressed bytes are checked before they are inflated: block by block against the
    manifest's per-block CRCs where it has them (``stream_file`` passes on only verified
    blocks), whole (read first) for a file of one block or less. A large file of an older
    manifest (no block CRCs) inflates as it streams, and its checksum is checked at its end:
    until this returns, nothing it wrote may be trusted (tensors of ``into`` may hold partial
    data on error, as with ``in_place``).
    """

    def feed(inflater: zstd.Inflater) -> None:
        if entry.blocks is None and entry.bytes <= BLOCK:
            inflater.feed(storage.read_file(step, name, entry))
        else:
            # With block CRCs, stream_file hands on only bytes whose block passed.
            storage.stream_file(step, name, entry, lambda _offset, chunk: inflater.feed(chunk))

    return _inflate(storage.describe(step, name), entry, into, limit, feed)


def _inflate(
    where: str,
    entry: FileEntry,
    into: Mapping[str, torch.Tensor] | None,
    limit: int | None,
    feed: Callable[[zstd.Inflater], None],
) -> dict[str, torch.Tensor]:
    """Inflate what ``feed`` pushes into an inflater, decoding it as it streams."""
    declared = _declared(entry, where)
    target = _ZstdTarget(entry, where, into, declared, limit)
    inflater = zstd.Inflater(target, where, limit=limit, why=_WHY, declared=declared)
    target.inflater = inflater
    try:
        feed(inflater)
        inflater.finish()
    finally:
        inflater.close()
    return target.result()


_WHY = "its tensors in the state file can take"


class _Declared:
    """What bounds a safetensors file as it inflates: the size its own header declares.

    Called with the content so far (see :class:`~ckptstore.codec.zstd.Inflater`); keeps the
    validated header, so that the stream decoder does not parse it again.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.header: st.Header | None = None

    def __call__(self, out: bytearray) -> int | None:
        got = st.declared_header(out, self.where)
        if got is None:
            return None
        size, self.header = got
        return size


def _declared(entry: FileEntry, where: str) -> _Declared | None:
    """The bound of a safetensors file as it inflates (None for other codecs)."""
    return _Declared(where) if entry.codec == "safetensors" else None


def decode_bytes(
    data: bytearray,
    entry: FileEntry,
    where: str,
    into: Mapping[str, torch.Tensor] | None = None,
    *,
    limit: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a payload file held in memory (checked already: a broadcast copy).

    A compressed one inflates as it streams, a few frames at a time, into the tensors of
    ``into`` where they match (see :func:`read_group`), never into a second, inflated copy
    of the file; one not laid out as its format writes it is inflated whole instead.
    """
    if entry.compression == "zstd" and entry.codec in ("safetensors", "torch"):
        try:
            return _inflate(where, entry, into, limit, lambda inflater: inflater.feed(data))
        except zipstream.NotStreamable:
            pass
    return decode_payload(data, entry, where, limit=limit)


class _SafetensorsCheck:
    """Checks the header of an inflating safetensors file, holding only the header."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.inflater: zstd.Inflater | None = None
        self.head: bytearray | None = bytearray()

    def __call__(self, piece: memoryview) -> None:
        if self.head is None:
            return
        assert self.inflater is not None
        if self.inflater.declared_size is not None:
            # Validated already, against that size, as it declared it (declared_header).
            self.head = None
            return
        self.head += piece[: max(0, 8 + st.MAX_HEADER_BYTES - len(self.head))]

    def finish(self) -> None:
        assert self.inflater is not None
        size = self.inflater.declared_size
        if self.head is not None or size is None:
            try:  # says what is wrong with what came
                st.parse_header(self.head or b"", self.inflater.out, self.where)
            except IntegrityError:
                raise
            except ValueError:
                pass
            raise IntegrityError(f"{self.where}: safetensors header incomplete or corrupt")
        if self.inflater.out != size:
            raise IntegrityError(
                f"{self.where}: zstd stream inflates to {self.inflater.out} bytes, its "
                f"safetensors header declares {size}; the file is truncated or corrupt"
            )


def check_compressed(
    storage: Any, step: int, name: str, entry: FileEntry, limit: int
) -> st.Header | None:
    """Stream a compressed payload of a store and check what is inside (``verify``).

    The compressed bytes are checked before they inflate where the manifest has block CRCs
    (``entry.blocks``), at most to ``limit`` bytes; the content is checked as it streams
    by: a safetensors header, or every member of a ``torch.save`` zip and its directory
    (:class:`~ckptstore.codec.zipstream.ZipStreamChecker`). Held at once: a few frames,
    the read buffers and the header, never the file nor its content. A file without block
    CRCs (one block, or an older manifest) streams the same way, its checksum checked at
    its end: a mismatch is reported as such, before what the bad bytes did to the
    inflater (which stops inflating at its first error, while the checksum reads on).

    Returns:
        A safetensors file's header, validated (None for a zip).

    Raises:
        IntegrityError: a block, the checksum, the stream or the content is corrupt.
    """
    where = storage.describe(step, name)
    inflater: zstd.Inflater
    declared = _declared(entry, where)
    if entry.codec == "torch":
        zc = zipstream.ZipStreamChecker(where)

        def consume(piece: memoryview) -> None:
            zc(inflater.out, piece)

        inflater = zstd.Inflater(consume, where, limit=limit, why=_WHY)
    else:
        sc = _SafetensorsCheck(where)
        inflater = zstd.Inflater(sc, where, limit=limit, why=_WHY, declared=declared)
        sc.inflater = inflater
    failed: list[IntegrityError] = []

    def feed(_offset: int, chunk: memoryview) -> None:
        if failed:
            return
        try:
            inflater.feed(chunk)
        except IntegrityError as e:
            if entry.blocks is not None:  # checked bytes: the content is what is wrong
                raise
            failed.append(e)  # unchecked bytes: the checksum at the end says which

    try:
        storage.stream_file(step, name, entry, feed)
        if failed:
            raise failed[0]
        inflater.finish()
    finally:
        inflater.close()
    if entry.codec == "torch":
        zc.finish()
        return None
    sc.finish()
    return declared.header if declared is not None else None


def _decode_buffer(
    data: bytearray, entry: FileEntry, where: str, into: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Decode a whole, checked, uncompressed payload into ``into`` where it fits."""
    dec: Any
    if entry.codec == "safetensors":
        dec = st.StreamDecoder(len(data), where, into)
    else:
        dec = zipstream.StreamDecoder.from_buffer(data, where, into)
        if dec is None:
            return torchzip.load_tensor_dict(data, where)
    if data:
        dec(0, memoryview(data))
    return dict(dec.result())

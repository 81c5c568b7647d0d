"""``ckptstore import DCP_DIR ROOT --step N --sharded``: a DCP directory as a sharded step.

:func:`import_file` reads a ``torch.distributed.checkpoint`` directory whole in one process
and stores the full tensors: the machine needs memory for the whole model, and the step is
no longer sharded. :func:`import_dcp_sharded` instead keeps DCP's chunks and streams them:

- ``.metadata`` is read by the restricted unpickler of :mod:`.importers` (DCP's metadata
  classes only) and checked before a byte of data is read: every chunk's box inside its
  tensor, a dtype ckptstore stores, its bytes inside its file, storage for every chunk;
- each data file ``__R_K.distcp`` becomes one shard file ``_shards.rankNNNNN.safetensors`` of
  the new step (the files in name order, N = 0, 1, ...): its header is written first (every
  chunk's place is known from the metadata), then the chunks one at a time, in the order
  they lie in the DCP file. A chunk is read (one ``torch.save`` item), its zip CRCs checked,
  loaded with ``weights_only=True``, checked against the metadata (dtype, box), written, and
  its blocks' CRC32Cs computed from the same memory: one chunk in memory at a time;
- non-tensor items (DCP's ``BytesIO`` items) are loaded with ``weights_only=True`` and
  stored typed in ``state.json``; one that needs code is refused, or dropped with
  ``skip_unsafe`` (named in the notes);
- the step is format 2 (``dtensors.json`` lists every chunk, each with its file, offset and
  block CRCs), checked as a reader checks it (the chunks tile each tensor exactly, no two
  share a byte) before the manifest commits it: ``mgr.restore`` reads it on any world size,
  each rank only the chunks (and blocks) its shards overlap; ``CheckpointManager.load``
  consolidates it in one process; ``verify``/``inspect``/``export`` see every chunk.

The state keeps DCP's nesting (``planner_data``), and an optimizer's ``state`` keyed by
parameter id gets its int keys back, as :func:`import_file` does.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import zipfile
from collections.abc import Mapping
from typing import Any

import torch

from .._progress import Progress
from ..codec import payload as payload_codec
from ..codec import safetensors as safetensors_codec
from ..codec.torchzip import check_stored
from ..codec.tree import STATE_FORMAT, TreeEncoder
from ..errors import CkptStoreError, IntegrityError, PathNotFoundError, UnsafeCheckpointError
from ..integrity import SubBlocks
from ..layout import STATE_NAME
from ..sharded.chunks import (
    BLOCK,
    INDEX_FILE,
    Chunk,
    ChunkIndex,
    TensorEntry,
    block_crcs,
    dtype_name,
    shard_file,
)
from ..sharded.plan import DTensorCollector
from .importers import (
    _DROP,
    DCP_METADATA,
    ImportResult,
    _check_dcp_tensors,
    _check_planner_data,
    _chunk_box,
    _int_optimizer_keys,
    _numpy_globals,
    _one_line,
    _open_item_file,
    _prune,
    _read_dcp_metadata,
    _refused,
    _set_element,
)

__all__ = ["import_dcp_sharded"]


@dataclasses.dataclass(frozen=True, eq=False)
class _Imported:
    """A tensor item of the DCP directory, in the tree until ``state.json`` names it.

    Has what :class:`~ckptstore.sharded.plan.DTensorCollector` reads of a DTensor.
    """

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    placements: tuple[Any, ...] = ()
    requires_grad: bool = False


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One saved chunk of a tensor item: its box and where DCP put its ``torch.save``."""

    item: _Imported
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.item.dtype.itemsize


class _Encoder(TreeEncoder):
    """Encodes the imported tree: :class:`_Imported` leaves become ``dtensor`` nodes."""

    def _enc(self, v: Any, group: str, path: tuple[Any, ...], depth: int) -> Any:
        if isinstance(v, _Imported):
            assert self._dtensor is not None
            return self._dtensor(v, path)
        return super()._enc(v, group, path, depth)


def import_dcp_sharded(
    source: str | os.PathLike[str],
    root: str | os.PathLike[str],
    step: int,
    *,
    skip_unsafe: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> ImportResult:
    """Commit the DCP directory ``source`` as step ``step`` of ``root``, keeping its chunks.

    See the module docstring; peak memory is about two of the largest chunk (its ``torch.save``
    bytes and the tensor loaded from them).

    Raises:
        CkptStoreError: ``source`` is not a DCP directory written by ``FileSystemWriter``, or
            holds an item that needs code to load (see ``skip_unsafe``), or an item
            transformed by a DCP extension (compressed: import it without ``--sharded``).
        IntegrityError: ``.metadata`` or a data file is corrupt, truncated or hostile;
            nothing is committed.
        StepExistsError: ``step`` is already committed.
        StoreLockedError: another process writes the store.
    """
    from ..manager import CheckpointManager  # the manager imports this module's neighbours
    from ..save.jobs import SaveOptions
    from ..save.write import make_manifest

    src = os.fspath(source)
    if not os.path.lexists(src):
        raise PathNotFoundError(f"{src}: no such file or directory", path=src)
    if not os.path.isdir(src):
        raise CkptStoreError(
            f"{src}: not a directory; --sharded imports a torch.distributed.checkpoint "
            "directory (import a file without --sharded)"
        )
    if not os.path.isfile(os.path.join(src, DCP_METADATA)):
        raise CkptStoreError(
            f"{src}: a directory without {DCP_METADATA} is not a torch.distributed.checkpoint "
            "checkpoint"
        )
    report = progress or (lambda done, total, what: None)
    md = _read_dcp_metadata(src)
    _check_planner_data(src, md)
    _check_dcp_tensors(src, md)  # the source named, before a chunk index is written
    items, pieces, values, notes = _plan(src, md, skip_unsafe)
    tree: dict[Any, Any] = {}
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    for fqn in md.state_dict_metadata:
        where = planner_data.get(fqn)
        path = tuple(where) if isinstance(where, tuple | list) and where else (fqn,)
        if not all(isinstance(p, str | int) and not isinstance(p, bool) for p in path):
            raise IntegrityError(f"{src}/{DCP_METADATA}: item {fqn!r} has a bad path {path!r}")
        value = values[fqn] if fqn in values else items[fqn]
        _set_element(tree, path, value, limit=len(md.state_dict_metadata))
    dropped: list[str] = []
    pruned = _prune(tree, lambda v: v is _DROP, "", dropped, 0)
    notes += [f"dropped entry {p}: it needs code to load" for p in dropped]
    notes += _int_optimizer_keys(pruned)
    collector = DTensorCollector()
    enc = _Encoder(dtensor=collector)
    keys = list(pruned)
    nodes = [enc.encode(v, group=f"g{i}", path=(k,)) for i, (k, v) in enumerate(pruned.items())]
    # Tensors inside a value DCP saved whole (a tuple, a list of plain values) are no
    # items of their own: they go into payload files, as a save's plain tensors do.
    plain = enc.finish(lambda path: "/".join(map(str, path)))
    state_json = json.dumps(
        {"ckptstore_state": STATE_FORMAT, "root": {"t": "dict", "keys": keys, "vals": nodes}},
        separators=(",", ":"),
        allow_nan=False,
    ).encode()
    names = {id(t): name for name, t in collector.flat.items()}
    lost = [fqn for fqn, t in items.items() if id(t) not in names]
    if lost:  # two items with one path in planner_data: one would vanish without a word
        raise IntegrityError(
            f"{src}/{DCP_METADATA}: items {lost[:5]} share their place in the state with "
            "another item; refused"
        )

    by_file: dict[str, list[_Piece]] = {}
    for ps in pieces.values():
        for p in ps:
            if id(p.item) in names:  # not dropped
                by_file.setdefault(p.file, []).append(p)
    total = sum(p.nbytes for ps in by_file.values() for p in ps)
    mgr = CheckpointManager(root, keep=None, storage_options=storage_options, distributed=False)
    with mgr:
        storage = mgr.storage
        where = storage.describe(step)
        mgr._session.take_lock()  # the store's writer, as mgr.save would be
        pending = storage.begin(step)
        try:
            done = 0
            entries: dict[str, list[Chunk]] = {}
            for rank, rel in enumerate(sorted(by_file)):
                group = sorted(by_file[rel], key=lambda p: p.offset)
                for p, chunk in _write_file(pending, src, rank, group, names):
                    entries.setdefault(names[id(p.item)], []).append(chunk)
                    done += p.nbytes
                    report(done, total, f"{p.item.fqn} ({rel})")
            index = ChunkIndex(
                {
                    name: TensorEntry(dtype_name(t.dtype), t.shape, tuple(entries.get(name, ())))
                    for name, t in collector.flat.items()
                }
            )
            for stem, tensors in plain.items():
                payload_codec.write_group(
                    pending,
                    payload_codec.payload_name(stem, "safetensors", None),
                    tensors,
                    fmt="safetensors",
                    compression=None,
                )
            data = index.to_bytes()
            # The checks every reader makes (exact cover, no shared byte, inside the files).
            ChunkIndex.from_bytes(data, pending.files, f"{where}/{INDEX_FILE}")
            pending.write_bytes(INDEX_FILE, data, codec="json")
            pending.write_bytes(STATE_NAME, state_json, codec="json")
            opts = SaveOptions("safetensors", None, False, False, mgr.barrier_timeout)
            meta = {"imported_from": os.path.abspath(src), "imported_as": "dcp-sharded"}
            manifest = make_manifest(
                step,
                pending.files,
                {},
                meta,
                opts,
                max(1, len(by_file)),
                sharded=True,
                dtensor=True,
            )
            storage.commit(pending, manifest)
        except BaseException:
            storage.abort(pending)
            raise
        mgr._session.committed(manifest)
    return ImportResult(
        source=src,
        where=where,
        step=step,
        keys=[str(k) for k in keys],
        bytes=manifest.total_bytes,
        notes=notes,
        kind="dcp-sharded",
    )


def _plan(
    src: str, md: Any, skip_unsafe: bool
) -> tuple[dict[str, _Imported], dict[str, list[_Piece]], dict[str, Any], list[str]]:
    """Every tensor item, its chunks (checked against the metadata), and every value, loaded."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    meta_at = f"{src}/{DCP_METADATA}"
    sizes: dict[str, int] = {}
    items: dict[str, _Imported] = {}
    pieces: dict[str, list[_Piece]] = {}
    values: dict[str, Any] = {}
    refused: list[str] = []

    def info_of(fqn: str, offsets: tuple[int, ...] | None) -> Any:
        key = MetadataIndex(fqn, torch.Size(offsets) if offsets is not None else None)
        info = md.storage_data.get(key)
        if info is None:
            raise IntegrityError(f"{meta_at}: no storage for item {fqn!r} at {offsets}")
        if info.transform_descriptors:
            raise CkptStoreError(
                f"{src}: item {fqn!r} was transformed by a DCP extension "
                f"({', '.join(map(str, info.transform_descriptors))}); import the directory "
                "without --sharded, through DCP's own reader"
            )
        rel = info.relative_path
        if rel not in sizes:
            fd = _open_item_file(src, rel)
            try:
                sizes[rel] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        offset, length = int(info.offset), int(info.length)
        if offset < 0 or length <= 0 or offset + length > sizes[rel]:
            raise IntegrityError(
                f"{src}/{rel} (item {fqn!r}): bytes {offset}..{offset + length} are beyond "
                f"the file ({sizes[rel]} bytes); the directory is truncated or corrupt"
            )
        return rel, offset, length

    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise IntegrityError(f"{meta_at}: an item named {fqn!r}")
        if isinstance(item, BytesStorageMetadata):
            rel, offset, length = info_of(fqn, None)
            blob = _read_blob(src, rel, offset, length, fqn)
            try:  # numpy's own array reconstruction allowed, as for a .pt file
                with torch.serialization.safe_globals(_numpy_globals()):
                    values[fqn] = torch.load(
                        io.BytesIO(blob), map_location="cpu", weights_only=True
                    )
            except pickle.UnpicklingError as e:
                refused.append(f"{fqn!r}{_refused(e)}")
                values[fqn] = _DROP
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise IntegrityError(f"{meta_at}: item {fqn!r} is a {type(item).__name__}")
        dtype = item.properties.dtype
        shape = tuple(int(d) for d in item.size)
        try:
            dtype_name(dtype)
        except KeyError:
            raise UnsafeCheckpointError(f"{src}: item {fqn!r} has dtype {dtype}") from None
        t = items[fqn] = _Imported(fqn, dtype, shape)
        ps = []
        for c in item.chunks:
            offs, szs = _chunk_box(c, shape, f"{meta_at}: item {fqn!r}")
            rel, offset, length = info_of(fqn, offs)
            ps.append(_Piece(t, offs, szs, rel, offset, length))
        pieces[fqn] = ps
    if refused and not skip_unsafe:
        raise CkptStoreError(
            f"{src}: DCP item(s) {', '.join(refused)} need code to load: their pickle asks for "
            "more than tensors and plain data, and ckptstore loads only with "
            "weights_only=True. Import the rest with --skip-unsafe (those entries are dropped)"
        )
    return items, pieces, values, []


def _read_blob(src: str, rel: str, offset: int, length: int, fqn: str) -> bytes:
    """One item's ``torch.save`` bytes, its zip CRCs checked (DCP keeps no checksum)."""
    where = f"{src}/{rel} (item {fqn!r})"
    fd = _open_item_file(src, rel)
    with os.fdopen(fd, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    if len(blob) != length:
        raise IntegrityError(f"{where}: the file ends inside the item")
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            check_stored(z, where)  # a deflated member is never inflated
            bad = z.testzip()
    except IntegrityError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise IntegrityError(
            f"{where}: not a valid torch.save item ({_one_line(str(e))})"
        ) from None
    if bad is not None:
        raise IntegrityError(f"{where}: CRC-32 mismatch in member {bad!r}")
    return blob


def _write_file(
    pending: Any,
    src: str,
    rank: int,
    group: list[_Piece],
    names: Mapping[int, str],
) -> list[tuple[_Piece, Chunk]]:
    """Stream ``group`` (the chunks of one DCP file, in file order) into one shard file."""
    order: list[tuple[str, torch.Tensor]] = []
    keyed: list[tuple[str, _Piece | None]] = []
    pos = 0
    for p in group:
        item = p.item.dtype.itemsize
        if pos % item:  # a box starts on a multiple of its element size (readers view it)
            pad = -pos % item
            key = f"_pad.{len(order)}"
            order.append((key, torch.empty(pad, dtype=torch.uint8, device="meta")))
            keyed.append((key, None))
            pos += pad
        key = f"{names[id(p.item)]}@{','.join(map(str, p.offsets))}"
        order.append((key, torch.empty(p.sizes, dtype=p.item.dtype, device="meta")))
        keyed.append((key, p))
        pos += p.nbytes
    head = safetensors_codec.encode_header(order)
    fname = shard_file(rank)
    out: list[tuple[_Piece, Chunk]] = []
    at = len(head)
    with pending.open(fname, codec="safetensors", rank=rank) as w:
        w.write(head)
        for (_, piece), (_, meta) in zip(keyed, order, strict=True):
            n = meta.numel() * meta.element_size()
            if piece is None:
                w.write(bytes(n))
                at += n
                continue
            p = piece
            t = _load_chunk(src, p)
            mv = safetensors_codec.tensor_bytes(t)
            # Copied by the writer (``t`` is dropped below), the chunk's block CRCs from the
            # pass that checksums the file where the writer can (every writer of ours).
            if getattr(w, "sub_blocks", False):
                sub = SubBlocks(BLOCK)
                put: Any = w.write  # a ``sub_blocks`` writer's takes ``sub`` too
                put(mv, sub)
                crcs = sub.close()
            else:
                crcs = block_crcs(mv) if n else []
                w.write(mv)
            out.append((p, Chunk(p.offsets, p.sizes, fname, at, n, tuple(crcs))))
            at += n
            del t, mv
    return out


def _load_chunk(src: str, p: _Piece) -> torch.Tensor:
    """One chunk, loaded from its checked ``torch.save`` bytes and checked against the metadata."""
    blob = _read_blob(src, p.file, p.offset, p.length, p.item.fqn)
    where = f"{src}/{p.file} (item {p.item.fqn!r} at {list(p.offsets)})"
    try:
        t = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
        raise IntegrityError(f"{where}: cannot load ({_one_line(str(e))})") from None
    if not isinstance(t, torch.Tensor) or t.dtype != p.item.dtype or tuple(t.shape) != p.sizes:
        got = f"{type(t).__name__} {getattr(t, 'dtype', '')} {list(getattr(t, 'shape', []))}"
        raise IntegrityError(
            f"{where}: holds {got}, not the {p.item.dtype} {list(p.sizes)} its metadata says"
        )
    return t.contiguous()

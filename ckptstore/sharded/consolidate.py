"""Full tensors of a committed checkpoint, one at a time: consolidation and streaming export.

:class:`StepTensors` opens one checkpoint (replicated, or DTensor on any world size) and
hands out its structure from ``state.json`` with every tensor as a :class:`TensorRef`, read
only when asked for. A DTensor is assembled into one full CPU tensor from the saved chunks
that make it up (each block checked against its CRC32C as it is read); a plain tensor of an
uncompressed safetensors payload is read from its byte range once the whole file has been
checked against the manifest's CRC32C (one streaming pass that keeps nothing in memory).
Other payloads (zstd, ``torch`` format) are read and checked one file at a time. Peak
memory is then near the largest tensor (or the largest compressed payload), never the
whole checkpoint.

:func:`iter_tensors` yields the full tensors of one entry (a model's state dict);
:func:`export_hf` writes them in the Hugging Face layout (``model-0000k-of-0000N.safetensors``
plus ``model.safetensors.index.json``) into a directory that appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..codec import payload as payload_codec
from ..codec import safetensors as st
from ..codec import strictjson
from ..codec.tree import SUPPORTED_DTYPES, TreeDecoder, is_key
from ..errors import (
    CkptStoreError,
    ConfigError,
    IntegrityError,
    ManifestError,
    PathExistsError,
    PathNotFoundError,
)
from ..layout import state_file
from ..manifest import FileEntry, Manifest
from ..ops.single import fsync_path
from ..storage.base import Storage
from ..storage.ranges import RangeReader
from . import split_index
from .chunks import INDEX_FILE, ChunkIndex
from .targets import files_read, read_into

__all__ = [
    "HF_CONFIG",
    "HF_CONFIGS_KEY",
    "HF_INDEX",
    "HF_SINGLE",
    "HFExportResult",
    "StepTensors",
    "TensorRef",
    "choose_entry",
    "export_hf",
    "iter_tensors",
    "parse_size",
    "plan_shards",
]

#: The file of a Hugging Face checkpoint that fits in one shard.
HF_SINGLE = "model.safetensors"
#: The index of a sharded Hugging Face checkpoint.
HF_INDEX = "model.safetensors.index.json"
#: The model's configuration in a Hugging Face directory: ``from_pretrained`` builds the
#: model from it (without one it builds a default model, whose sizes do not fit the weights).
HF_CONFIG = "config.json"
#: Where a checkpoint's metadata records the ``transformers`` config of its entries (the HF
#: integrations write it): ``{"hf_configs": {entry: config dict}}``.
HF_CONFIGS_KEY = "hf_configs"
#: ``--max-shard-size`` default, as ``transformers`` has it.
DEFAULT_MAX_SHARD = 5 * 10**9

_TENSOR_NODES = ("tensor", "view", "ndarray", "dtensor")
_CONTAINERS = ("dict", "odict", "tuple", "size")
_MAX_DEPTH = 250
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]i?b|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[f"{_p}b"] = 1000**_i
    _UNITS[f"{_p}ib"] = 1024**_i


def parse_size(text: str | int) -> int:
    """A size in bytes from ``5GB`` (10**9), ``500MiB`` (2**20), ``1.5GB`` or ``123``.

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.fullmatch(text)
        if m is None:
            msg = f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB, or bytes)"
            raise ConfigError(msg)
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value < 1:
        msg = f"a size must be at least 1 byte, got {text!r}"
        raise ConfigError(msg)
    return value


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor of a checkpoint, described by ``state.json`` and not read yet.

    Attributes:
        path: where it is in the state (top-level key first).
        dtype: its dtype name (``float32``).
        shape: its full shape.
        node: its ``state.json`` node.
    """

    path: tuple[Any, ...]
    dtype: str
    shape: tuple[int, ...]
    node: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)

    @property
    def sharded(self) -> bool:
        """Whether it is a DTensor, assembled from saved chunks."""
        return self.node.get("t") == "dtensor"

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        td = SUPPORTED_DTYPES.get(self.dtype)
        return math.prod(self.shape) * (td.itemsize if td is not None else 0)

    def describe(self) -> str:
        """``float32[3, 4]``."""
        return f"{self.dtype}{list(self.shape)}"


def _unwrap(node: Any) -> tuple[str | None, Any]:
    if isinstance(node, dict) and node.get("t") == "stateful":
        kind = node.get("kind")
        return (kind if isinstance(kind, str) else "stateful"), node.get("v")
    return None, node


class StepTensors:
    """The state of one committed checkpoint, its tensors read one at a time on demand.

    Works for replicated and DTensor checkpoints (on whatever world size they were saved:
    DTensors come back as full tensors), and for per-rank state saved by one rank. Per-rank
    (``sharded=True``) state of several ranks is refused: each part is opaque, and returning
    one of them as the state would be wrong.

    Use as a context manager. Nothing returned may be trusted before the call that returned
    it completed: every byte is checked against a CRC32C before it is handed out.

    Raises:
        CkptStoreError: per-rank state of several ranks.
        ManifestError, IntegrityError: the manifest, ``state.json`` or the index is corrupt.
    """

    def __init__(
        self,
        storage: Storage,
        step: int,
        *,
        manifest: Manifest | None = None,
        allow_pickle: bool = False,
    ) -> None:
        self.storage = storage
        self.step = step
        self.manifest = manifest if manifest is not None else storage.read_manifest(step)
        self.allow_pickle = allow_pickle
        self.where = storage.describe(step)
        m = self.manifest
        if m.sharding_kind == "sharded" and m.world_size > 1:
            raise CkptStoreError(
                f"{self.where} holds per-rank state saved with sharded=True by {m.world_size} "
                "ranks: each rank's part is opaque (e.g. an optimizer partition), so it cannot "
                "be consolidated into one state. Restore it on that many ranks, or read one "
                "part with CheckpointManager.load(step, rank=r); DTensor (FSDP2/TP) state "
                "consolidates"
            )
        rank = 0 if m.sharding_kind == "sharded" else None
        self._groups: dict[str, list[str]] = {}
        for name, fe in m.files.items():
            if fe.codec != "json" and fe.rank == rank:
                self._groups.setdefault(payload_codec.group_of(name), []).append(name)
        sname = state_file(rank)
        entry = m.files.get(sname)
        if entry is None:
            raise ManifestError(f"{self.where}: manifest lists no {sname}")
        self._sname = sname
        raw = storage.read_file(step, sname, entry)
        try:
            tree = strictjson.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise IntegrityError(f"{self.where}/{sname}: not valid JSON ({e})") from None
        root = tree.get("root") if isinstance(tree, dict) else None
        keys = root.get("keys") if isinstance(root, dict) else None
        vals = root.get("vals") if isinstance(root, dict) else None
        if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
            raise IntegrityError(f"{self.where}/{sname}: malformed root; the checkpoint is corrupt")
        self._vals = vals  # what each payload's tensors take (``_limit``)
        self._stored: dict[str, dict[str, tuple[int, int]]] | None = None
        self._nodes: dict[Any, Any] = {}
        self.kinds: dict[Any, str | None] = {}
        self.owners: dict[Any, Any] = {}
        for k, node in zip(keys, vals, strict=True):
            if not is_key(k):
                raise IntegrityError(f"{self.where}/{sname}: top-level key {k!r} is not str or int")
            kind, inner = _unwrap(node)
            self.kinds[k] = kind
            self._nodes[k] = inner
            if isinstance(node, dict) and "owner" in node:
                self.owners[k] = node["owner"]
        self.index: ChunkIndex | None = None
        if m.dtensor:
            ie = m.files.get(INDEX_FILE)
            if ie is None:
                raise ManifestError(f"{self.where}: manifest lists no {INDEX_FILE}")
            where = f"{self.where}/{INDEX_FILE}"
            self.index = split_index.read_index(storage, m, where)
        self._ranges: RangeReader | None = None
        self._headers: dict[str, st.Header] = {}
        self._whole: tuple[str, dict[str, torch.Tensor]] | None = None
        self.bytes_read = 0

    # ---- structure ----------------------------------------------------------------------

    @property
    def keys(self) -> list[Any]:
        """The top-level keys of the state, in stored order."""
        return list(self._nodes)

    def node(self, key: Any) -> Any:
        """The ``state.json`` node of a top-level entry (its stateful wrapper removed)."""
        return self._nodes[key]

    def leaves(self, key: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
        """Every leaf of entry ``key``: ``(path, TensorRef or decoded value)``, in tree order.

        Dicts are walked key by key and lists/tuples item by item, except that a list or
        tuple of plain values (no container, no tensor) is one leaf; empty containers are
        leaves. The RNG state of a multi-rank save is rank 0's, as ``load()`` returns it.
        """
        node = self._nodes[key]
        if self.kinds.get(key) == "rng":
            node = _per_rank0(node)
        yield from self._walk(node, (key,), 0)

    def dcp_leaves(self, key: Any) -> Iterator[tuple[tuple[str | int, ...], Any]]:
        """Every leaf of entry ``key`` as DCP's flattening sees it (``dcp.save`` would write).

        The rules of ``torch.distributed.checkpoint._traverse.traverse_state_dict``: a dict
        is walked, its keys named by their ``str`` (an int key is not a list index: DCP
        writes ints in a path for those alone), and an empty one holds no leaf; a tuple is
        one leaf, whatever it holds; a list is walked, item by item at int indices, only
        where it holds a tensor, a dict or a list that is walked, else it is one leaf.
        Walked as :meth:`leaves` does, a tuple or a list of lists was cut into leaves DCP
        has no name for (``dcp.load`` of ``x`` found only ``x.0``, ``x.1``), and int keys
        were read back as list indices (``{3: 'c'}`` came back as ``[None, None, None,
        'c']``).
        """
        node = self._nodes[key]
        if self.kinds.get(key) == "rng":
            node = _per_rank0(node)
        yield from self._walk(node, (str(key),), 0, dcp=True)

    def _walk(
        self, node: Any, path: tuple[Any, ...], depth: int, dcp: bool = False
    ) -> Iterator[tuple[Any, Any]]:
        """The leaves under ``node``: as :meth:`leaves` cuts them, or with ``dcp`` as DCP does."""
        if depth > _MAX_DEPTH:
            raise IntegrityError(f"{self.where}/{self._sname}: state nested too deeply")
        walk: list[tuple[Any, Any]] | None = None  # (path item, node) of each child, if walked
        if isinstance(node, dict):
            t = node.get("t")
            if t in _TENSOR_NODES:
                yield path, self._ref(node, path)
                return
            if t in ("dict", "odict"):
                keys, vals = node.get("keys"), node.get("vals")
                if (
                    not isinstance(keys, list)
                    or not isinstance(vals, list)
                    or not all(is_key(k) for k in keys)
                    or (dcp and len(keys) != len(vals))
                ):
                    raise IntegrityError(f"{self.where}/{self._sname}: malformed dict at {path}")
                if dcp:  # every dict walked, keys by their str; an empty one holds no leaf
                    walk = [(str(k), v) for k, v in zip(keys, vals, strict=True)]
                elif keys and len(keys) == len(vals):
                    walk = list(zip(keys, vals, strict=True))
            elif t == "tuple" and isinstance(node.get("v"), list) and not dcp:
                items = node["v"]
                if items and not all(_plain(x) for x in items):
                    walk = list(enumerate(items))
        elif isinstance(node, list):
            cut = not _dcp_terminal(node, depth) if dcp else node and not all(map(_plain, node))
            if cut:
                walk = list(enumerate(node))
        if walk is None:
            yield path, self._decoder().decode(node, path)
            return
        for k, v in walk:
            yield from self._walk(v, (*path, k), depth + 1, dcp)

    def _ref(self, node: Mapping[str, Any], path: tuple[Any, ...]) -> TensorRef:
        dtype, shape = node.get("dtype"), node.get("shape")
        if (
            not isinstance(dtype, str)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise IntegrityError(
                f"{self.where}/{self._sname}: tensor at {path} has a malformed dtype or shape"
            )
        return TensorRef(path, dtype, tuple(shape), node)

    def state_dict(self, key: Any) -> list[tuple[str, TensorRef]]:
        """The tensors of entry ``key`` as ``(name, ref)``, for a flat state dict.

        An EMA entry gives its weights. Raises :class:`CkptStoreError` when the entry is not
        a flat ``{name: tensor}`` dict.
        """
        node = self._nodes[key]
        at = f"{self.where}[{key!r}]"
        if self.kinds.get(key) == "ema":
            node = _dict_item(node, "weights") or node
        if not isinstance(node, dict) or node.get("t") not in ("dict", "odict"):
            raise CkptStoreError(
                f"{at} is not a state dict (a flat dict of tensors); export it to a .pt file "
                "instead"
            )
        keys, vals = node.get("keys"), node.get("vals")
        if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
            raise IntegrityError(f"{self.where}/{self._sname}: malformed dict at {key!r}")
        out = []
        for k, v in zip(keys, vals, strict=True):
            t = v.get("t") if isinstance(v, dict) else None
            if not isinstance(k, str) or t not in ("tensor", "view", "dtensor"):
                what = "a numpy array" if t == "ndarray" else _node_type(v)
                raise CkptStoreError(
                    f"{at}[{k!r}] is {what}, not a tensor; safetensors holds tensors only: "
                    "export to a .pt file instead"
                )
            out.append((k, self._ref(v, (key, k))))
        return out

    # ---- reading ------------------------------------------------------------------------

    def _decoder(self) -> TreeDecoder:
        # A fresh decoder per value: its cache would otherwise keep every tensor alive.
        return TreeDecoder(
            self._payload_tensor,
            allow_pickle=self.allow_pickle,
            where=f"{self.where}/{self._sname}",
            get_dtensor=self._full_dtensor,
        )

    def load(self, ref: TensorRef) -> Any:
        """Read one tensor (a numpy array for a stored numpy array), checked, on CPU."""
        return self._decoder().decode(dict(ref.node), ref.path)

    def _reader(self) -> RangeReader:
        if self._ranges is None:
            self._ranges = self.storage.range_reader(self.step, self.manifest.files)
        return self._ranges

    def _read(self, name: str, offset: int, length: int) -> bytearray:
        self.bytes_read += length
        return self._reader().read(name, offset, length)

    def _read_to(self, name: str, offset: int, bufs: list[memoryview]) -> None:
        self.bytes_read += sum(len(b) for b in bufs)
        self._reader().read_into(name, offset, bufs)

    def _full_dtensor(self, name: str, path: tuple[Any, ...]) -> torch.Tensor:
        """A DTensor leaf as one full CPU tensor, from every chunk of it."""
        entry = self.index.tensors.get(name) if self.index is not None else None
        if entry is None:
            raise IntegrityError(
                f"{self.where}: sharded tensor {name!r} at {path} is not in the chunk index"
            )
        assert self.index is not None
        whole = (tuple(0 for _ in entry.shape), entry.shape)
        for f in files_read(self.index, [name], {name: whole}):
            self._reader().check_size(f)  # before a tensor of a forged size is made
        full = torch.empty(entry.shape, dtype=entry.torch_dtype)
        read_into(self.index, {name: full}, self._read, self.where, self._read_to)
        return full

    def _header(self, name: str) -> st.Header:
        """The header of an uncompressed safetensors payload, once the file verified whole."""
        hdr = self._headers.get(name)
        if hdr is not None:
            return hdr
        entry = self.manifest.files[name]
        head = bytearray()

        def grab(offset: int, chunk: memoryview) -> None:
            mv = chunk
            while mv:
                n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
                want = 8 if len(head) < 8 else 8 + min(n, st.MAX_HEADER_BYTES)
                if len(head) >= want:
                    return
                take = mv[: want - len(head)]
                head.extend(take)
                mv = mv[len(take) :]

        # One pass over the whole file checks its CRC32C; only the header is kept.
        self.storage.stream_file(self.step, name, entry, grab)
        self.bytes_read += entry.bytes
        hdr = st.parse_header(head, entry.bytes, self.storage.describe(self.step, name))
        self._headers[name] = hdr
        return hdr

    def _payload_tensor(self, group: str, key: str) -> torch.Tensor:
        names = self._groups.get(group)
        if not names:
            raise IntegrityError(f"{self.where}: no payload file for group {group!r}")
        for n in sorted(names):
            fe = self.manifest.files[n]
            if fe.codec == "safetensors" and fe.compression is None:
                hdr = self._header(n)
                found = hdr.entries.get(key)
                if found is None:
                    continue
                dtype, shape, start, end = found
                if end == start:
                    return torch.empty(shape, dtype=dtype)
                buf = self._read(n, hdr.data_start + start, end - start)
                return torch.frombuffer(buf, dtype=dtype).reshape(shape)
            if self._whole is None or self._whole[0] != n:
                self._whole = None  # at most one whole payload in memory
                part = payload_codec.read_group(
                    self.storage, self.step, n, fe, limit=self._limit(group, fe)
                )
                self.bytes_read += fe.bytes
                self._whole = (n, part)
            t = self._whole[1].get(key)
            if t is not None:
                return t
        raise IntegrityError(f"{self.where}: tensor {key!r} missing from payload {group!r}")

    def _limit(self, group: str, entry: FileEntry) -> int | None:
        """How far a compressed payload of ``group`` may inflate (as a restore bounds it).

        What its tensors in ``state.json`` take; None for an uncompressed one, which the
        manifest's size bounds.
        """
        if entry.compression is None:
            return None
        if self._stored is None:
            self._stored = payload_codec.stored_tensors(self._vals)
        return payload_codec.max_payload_bytes(self._stored.get(group, {}))

    def close(self) -> None:
        """Close the files opened for reading."""
        if self._ranges is not None:
            self._ranges.close()
            self._ranges = None
        self._whole = None

    def __enter__(self) -> StepTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dcp_terminal(items: list[Any], depth: int) -> bool:
    """DCP's ``_is_terminal`` of a list node: no tensor, no dict, no list it would walk."""
    if depth > _MAX_DEPTH:
        raise IntegrityError("state nested too deeply")
    for x in items:
        if isinstance(x, dict) and x.get("t") in ("dict", "odict", "tensor", "view", "dtensor"):
            return False
        if isinstance(x, list) and not _dcp_terminal(x, depth + 1):
            return False
    return True


def _plain(node: Any) -> bool:
    """Whether a ``state.json`` node decodes to a plain value (no container, no tensor)."""
    if isinstance(node, list):
        return False
    if isinstance(node, dict):
        return node.get("t") not in (*_CONTAINERS, *_TENSOR_NODES)
    return True


def _node_type(node: Any) -> str:
    if isinstance(node, dict):
        return f"a {node.get('t')}"
    return "a list" if isinstance(node, list) else f"a {type(node).__name__}"


def _dict_item(node: Any, key: Any) -> Any:
    if isinstance(node, dict) and node.get("t") in ("dict", "odict"):
        keys, vals = node.get("keys"), node.get("vals")
        if isinstance(keys, list) and isinstance(vals, list) and key in keys:
            i = keys.index(key)
            return vals[i] if i < len(vals) else None
    return None


def _per_rank0(node: Any) -> Any:
    """Rank 0's RNG state of a multi-rank save (``{"per_rank": [...]}``), as ``load`` does."""
    per_rank = _dict_item(node, "per_rank")
    if isinstance(per_rank, list) and per_rank:
        return per_rank[0]
    return node


def choose_entry(kinds: Mapping[Any, str | None], key: str | None, where: str) -> Any:
    """The top-level entry to export: ``key``, else ``model``, else the only module entry.

    Raises:
        CkptStoreError: no such entry, or no way to choose one.
    """
    by_name = {str(k): k for k in kinds}
    if key is not None:
        if key not in by_name:
            raise CkptStoreError(
                f"{where} has no entry {key!r} (it holds {', '.join(by_name) or 'nothing'}); "
                "choose one with --key"
            )
        return by_name[key]
    if "model" in by_name:
        return by_name["model"]
    modules = [k for k, kind in kinds.items() if kind == "module"]
    if len(modules) == 1:
        return modules[0]
    raise CkptStoreError(
        f"{where} has no 'model' entry and {len(modules)} module entries; say which to export "
        f"with --key (entries: {', '.join(by_name) or 'none'})"
    )


def iter_tensors(
    storage: Storage, step: int, key: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full CPU tensor)`` for the state dict of one entry, one at a time.

    ``key`` defaults to ``model`` (or the only module entry); an EMA entry gives its
    weights. DTensor state is consolidated from its chunks, whatever world size saved it;
    replicated state is read as stored. Only one tensor is held at a time (plus, for zstd
    or ``torch``-format payloads, that payload file).

    Raises:
        CkptStoreError: no such entry, not a flat dict of tensors, or per-rank state.
        IntegrityError: the checkpoint is corrupt.
    """
    with StepTensors(storage, step) as src:
        k = choose_entry(src.kinds, key, src.where)
        for name, ref in src.state_dict(k):
            yield name, src.load(ref)


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split tensors, in order, into shards of at most ``max_shard_size`` bytes of data.

    A tensor larger than the limit gets a shard of its own (as ``transformers`` does).
    """
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, n in sizes:
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


@dataclasses.dataclass
class HFExportResult:
    """What :func:`export_hf` wrote."""

    out: str
    step: int
    key: str
    files: list[str]
    tensors: int
    total_size: int
    sharding: str
    world_size: int
    #: Whether ``config.json`` was written (recorded in the checkpoint, or given).
    config: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


def recorded_config(metadata: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    """The ``transformers`` config the HF integrations recorded for entry ``key``, if any."""
    configs = metadata.get(HF_CONFIGS_KEY)
    config = configs.get(key) if isinstance(configs, Mapping) else None
    return dict(config) if isinstance(config, Mapping) else None


def _shard_name(i: int, n: int) -> str:
    return HF_SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _check_out_dir(out_dir: str) -> str:
    """The parent of ``out_dir``; refuses an existing non-empty ``out_dir``."""
    if os.path.lexists(out_dir):
        if os.path.islink(out_dir) or not os.path.isdir(out_dir):
            raise PathExistsError(f"{out_dir}: exists and is not a directory", path=out_dir)
        if os.listdir(out_dir):
            msg = f"{out_dir}: exists and is not empty; choose a new directory"
            raise PathExistsError(msg, path=out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise PathNotFoundError(f"{parent}: no such directory", path=parent)
    return parent


@contextlib.contextmanager
def new_dir_aside(out: str) -> Iterator[str]:
    """A hidden sibling of ``out`` to fill; renamed to ``out`` when the block ends well.

    ``out`` must not exist, or be an empty directory (checked first). On success the sibling
    is fsynced and renamed into place, and the parent fsynced: ``out`` appears whole or not
    at all. On any error the sibling is removed and nothing is left.
    """
    parent = _check_out_dir(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex}")
    os.mkdir(tmp)
    try:
        yield tmp
        fsync_path(tmp, directory=True)
        # rename(2) replaces an empty directory and fails on a non-empty one: a
        # directory that gained files since the check above is never overwritten.
        os.rename(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    fsync_path(parent, directory=True)


def _write_tensor(f: Any, t: torch.Tensor) -> None:
    mv = st.tensor_bytes(t)
    step = 64 << 20
    for i in range(0, len(mv), step):
        f.write(mv[i : i + step])


def export_hf(
    storage: Storage,
    step: int,
    out_dir: str | os.PathLike[str],
    *,
    key: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    manifest: Manifest | None = None,
    progress: Callable[[str, int], None] | None = None,
    config: Mapping[str, Any] | None = None,
) -> HFExportResult:
    """Write one entry of checkpoint ``step`` as a Hugging Face safetensors checkpoint.

    The layout is the one ``transformers`` writes and reads: ``model.safetensors`` when
    the weights fit in one shard, else ``model-00001-of-0000N.safetensors``... and
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
    {tensor: file}}``), and ``config.json``: ``config`` if given, else the config the HF
    integrations recorded for the entry in the checkpoint's metadata (none otherwise: then
    ``from_pretrained`` needs the config from elsewhere). Shards hold at most
    ``max_shard_size`` bytes of tensor data (``"5GB"``, ``"500MiB"`` or bytes; a larger
    tensor gets a shard of its own).

    Streaming: each tensor is assembled from the checkpoint (from its DTensor chunks, on
    whatever world size they were saved, or from the replicated payload), written, and
    dropped before the next one, so peak memory stays near the largest tensor. Atomic: the
    files are written into a temporary directory beside ``out_dir``, each fsynced, then
    the directory is fsynced and renamed into place and its parent fsynced: ``out_dir``
    appears whole or not at all (a failure removes the temporary directory).

    Args:
        storage: the store (``CheckpointManager(...).storage``).
        step: the committed step.
        out_dir: a directory that does not exist yet (or is empty).
        key: the entry (default ``model``, or the only module entry; an EMA gives its weights).
        max_shard_size: the shard size limit.
        manifest: the step's manifest, if already read.
        progress: called as ``progress(tensor_name, bytes)`` after each tensor is written.
        config: the model's ``transformers`` config (a JSON object) to write as
            ``config.json``, in place of the one recorded in the checkpoint.

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty directory.
        CkptStoreError: no such entry, not a flat dict of tensors, or per-rank state.
        IntegrityError: the checkpoint is corrupt (nothing is left behind).
        ValueError: a bad ``max_shard_size``.
    """
    limit = parse_size(max_shard_size)
    out = os.path.abspath(os.fspath(out_dir))
    _check_out_dir(out)  # before any work (new_dir_aside checks again)
    with StepTensors(storage, step, manifest=manifest) as src:
        k = choose_entry(src.kinds, key, src.where)
        refs = dict(src.state_dict(k))
        for name, ref in refs.items():
            if SUPPORTED_DTYPES.get(ref.dtype) not in st.DTYPE_TO_ST:
                raise CkptStoreError(
                    f"{src.where}[{k!r}][{name!r}]: dtype {ref.dtype} has no safetensors "
                    "equivalent; export to a .pt file instead"
                )
        shards = plan_shards([(n, r.nbytes) for n, r in refs.items()], limit)
        with new_dir_aside(out) as tmp:
            weight_map: dict[str, str] = {}
            files = []
            for i, names in enumerate(shards):
                fname = _shard_name(i, len(shards))
                files.append(fname)
                metas = {
                    n: torch.empty(
                        refs[n].shape, dtype=SUPPORTED_DTYPES[refs[n].dtype], device="meta"
                    )
                    for n in names
                }
                head, order = st.build_header(metas, {"format": "pt"})
                path = os.path.join(tmp, fname)
                with open(path, "xb") as f:
                    f.write(head)
                    for n, _ in order:
                        t = _contiguous(src.load(refs[n]))
                        _write_tensor(f, t)
                        weight_map[n] = fname
                        nbytes = t.numel() * t.element_size()
                        del t
                        if progress is not None:
                            progress(n, nbytes)
                    f.flush()
                    os.fsync(f.fileno())
            if len(shards) > 1:
                total = sum(r.nbytes for r in refs.values())
                doc = {
                    "metadata": {"total_size": total},
                    "weight_map": {n: weight_map[n] for n in refs},
                }
                with open(os.path.join(tmp, HF_INDEX), "x", encoding="utf-8") as f:
                    json.dump(doc, f, indent=2)
                    f.write("\n")
                    f.flush()
                    os.fsync(f.fileno())
                files.append(HF_INDEX)
            if config is None:
                config = recorded_config(src.manifest.metadata, str(k))
            if config is not None:
                with open(os.path.join(tmp, HF_CONFIG), "x", encoding="utf-8") as f:
                    json.dump(dict(config), f, indent=2, sort_keys=True, allow_nan=False)
                    f.write("\n")
                    f.flush()
                    os.fsync(f.fileno())
                files.append(HF_CONFIG)
        m = src.manifest
        return HFExportResult(
            out=out,
            step=step,
            key=str(k),
            files=files,
            tensors=len(refs),
            total_size=sum(r.nbytes for r in refs.values()),
            sharding=m.sharding_kind,
            world_size=m.world_size,
            config=config is not None,
        )


def _contiguous(t: Any) -> torch.Tensor:
    """A contiguous CPU tensor holding exactly its own bytes (views are copied)."""
    if not isinstance(t, torch.Tensor):  # pragma: no cover - state_dict() refuses ndarrays
        msg = f"expected a tensor, got {type(t).__name__}"
        raise CkptStoreError(msg)
    out: torch.Tensor = t.detach()
    if not out.is_contiguous() or out.device.type != "cpu":
        out = out.contiguous().cpu()
    return out

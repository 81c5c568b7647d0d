"""Inspecting a checkpoint: its manifest and the structure of its state, no payload read.

What ``ckptstore inspect`` prints, for Python: :func:`inspect_step` reads ``manifest.json``,
``state.json`` and, for a DTensor checkpoint, its chunk index ``dtensors.json`` (their
checksums checked), never a payload, and never imports torch.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .._fmt import created_json, key_text, metric_json
from ..codec import strictjson
from ..codec.dtypes import ITEMSIZE
from ..errors import IntegrityError
from ..layout import STATE_NAME, state_file
from ..manifest import Manifest
from ..sharded import split_index
from ..sharded.chunks import INDEX_FILE
from ..storage import Storage
from .stores import committed_step, open_store, partial_copies_explained, reaching

__all__ = [
    "EntryInfo",
    "InspectResult",
    "ShardedTensorInfo",
    "TensorInfo",
    "inspect_step",
    "read_state_entries",
    "read_state_root",
]


@dataclasses.dataclass
class TensorInfo:
    """One tensor recorded in ``state.json`` (no payload is read)."""

    name: str
    dtype: str
    shape: list[int]
    bytes: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class EntryInfo:
    """One top-level entry of a stored state: its kind, tensors and a summary."""

    key: str | int
    kind: str
    summary: str
    tensors: list[TensorInfo]

    @property
    def stored_bytes(self) -> int:
        """Bytes of the tensors stored for this entry (views and shared ones not counted)."""
        return sum(t.bytes for t in self.tensors if not t.note.startswith(("view", "shares")))

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "key": self.key,
            "kind": self.kind,
            "summary": self.summary,
            "tensor_bytes": self.stored_bytes,
            "tensors": [t.to_dict() for t in self.tensors],
        }


@dataclasses.dataclass
class ShardedTensorInfo:
    """One sharded (DTensor) tensor of the chunk index: its full shape and how it was laid out."""

    name: str
    dtype: str
    shape: list[int]
    bytes: int
    mesh: list[int]
    mesh_dims: list[str]
    placements: list[str]
    chunks: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)

    @property
    def mesh_text(self) -> str:
        """``shard=2`` / ``replicate=2,shard=4``, or ``[2]`` for unnamed mesh dimensions."""
        if not self.mesh:
            return "-"
        if len(self.mesh_dims) == len(self.mesh):
            return ",".join(f"{n}={d}" for n, d in zip(self.mesh_dims, self.mesh, strict=True))
        return str(self.mesh)


@dataclasses.dataclass
class InspectResult:
    """A checkpoint's manifest and the structure of its state."""

    where: str
    manifest: Manifest
    pinned: bool
    entries: list[EntryInfo]
    sharded_tensors: list[ShardedTensorInfo] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        m = self.manifest
        return {
            "where": self.where,
            "step": m.step,
            "created": created_json(m),
            "format": m.format,
            "format_version": m.format_version,
            "world_size": m.world_size,
            "sharded": m.sharded,
            "sharding": m.sharding_kind,
            "pinned": self.pinned,
            "versions": dict(m.versions),
            "metrics": {k: metric_json(v) for k, v in m.metrics.items()},
            "metadata": dict(m.metadata),
            "files": {n: e.to_json() for n, e in sorted(m.files.items())},
            "bytes": m.total_bytes,
            "entries": [e.to_dict() for e in self.entries],
            "sharded_tensors": [t.to_dict() for t in self.sharded_tensors],
        }


_MAX_WALK_DEPTH = 250


class _TreeWalker:
    """Collects tensors and kinds from a ``state.json`` tree without loading any payload."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seen: dict[tuple[Any, Any], str] = {}

    def bad(self, what: str) -> IntegrityError:
        return IntegrityError(f"{self.where}: {what}; the checkpoint is corrupt")

    def entry(self, key: str | int, node: Any) -> EntryInfo:
        kind = "data"
        if isinstance(node, dict) and node.get("t") == "stateful":
            k = node.get("kind")
            kind = k if isinstance(k, str) else "stateful"
            node = node.get("v")
        found: list[tuple[list[Any], Mapping[str, Any]]] = []
        self.walk(node, [], found, 0)
        names = _tensor_names([path for path, _ in found])
        tensors = [self.tensor(t, name) for (_, t), name in zip(found, names, strict=True)]
        return EntryInfo(key, kind, _summary(node), tensors)

    def walk(
        self, node: Any, path: list[Any], out: list[tuple[list[Any], Mapping[str, Any]]], depth: int
    ) -> None:
        """Collect the tensor nodes under ``node`` with their paths (keys, list indices)."""
        if depth > _MAX_WALK_DEPTH:
            raise self.bad("state nested too deeply")
        if isinstance(node, list):
            for i, x in enumerate(node):
                self.walk(x, [*path, i], out, depth + 1)
            return
        if not isinstance(node, dict):
            return
        t = node.get("t")
        if t in ("dict", "odict"):
            keys, vals = node.get("keys"), node.get("vals")
            if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
                raise self.bad(f"malformed dict at {_dotted(path) or '<root>'}")
            for k, v in zip(keys, vals, strict=True):
                self.walk(v, [*path, k], out, depth + 1)
        elif t in ("tuple", "stateful"):
            self.walk(node.get("v"), path, out, depth + 1)
        elif t in ("tensor", "view", "ndarray", "dtensor"):
            out.append((path, node))

    def tensor(self, node: Mapping[str, Any], name: str) -> TensorInfo:
        dtype, shape = node.get("dtype"), node.get("shape")
        if (
            not isinstance(dtype, str)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise self.bad(f"tensor {name!r} has a malformed dtype or shape")
        numel = math.prod(shape)
        nbytes = numel * ITEMSIZE.get(dtype, 0)
        ref = (node.get("file"), node.get("key"))
        note = ""
        if node.get("t") == "dtensor":
            return TensorInfo(name, dtype, list(shape), nbytes, "sharded")
        if node.get("t") == "view":
            note = f"view of {self.seen.get(ref, ref[1])}"
        elif ref in self.seen:
            note = f"shares {self.seen[ref]}"
        elif node.get("t") == "ndarray":
            note = "numpy"
        if node.get("t") != "view":
            self.seen.setdefault(ref, name)
        return TensorInfo(name, dtype, list(shape), nbytes, note)


def _dotted(path: list[Any]) -> str:
    """``model.layer.weight``: a tensor's path as ``inspect`` prints it."""
    return ".".join(str(c) for c in path)


def _tensor_names(paths: list[list[Any]]) -> list[str]:
    """The names of an entry's tensors: dotted paths, no two alike.

    Where two paths print the same (the key ``"x.y"`` beside ``x`` -> ``y``, the key ``"1"``
    beside ``1``), their keys holding a dot, reading as an int or empty are quoted
    (``'x.y'``), so each row names one tensor.
    """
    plain = [_dotted(p) or "_" for p in paths]
    counts = collections.Counter(plain)
    return [
        name if counts[name] == 1 else ".".join(key_text(c, ".") for c in path) or "_"
        for path, name in zip(paths, plain, strict=True)
    ]


def _summary(node: Any) -> str:
    """A few words on a node of ``state.json``: ``int 5``, ``dict (3 keys)``, ..."""
    if node is None or isinstance(node, bool | int | float | str):
        text = json.dumps(node)
        text = text if len(text) <= 40 else text[:37] + "..."
        return f"{type(node).__name__} {text}" if node is not None else "None"
    if isinstance(node, list):
        return f"list ({len(node)} items)"
    if isinstance(node, dict):
        t = node.get("t")
        if t in ("dict", "odict"):
            keys = node.get("keys")
            return f"dict ({len(keys) if isinstance(keys, list) else '?'} keys)"
        if t == "tuple":
            v = node.get("v")
            return f"tuple ({len(v) if isinstance(v, list) else '?'} items)"
        if t in ("tensor", "view", "ndarray", "dtensor"):
            return f"{t} {node.get('dtype')}{node.get('shape')}"
        if t in ("dtype", "device"):
            return f"{t} {node.get('v')}"
        return str(t)
    return type(node).__name__


def inspect_step(
    root: str | os.PathLike[str],
    step: int | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> InspectResult:
    """The manifest and state structure of ``step`` (default: the newest).

    Only ``manifest.json``, ``state.json`` and, for a DTensor checkpoint, its chunk index
    ``dtensors.json`` are read (their checksums checked), never a payload. For a DTensor
    checkpoint the result lists every sharded tensor: full shape, dtype, the mesh and
    placements it was saved with, and its number of saved chunks.

    Args:
        root: the store: a local directory or an fsspec URL.
        step: the step; ``None`` for the newest.
        storage_options: fsspec options for a URL.

    Raises:
        NoCheckpointError: no store at ``root``, or no such step.
        ManifestError, IntegrityError: the manifest, ``state.json`` or the index is corrupt.
    """
    storage = open_store(root, storage_options)
    with reaching(storage.root):
        s = committed_step(storage, step)
        manifest = storage.read_manifest(s)
        with partial_copies_explained(storage, manifest):
            return InspectResult(
                storage.describe(s),
                manifest,
                storage.is_pinned(s),
                read_state_entries(storage, manifest),
                _sharded_tensors(storage, manifest),
            )


def _sharded_tensors(storage: Storage, manifest: Manifest) -> list[ShardedTensorInfo]:
    """The tensors of a DTensor checkpoint's chunk index (none for other checkpoints)."""
    if not manifest.dtensor:
        return []
    entry = manifest.files.get(INDEX_FILE)
    if entry is None:
        raise IntegrityError(f"{storage.describe(manifest.step)}: manifest lists no {INDEX_FILE}")
    where = storage.describe(manifest.step, INDEX_FILE)
    index = split_index.read_index(storage, manifest, where)  # checked
    return [
        ShardedTensorInfo(
            name,
            t.dtype,
            list(t.shape),
            t.nbytes,
            list(t.mesh),
            list(t.mesh_dims),
            list(t.placements),
            len(t.chunks),
        )
        for name, t in sorted(index.tensors.items())
    ]


def read_state_entries(storage: Storage, manifest: Manifest) -> list[EntryInfo]:
    """The top-level entries of a checkpoint's state, from its ``state.json`` alone.

    Raises:
        IntegrityError: ``state.json`` is missing, corrupt or malformed.
    """
    where, keys, vals = read_state_root(storage, manifest)
    walker = _TreeWalker(where)
    out = []
    for k, v in zip(keys, vals, strict=True):
        if isinstance(k, bool) or not isinstance(k, str | int):
            raise IntegrityError(f"{where}: top-level key {k!r} is not str or int")
        out.append(walker.entry(k, v))
    return out


def read_state_root(storage: Storage, manifest: Manifest) -> tuple[str, list[Any], list[Any]]:
    """The top-level keys and nodes of a checkpoint's ``state.json``, its checksum checked.

    Returns ``(where, keys, vals)``: the file's name for messages, the keys, their nodes.

    Raises:
        IntegrityError: ``state.json`` is missing, corrupt or malformed.
    """
    # Per-rank state has one tree per rank: rank 0's shows the structure.
    name = state_file(0) if manifest.sharding_kind == "sharded" else STATE_NAME
    where = storage.describe(manifest.step, name)
    entry = manifest.files.get(name)
    if entry is None:
        raise IntegrityError(f"{storage.describe(manifest.step)}: manifest lists no {name}")
    raw = storage.read_file(manifest.step, name, entry)  # checksum checked
    try:
        tree = strictjson.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{where}: not valid JSON ({e})") from None
    root = tree.get("root") if isinstance(tree, dict) else None
    keys = root.get("keys") if isinstance(root, dict) else None
    vals = root.get("vals") if isinstance(root, dict) else None
    if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
        raise IntegrityError(f"{where}: malformed root; the checkpoint is corrupt")
    return where, keys, vals

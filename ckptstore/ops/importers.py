"""Importing checkpoints that other tools wrote (``ckptstore import``), without running code.

:func:`import_file` reads a source with :func:`read_source` and commits it as a step. Four
kinds of source:

- a ``torch.save`` file holding a dict (or a bare state dict): its zip CRCs are checked (torch
  does not), then it is loaded with ``torch.load(weights_only=True)``;
- a Lightning ``.ckpt``: the same kind of file, recognised by its
  ``"pytorch-lightning_version"`` entry; its entries are kept as Lightning wrote them
  (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``, ...), so the imported
  step loads as the same dict with ``CheckpointManager.load`` and with Lightning's
  ``CkptStoreIO`` plugin;
- a ``torch.distributed.checkpoint`` (DCP) directory written by ``FileSystemWriter``: its
  ``.metadata`` is read by an unpickler that admits only DCP's own metadata classes, every
  item's bytes are checked (bounds, zip CRCs) before use, and every item is loaded with
  ``weights_only=True``, non-tensor ones included (DCP itself loads those with
  ``weights_only=False``). It is read in this one process: no process group is needed, and
  tensors saved in shards by many ranks come back whole;
- a ``.safetensors`` file: its header and bounds are checked, and its tensors are a bare
  state dict.

Anything else (random bytes, an unknown format) is "not a checkpoint format ckptstore
knows", before any parser sees it. NumPy arrays and scalars in a ``torch.save`` file (an
``RNGState`` holds one) load through numpy's own array reconstruction, explicitly allowed.

A pickle that asks for anything beyond tensors and plain data (a custom class in Lightning's
``hyper_parameters``, an ``argparse.Namespace``) makes the source refused, naming what it
asked for. With ``skip_unsafe=True`` the entries holding such objects are dropped instead and
each is named in the notes; the refused classes are replaced during loading by inert
placeholders, so their code never runs. Nothing is ever loaded with ``weights_only=False``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import importlib
import io
import itertools
import math
import os
import pickle
import re
import stat
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .._progress import Progress
from ..codec.torchzip import check_stored
from ..errors import CkptStoreError, IntegrityError, PathNotFoundError, UnsafeCheckpointError
from ..storage.directio import open_nonblocking
from .verify import looks_like_safetensors, verify_file

__all__ = ["DCP_METADATA", "ImportResult", "Source", "import_file", "prepare_import", "read_source"]

#: The file that makes a directory a DCP checkpoint.
DCP_METADATA = ".metadata"
#: Wrapper prefixes stripped from the keys of imported state dicts (DDP, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: First bytes of a pre-1.6 ``torch.save`` file: pickle protocol 2, then its LONG1 magic.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a"
#: The entry Lightning puts in every checkpoint it writes.
_LIGHTNING_KEY = "pytorch-lightning_version"
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_MAX_DEPTH = 200
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # name -> torch.strided & co, a dict lookup
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


@dataclasses.dataclass
class Source:
    """A foreign checkpoint, loaded as plain data.

    Attributes:
        obj: what the source holds (a dict for anything importable).
        kind: ``"torch"``, ``"lightning"`` or ``"dcp"``.
        notes: what was noticed or changed, one line each (dropped entries included).
        metadata: extra manifest metadata (Lightning: its global step and epoch).
    """

    obj: Any
    kind: str
    notes: list[str]
    metadata: dict[str, Any]


def read_source(path: str, *, skip_unsafe: bool = False) -> Source:
    """Load a ``torch.save`` file, a Lightning ``.ckpt`` or a DCP directory, running no code.

    Args:
        path: the file, or the DCP directory (the one holding ``.metadata``).
        skip_unsafe: drop entries that need code to load instead of refusing the source.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CkptStoreError: the source needs code to load (and ``skip_unsafe`` is off or cannot
            help), or a directory is not a DCP checkpoint.
        IntegrityError: the source is corrupt (a zip CRC, a truncated file, a bad item).
    """
    if os.path.isdir(path):
        obj, notes = _read_dcp(path, skip_unsafe=skip_unsafe)
        notes.insert(0, "a torch.distributed.checkpoint directory")
        return Source(obj, "dcp", notes, {})
    if not os.path.isfile(path):
        raise PathNotFoundError(f"{path}: no such file", path=os.fspath(path))
    with open(path, "rb") as f:
        head = f.read(16)
        size = os.fstat(f.fileno()).st_size
    if looks_like_safetensors(head, size):
        return Source(_read_safetensors(path), "safetensors", ["a safetensors file"], {})
    if not head.startswith((b"PK", _LEGACY_TORCH_MAGIC)):
        raise CkptStoreError(
            f"{path}: not a checkpoint format ckptstore knows; import reads torch.save files "
            "(.pt, .pth, .bin), Lightning .ckpt files, .safetensors files and "
            "torch.distributed.checkpoint directories"
        )
    obj, notes = _read_torch(path, skip_unsafe=skip_unsafe)
    if isinstance(obj, dict) and _LIGHTNING_KEY in obj:
        info = {k: _int_or_none(obj.get(k)) for k in ("global_step", "epoch")}
        notes.insert(
            0,
            f"a Lightning checkpoint (Lightning {obj.get(_LIGHTNING_KEY)}, epoch "
            f"{info['epoch']}, global step {info['global_step']}); entries kept as Lightning "
            "wrote them",
        )
        return Source(obj, "lightning", notes, {"lightning": info})
    return Source(obj, "torch", notes, {})


def _read_safetensors(path: str) -> dict[str, Any]:
    """The tensors of a ``.safetensors`` file, after its header and bounds are checked."""
    from safetensors.torch import load_file

    report = verify_file(path, deep=True)
    if not report.ok:
        raise IntegrityError(_one_line(report.problems[0]))
    try:
        return dict(load_file(path))
    except Exception as e:  # the library's own errors have no common base
        raise IntegrityError(
            f"{path}: safetensors could not read it ({_one_line(str(e))})"
        ) from None


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else ""


# ---- torch.save files (Lightning .ckpt included) -----------------------------------------


def _needs_code(path: str, what: str) -> CkptStoreError:
    return CkptStoreError(
        f"{path}: the file needs code to load{what}: its pickle asks for more than tensors "
        "and plain data, and ckptstore loads only with weights_only=True. Import the rest "
        "with --skip-unsafe (those entries are dropped), or load it in Python with code you "
        "trust and save it with CheckpointManager.save"
    )


def _cannot_skip(path: str, what: str, why: str) -> CkptStoreError:
    return CkptStoreError(
        f"{path}: the file needs code to load{what}, and --skip-unsafe cannot drop it ({why}); "
        "load it in Python with code you trust and save it with CheckpointManager.save"
    )


def _refused(e: BaseException) -> str:
    """`` (GLOBAL name)`` from torch's refusal, the part of its long message that matters."""
    m = re.search(r"GLOBAL (\S+)", str(e))
    if m is None:
        return ""
    blocked = " from a module that is never loaded" if "is blocked" in str(e) else ""
    return f" (GLOBAL {m.group(1).rstrip('.,')}{blocked})"


def _read_torch(path: str, *, skip_unsafe: bool) -> tuple[Any, list[str]]:
    """``torch.load(weights_only=True)`` after the zip CRCs are checked."""
    with open(path, "rb") as f:
        is_zip = f.read(2) == b"PK"
    if is_zip:
        # torch.load does not check its zip's CRCs; a flipped byte would load silently.
        report = verify_file(path, deep=True)
        if not report.ok:
            more = f" (+{len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
            raise IntegrityError(_one_line(report.problems[0]) + more)
    try:
        return _torch_load(path), []
    except pickle.UnpicklingError as e:
        what = _refused(e)
        if not skip_unsafe:
            raise _needs_code(path, what) from None
        if not is_zip:
            raise _cannot_skip(path, what, "it reads only the zip format of torch >= 1.6") from None
    return _read_torch_skipping(path, what)


def _numpy_globals() -> list[Any]:
    """What a ``torch.save``d numpy array or scalar needs, for a ``weights_only`` load.

    ``RNGState`` holds NumPy's generator state (an ``ndarray``), so a whole state written by
    ``ckptstore export OUT.pt`` (or by ``torch.save`` of any state that has one) holds
    pickled numpy arrays, which torch's ``weights_only`` unpickler refuses. Allowed here:
    numpy's array and scalar reconstruction and its dtypes, nothing else. They build arrays
    from raw bytes; the elements of an object array are unpickled by the same restricted
    unpickler as everything else, so no code can be named through them.
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is present wherever tests run
        return []
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    dtypes = {type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGSUVMmO"}
    return [
        multiarray._reconstruct,
        multiarray.scalar,
        np.ndarray,
        np.dtype,
        *sorted(dtypes, key=str),
    ]


#: What a source may expand to: container visits and tensor bytes per byte of the source,
#: past a floor (see :func:`_bound_work`).
_NODES_PER_BYTE, _NODES_FLOOR = 64, 1_000_000
_BYTES_PER_BYTE, _BYTES_FLOOR = 4, 256 << 20


def _source_bytes(path: str) -> int:
    """The bytes of a file, or of the files directly in a directory."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))


def _bound_work(obj: Any, path: str) -> None:
    """Refuse a loaded source that expands far past its own size (bounded work).

    A pickle stores a shared object once: 40 nested ``l = [l, l]`` in 1.8 KB are 2**40
    list visits for anything that walks the state, which the import (a tree of values) must;
    an import ran out of time and memory (found by review). One float viewed with stride 0
    as 2**28 of them (``expand``) is written as 1 GiB from a 1.4 KB file. Counted here up to
    the budget only, so this check is bounded too.

    Raises:
        IntegrityError: naming the source and the budget it broke.
    """
    size = _source_bytes(path)
    nodes_left = max(_NODES_FLOOR, _NODES_PER_BYTE * size)
    bytes_left = max(_BYTES_FLOOR, _BYTES_PER_BYTE * size)
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...], int]] = set()
    stack = [obj]
    while stack:
        v = stack.pop()
        nodes_left -= 1
        if nodes_left < 0:
            raise IntegrityError(
                f"{path}: its objects expand to more than "
                f"{max(_NODES_FLOOR, _NODES_PER_BYTE * size)} values (lists or dicts "
                "shared many times over, nested): the file is hostile or damaged"
            )
        if isinstance(v, torch.Tensor):
            if v.is_nested or v.layout != torch.strided:
                continue  # no data_ptr or strides; the save refuses it in its own words
            key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()), int(v.storage_offset()))
            if key not in seen:
                seen.add(key)
                bytes_left -= v.numel() * v.element_size()
                if bytes_left < 0:
                    raise IntegrityError(
                        f"{path}: its tensors expand to more than "
                        f"{max(_BYTES_FLOOR, _BYTES_PER_BYTE * size)} bytes, from {size} "
                        "bytes (a view repeating its storage, stride 0): the file is hostile"
                    )
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple | set | frozenset):
            stack.extend(v)


def _torch_load(path: str) -> Any:
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # a cut-short pickle: IndexError, KeyError, ... (no code ran)
        raise IntegrityError(
            f"{path}: torch.load failed ({_one_line(str(e))}); the file is corrupt or not a "
            "torch.save checkpoint"
        ) from None
    _bound_work(obj, path)
    return obj


class _Placeholders:
    """Inert stand-ins for the classes a weights_only load refuses.

    Each refused global is mapped (``torch.serialization.safe_globals`` accepts
    ``(object, "module.Name")``) to a class whose construction returns a fresh, empty
    ``OrderedDict``: the one type the weights_only unpickler lets a pickle both fill
    (``SETITEMS``) and give attribute state (``BUILD``). Those dicts are remembered, and
    every entry that holds one (or a placeholder class itself) is dropped afterwards. No
    code of the refused classes runs: they are never imported.
    """

    def __init__(self, names: list[str]) -> None:
        self.made: list[collections.OrderedDict[Any, Any]] = []
        self.classes: dict[str, type] = {name: self._stub(name) for name in names}

    def _stub(self, name: str) -> type:
        made = self.made

        def new(cls: type, *args: Any, **kwargs: Any) -> Any:
            obj: collections.OrderedDict[Any, Any] = collections.OrderedDict()
            made.append(obj)  # kept alive, so ids stay unique while pruning
            return obj

        return type("Unloadable", (), {"__new__": new, "__qualname__": f"Unloadable[{name}]"})

    def globals(self) -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
        return [(cls, name) for name, cls in self.classes.items()]

    def is_placeholder(self, v: Any, ids: set[int]) -> bool:
        if id(v) in ids:
            return True
        return isinstance(v, type) and v in self.classes.values()


def _read_torch_skipping(path: str, what: str) -> tuple[Any, list[str]]:
    try:
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (ValueError, RuntimeError, zipfile.BadZipFile) as e:
        raise CkptStoreError(f"{path}: cannot list what the file needs ({e})") from None
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _numpy_globals()}
    names = [n for n in names if n not in allowed]
    stubs = _Placeholders(names)
    try:
        with torch.serialization.safe_globals([*_numpy_globals(), *stubs.globals()]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _cannot_skip(path, _refused(e) or what, "torch refuses it outright") from None
    except (RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        # e.g. an unloadable object used as a dict key, or state a placeholder cannot take
        raise _cannot_skip(path, what, f"{type(e).__name__}: {_one_line(str(e))}") from None
    _bound_work(obj, path)
    dropped: list[str] = []
    ids = {id(o) for o in stubs.made}
    pruned = _prune(obj, lambda v: stubs.is_placeholder(v, ids), "", dropped, 0)
    if pruned is _DROP:
        raise _cannot_skip(path, what, "the whole file is such an object")
    notes = [f"dropped entry {p}: it needs code to load" for p in dropped]
    notes.append(f"--skip-unsafe: never loaded {', '.join(names) or 'anything unsafe'}")
    return pruned, notes


#: Returned by :func:`_prune` for a value that must go.
_DROP: Any = object()


def _prune(node: Any, bad: Callable[[Any], bool], path: str, dropped: list[str], depth: int) -> Any:
    """``node`` without the entries that hold a bad value; their paths go to ``dropped``.

    A dict loses the keys whose value is (or holds) a bad value; a list or tuple that holds
    one is dropped whole by its parent (removing an element would shift the others).
    """
    if depth > _MAX_DEPTH:
        msg = f"the checkpoint is nested deeper than {_MAX_DEPTH} levels"
        raise CkptStoreError(msg)
    if bad(node):
        return _DROP
    if type(node) in (dict, collections.OrderedDict):
        out = type(node)()
        for k, v in node.items():
            where = f"{path}[{k!r}]"
            new = _DROP if bad(k) else _prune(v, bad, where, dropped, depth + 1)
            if new is _DROP:
                dropped.append(where)
            else:
                out[k] = new
        meta = getattr(node, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # module versions of a state_dict()
        return out
    if type(node) in (list, tuple):
        items = [_prune(v, bad, f"{path}[{i}]", [], depth + 1) for i, v in enumerate(node)]
        if any(x is _DROP for x in items):
            return _DROP
        return type(node)(items)
    return node


# ---- DCP directories -------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file: DCP's metadata classes and torch types only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            v = getattr(torch, name, None)
            if isinstance(v, torch.dtype | torch.layout | torch.memory_format):
                return v
        msg = f"GLOBAL {module}.{name} is not part of DCP metadata"
        raise pickle.UnpicklingError(msg)


def _read_dcp_metadata(path: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    where = os.path.join(path, DCP_METADATA)
    fd = _regular(open_nonblocking(where, os.O_RDONLY), where)  # a FIFO must not block it
    try:
        with os.fdopen(fd, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CkptStoreError(
            f"{where}: refused ({_one_line(str(e))}); ckptstore reads only DCP's own metadata "
            "classes from it, so that no code runs"
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise IntegrityError(f"{where}: corrupt ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise IntegrityError(f"{where}: not DCP metadata (holds a {type(md).__name__})")
    if not isinstance(md.storage_data, dict):
        raise CkptStoreError(
            f"{where}: no storage table; only directories written by FileSystemWriter import"
        )
    return md


def _open_item_file(path: str, rel: Any) -> int:
    if not isinstance(rel, str) or not _FILE_NAME_RE.fullmatch(rel) or rel == DCP_METADATA:
        raise IntegrityError(f"{path}: {DCP_METADATA} names a bad data file {rel!r}")
    try:
        fd = open_nonblocking(os.path.join(path, rel), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise IntegrityError(f"{path}/{rel}: a symlink; refused") from None
        raise IntegrityError(f"{path}/{rel}: cannot open ({e.strerror})") from None
    return _regular(fd, f"{path}/{rel}")


def _regular(fd: int, where: str) -> int:
    """``fd``, where it is a regular file; else closed and refused."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{where}: not a regular file")
    return fd


def _check_dcp_items(path: str, md: Any) -> list[str]:
    """Check every item's bounds and, where it is a plain torch.save zip, its CRCs.

    DCP keeps no checksums of its own; the CRC-32 of each item's zip members is what there
    is, and ``torch.load`` does not check it.
    """
    per_file: dict[str, list[tuple[str, Any]]] = {}
    for index, info in md.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((str(index.fqn), info))
    transformed = 0
    for rel, items in sorted(per_file.items()):
        fd = _open_item_file(path, rel)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for fqn, info in sorted(items, key=lambda x: int(x[1].offset)):
                offset, length = int(info.offset), int(info.length)
                where = f"{path}/{rel} (item {fqn!r})"
                if offset < 0 or length <= 0 or offset + length > size:
                    raise IntegrityError(
                        f"{where}: bytes {offset}..{offset + length} are beyond the file "
                        f"({size} bytes); the directory is truncated or corrupt"
                    )
                if info.transform_descriptors:
                    transformed += 1  # compressed by a DCP extension: no zip to check
                    continue
                f.seek(offset)
                blob = f.read(length)
                try:
                    with zipfile.ZipFile(io.BytesIO(blob)) as z:
                        check_stored(z, where)  # a deflated member is never inflated
                        bad = z.testzip()
                except IntegrityError:  # check_stored's, complete: keep it from the next clause
                    raise
                except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
                    raise IntegrityError(f"{where}: not a valid torch.save item ({e})") from None
                if bad is not None:
                    raise IntegrityError(f"{where}: CRC-32 mismatch in member {bad!r}")
    return [f"{transformed} transformed DCP items not CRC-checked"] if transformed else []


def _check_dcp_tensors(path: str, md: Any) -> None:
    """Refuse tensor items that their chunks do not tile, or larger than their data files.

    The import fills an empty tensor of the declared size from the chunks: a chunk missing
    left heap garbage in the step, saved and verified as the checkpoint's values, and a
    3 KB directory could declare gigabytes (found by review).

    Raises:
        IntegrityError: naming ``.metadata`` and the item.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..sharded.chunks import Chunk, check_tiling

    stored: dict[str, int] = collections.Counter()
    for index, info in md.storage_data.items():
        stored[index.fqn] += max(int(info.length), 0)
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        at = f"{os.path.join(path, DCP_METADATA)}: tensor {fqn!r}"
        shape = tuple(int(d) for d in item.size)
        need = math.prod(shape) * item.properties.dtype.itemsize
        if need > stored[fqn]:
            raise IntegrityError(
                f"{at} declares {need} bytes ({list(shape)}), and its data files hold "
                f"{stored[fqn]}: the directory is truncated or hostile"
            )
        chunks = [Chunk(*_chunk_box(c, shape, at), "", 0, 0, ()) for c in item.chunks]
        if math.prod(shape):
            check_tiling(chunks, shape, at)


def _chunk_box(
    chunk: Any, shape: tuple[int, ...], at: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DCP chunk's ``(offsets, sizes)``, checked to lie inside the tensor of ``shape``.

    Raises:
        IntegrityError: ``at`` names the item.
    """
    off, size = tuple(int(o) for o in chunk.offsets), tuple(int(z) for z in chunk.sizes)
    if (
        len(off) != len(shape)
        or len(size) != len(shape)
        or any(o < 0 or z < 0 or o + z > d for o, z, d in zip(off, size, shape, strict=True))
    ):
        raise IntegrityError(
            f"{at}: a chunk at {list(off)} of {list(size)} lies outside its tensor {list(shape)}"
        )
    return off, size


def _check_planner_data(path: str, md: Any) -> None:
    """Refuse ``planner_data`` paths of other than keys and list indices below the items.

    See :func:`_set_element`; the error names ``.metadata`` and the item.
    """
    limit = len(md.state_dict_metadata)
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    for fqn, where in planner_data.items():
        if not isinstance(where, tuple | list):
            continue
        for key in where:
            if not isinstance(key, str) and not (type(key) is int and 0 <= key < limit):
                raise IntegrityError(
                    f"{os.path.join(path, DCP_METADATA)}: item {fqn!r} has the planner_data "
                    f"path {list(where)!r}: {key!r} is not a key, nor a list index below the "
                    f"{limit} items"
                )


def _set_element(root: dict[Any, Any], path: tuple[Any, ...], value: Any, *, limit: int) -> None:
    """Put ``value`` at ``path`` (str: dict key, int: list index), as DCP unflattens.

    A list index is below ``limit`` (the number of items): a forged ``planner_data`` index
    of 10**12 appended Nones until memory ran out (found by review).
    """
    for key in path:
        if not isinstance(key, str) and not (type(key) is int and 0 <= key < limit):
            raise IntegrityError(
                f"{DCP_METADATA}: planner_data path {list(path)!r} holds {key!r}: not a key, "
                f"nor a list index below the {limit} items"
            )
    cur: Any = root
    for key, nxt in itertools.pairwise(path):
        fresh: Any = {} if isinstance(nxt, str) else []
        if isinstance(cur, dict):
            cur = cur.setdefault(key, fresh)
        else:
            while len(cur) <= key:
                cur.append(None)
            if cur[key] is None:
                cur[key] = fresh
            cur = cur[key]
    last = path[-1]
    if isinstance(cur, list):
        while len(cur) <= last:
            cur.append(None)
    cur[last] = value


def _dcp_planner(skip_unsafe: bool) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class Planner(DefaultLoadPlanner):
        """Builds the state from the metadata; loads non-tensor items with weights_only."""

        def __init__(self) -> None:
            super().__init__()
            self.refused: list[str] = []

        def set_up_planner(
            self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
        ) -> None:
            planner_data = metadata.planner_data or {}
            limit = len(metadata.state_dict_metadata)
            for fqn, item in metadata.state_dict_metadata.items():
                value = item
                if isinstance(item, TensorStorageMetadata):
                    value = torch.empty(item.size, dtype=item.properties.dtype)
                where = planner_data.get(fqn)
                if isinstance(where, tuple | list) and where:
                    _set_element(state_dict, tuple(where), value, limit=limit)
                else:
                    state_dict[fqn] = value
            super().set_up_planner(state_dict, metadata, is_coordinator)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:  # numpy's own array reconstruction allowed, as for a .pt file
                with torch.serialization.safe_globals(_numpy_globals()):
                    obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                self.refused.append(f"{fqn!r}{_refused(e)}")
                obj = _DROP
            if self.flatten_state_dict:
                limit = len(self.metadata.state_dict_metadata) if self.metadata else 0
                _set_element(self.original_state_dict, tuple(self.mappings[fqn]), obj, limit=limit)
            else:
                self.state_dict[fqn] = obj

    return Planner()


def _read_dcp(path: str, *, skip_unsafe: bool) -> tuple[dict[Any, Any], list[str]]:
    if not os.path.isfile(os.path.join(path, DCP_METADATA)):
        raise CkptStoreError(
            f"{path}: a directory without {DCP_METADATA} is not a torch.distributed.checkpoint "
            "checkpoint; give a torch.save file or a DCP directory"
        )
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    md = _read_dcp_metadata(path)
    notes = _check_dcp_items(path, md)
    _check_planner_data(path, md)
    _check_dcp_tensors(path, md)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md  # already read, by the restricted unpickler

    from torch.distributed.checkpoint.api import CheckpointException

    planner = _dcp_planner(skip_unsafe)
    try:
        with _quiet_single_process():
            load({}, storage_reader=Reader(path), planner=planner, no_dist=True)
    # DCP wraps every failure of a read in its CheckpointException, a BaseException.
    except (Exception, CheckpointException) as e:
        raise IntegrityError(
            f"{path}: reading the DCP checkpoint failed ({type(e).__name__}: {_one_line(str(e))})"
        ) from None
    if planner.refused and not skip_unsafe:
        raise CkptStoreError(
            f"{path}: DCP item(s) {', '.join(planner.refused)} need code to load: their pickle "
            "asks for more than tensors and plain data, and ckptstore loads only with "
            "weights_only=True. Import the rest with --skip-unsafe (those entries are dropped)"
        )
    _bound_work(planner.original_state_dict, path)
    dropped: list[str] = []
    obj = _prune(planner.original_state_dict, lambda v: v is _DROP, "", dropped, 0)
    notes.extend(f"dropped entry {p}: it needs code to load" for p in dropped)
    if not isinstance(obj, dict):  # pragma: no cover - DCP always gives a dict
        raise IntegrityError(f"{path}: the DCP checkpoint holds no state dict")
    notes.extend(_int_optimizer_keys(obj))
    return obj, notes


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns that it "assumes the intent is to save in a single process": it is ours.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _int_optimizer_keys(obj: dict[Any, Any], path: str = "") -> list[str]:
    """Give optimizer state its int keys back (DCP turns every key into a string).

    Only where it is unambiguous: a dict with ``state`` and ``param_groups`` whose params are
    ints and whose state keys are exactly their decimal strings. Optimizer state keyed by
    parameter name (``get_optimizer_state_dict``) is left as it is.
    """
    notes: list[str] = []
    for k, v in list(obj.items()):
        if not isinstance(v, dict):
            continue
        where = f"{path}[{k!r}]"
        state, groups = v.get("state"), v.get("param_groups")
        if isinstance(state, dict) and isinstance(groups, list) and state:
            params: list[Any] = []
            for g in groups:
                ps = g.get("params") if isinstance(g, Mapping) else None
                params.extend(ps if isinstance(ps, list) else [None])
            ints = {p for p in params if isinstance(p, int) and not isinstance(p, bool)}
            if len(ints) == len(params) and set(state) <= {str(p) for p in ints}:
                v["state"] = {int(s): st for s, st in state.items()}
                notes.append(f"{where}['state']: keys made ints again (DCP stores strings)")
                continue
        notes.extend(_int_optimizer_keys(v, where))
    return notes


# ---- committing a source as a step ------------------------------------------------------


@dataclasses.dataclass
class ImportResult:
    """What ``ckptstore import`` stored."""

    source: str
    where: str
    step: int
    keys: list[str]
    bytes: int
    notes: list[str]
    kind: str = "torch"

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


def _strip_wrapper_prefix(sd: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Remove ``module.``/``_orig_mod.`` prefixes shared by every key of a flat state dict."""
    keys = list(sd)
    stripped = ""
    changed = True
    while changed and keys:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if all(k.startswith(p) and len(k) > len(p) for k in keys):
                keys = [k[len(p) :] for k in keys]
                stripped += p
                changed = True
    if not stripped:
        return sd, ""
    out: dict[str, Any] = (
        collections.OrderedDict() if isinstance(sd, collections.OrderedDict) else {}
    )
    for old, new in zip(sd, keys, strict=True):
        out[new] = sd[old]
    meta = getattr(sd, "_metadata", None)
    if isinstance(meta, dict):
        # Module versions keyed by submodule path: keep the wrapped module's, re-rooted.
        new_meta = {}
        outer = stripped[:-1]
        for k, v in meta.items():
            if k == outer:
                new_meta[""] = v
            elif k.startswith(stripped):
                new_meta[k[len(stripped) :]] = v
        out._metadata = new_meta  # type: ignore[attr-defined]
    return out, stripped


def _is_flat_tensor_dict(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def prepare_import(
    obj: Any, *, key: str = "model", strip: bool = True
) -> tuple[dict[Any, Any], list[str]]:
    """Shape a loaded ``torch.save`` object for :meth:`CheckpointManager.save`.

    A bare state dict (``{name: tensor}``) is stored under ``key``; with ``strip``, every
    flat tensor dict loses a ``module.``/``_orig_mod.`` prefix shared by all its keys (a DDP
    or compiled model's). Not for a Lightning ``.ckpt``: Lightning writes the module's own
    names (a ``LightningModule`` whose network is ``self.module`` saves ``module.weight``,
    which ``load_state_dict`` wants back). Returns the state and notes on what was changed.

    Raises:
        CkptStoreError: ``obj`` is not a dict.
    """
    notes: list[str] = []
    if not isinstance(obj, dict):
        raise CkptStoreError(
            f"the file holds a {type(obj).__name__}, not a dict; ckptstore stores a dict of "
            "named entries (e.g. {'model': state_dict, 'optimizer': ...})"
        )
    if _is_flat_tensor_dict(obj):
        sd, prefix = _strip_wrapper_prefix(obj) if strip else (obj, "")
        notes.append(f"a bare state dict: stored under {key!r}")
        if prefix:
            notes.append(f"stripped {prefix!r} from the keys of {key!r}")
        return {key: sd}, notes
    state: dict[Any, Any] = {}
    for k, v in obj.items():
        if strip and _is_flat_tensor_dict(v):
            v, prefix = _strip_wrapper_prefix(v)
            if prefix:
                notes.append(f"stripped {prefix!r} from the keys of {k!r}")
        state[k] = v
    return state, notes


def _check_storable(state: Mapping[Any, Any]) -> None:
    """Encode ``state``'s tree as a save does (no tensor is copied), for its refusals.

    Raises:
        UnsafeCheckpointError: what the save would refuse.
    """
    from ..codec.tree import TreeEncoder
    from ..save.encode import check_state_key, group_name

    enc = TreeEncoder()
    for i, (key, value) in enumerate(state.items()):
        check_state_key(key)
        enc.encode(value, group=group_name(key, i), path=(key,))


def _refusal(source: str, e: UnsafeCheckpointError) -> UnsafeCheckpointError:
    """The save's refusal of an imported state, in an import's words."""
    if " cannot be stored without pickle" not in str(e):
        # Another refusal (a dtype no format stores): in its own words.
        return UnsafeCheckpointError(f"{source}: {e}")
    # mgr.save's advice (allow_pickle=True) is no option of an import: say what is.
    what = str(e).split(" cannot be stored without pickle", 1)[0]
    return UnsafeCheckpointError(
        f"{source}: {what} load (torch.load(weights_only=True) reads them) but cannot "
        "be stored without pickle, and an import stores no pickles (--skip-unsafe "
        "drops only what needs code to load); convert that entry in the source (a "
        "set to a list, say) and import again"
    )


def import_file(
    source: str | os.PathLike[str],
    root: str | os.PathLike[str],
    step: int,
    *,
    key: str = "model",
    format: str = "safetensors",
    compression: str | None = None,
    skip_unsafe: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> ImportResult:
    """Load a foreign checkpoint (never running its code) and commit it as ``step`` of ``root``.

    ``source`` is a ``torch.save`` file, a Lightning ``.ckpt``, a ``.safetensors`` file or a
    ``torch.distributed.checkpoint`` directory (see :func:`read_source`). A bare state dict
    is stored under ``key``; ``module.``/``_orig_mod.`` prefixes are stripped (not from a
    Lightning ``.ckpt``, whose names are the module's own). The store is created if needed.

    Args:
        source: the file or DCP directory.
        root: the store: a local directory or an fsspec URL.
        step: the step to store it as.
        key: the entry name for a bare state dict.
        format: the payload format of the new step (``"safetensors"`` or ``"torch"``).
        compression: ``None`` or ``"zstd"``.
        skip_unsafe: drop the entries that need code to load instead of refusing the source.
        storage_options: fsspec options for a URL.
        progress: called as the import advances.

    Raises:
        ValueError: ``format`` or ``compression`` is not one ckptstore writes.
        FileNotFoundError: nothing at ``source``.
        CkptStoreError: the source needs code to load (see ``skip_unsafe``), is not a dict,
            is not a checkpoint format ckptstore knows, or cannot be stored.
        IntegrityError: the source is corrupt.
        StepExistsError: ``step`` is already committed.
        StoreLockedError: another process writes the store.
    """
    from ..manager import CheckpointManager  # the manager imports this module's neighbours

    source = os.fspath(source)
    report = progress or (lambda done, total, what: None)
    report(0, 2, f"reading {os.path.basename(os.path.normpath(source))}")
    src = read_source(source, skip_unsafe=skip_unsafe)
    state, notes = prepare_import(src.obj, key=key, strip=src.kind != "lightning")
    notes = src.notes + notes
    report(1, 2, f"writing step {step}")
    # What the save's encoding refuses (a dtype no format stores, a sparse tensor, a
    # value that needs pickle), refused before the manager creates the root and its lock:
    # a refused import into a new root left an empty store behind (found by review).
    try:
        _check_storable(state)
    except UnsafeCheckpointError as e:
        raise _refusal(source, e) from None
    mgr = CheckpointManager(
        root,
        keep=None,
        format=format,
        compression=compression,
        storage_options=storage_options or None,
        distributed=False,
    )
    with mgr:
        metadata = {"imported_from": os.path.abspath(source), **src.metadata}
        # An import places the step it is told to: an older step than the newest is asked
        # for, not a training run restarted without resume().
        try:
            manifest = mgr.save(step, state, metadata=metadata, allow_older=True).wait()
        except UnsafeCheckpointError as e:
            raise _refusal(source, e) from None
        where = mgr.storage.describe(step)
        report(2, 2, "done")
    return ImportResult(
        source=source,
        where=where,
        step=step,
        keys=[str(k) for k in state],
        bytes=manifest.total_bytes if manifest is not None else 0,
        notes=notes,
        kind=src.kind,
    )

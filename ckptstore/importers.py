"""Reading checkpoints that other tools wrote, for ``ckptstore import``, without running code.

Three kinds of source:

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
  tensors saved in shards by many ranks come back whole.

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
import io
import itertools
import os
import pickle
import re
import stat
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .codec.torchzip import check_stored
from .errors import CkptStoreError, IntegrityError
from .verify import verify_file

__all__ = ["DCP_METADATA", "Source", "read_source"]

#: The file that makes a directory a DCP checkpoint.
DCP_METADATA = ".metadata"
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
        raise FileNotFoundError(errno.ENOENT, "no such file", path)
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


def _torch_load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as e:
        raise IntegrityError(
            f"{path}: torch.load failed ({_one_line(str(e))}); the file is corrupt or not a "
            "torch.save checkpoint"
        ) from None


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
    stubs = _Placeholders(names)
    try:
        with torch.serialization.safe_globals(stubs.globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _cannot_skip(path, _refused(e) or what, "torch refuses it outright") from None
    except (RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        # e.g. an unloadable object used as a dict key, or state a placeholder cannot take
        raise _cannot_skip(path, what, f"{type(e).__name__}: {_one_line(str(e))}") from None
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
    try:
        with open(where, "rb") as f:
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
        fd = os.open(os.path.join(path, rel), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise IntegrityError(f"{path}/{rel}: a symlink; refused") from None
        raise IntegrityError(f"{path}/{rel}: cannot open ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{path}/{rel}: not a regular file")
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


def _set_element(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (str: dict key, int: list index), as DCP unflattens."""
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
            for fqn, item in metadata.state_dict_metadata.items():
                value = item
                if isinstance(item, TensorStorageMetadata):
                    value = torch.empty(item.size, dtype=item.properties.dtype)
                where = planner_data.get(fqn)
                if isinstance(where, tuple | list) and where:
                    _set_element(state_dict, tuple(where), value)
                else:
                    state_dict[fqn] = value
            super().set_up_planner(state_dict, metadata, is_coordinator)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                self.refused.append(f"{fqn!r}{_refused(e)}")
                obj = _DROP
            if self.flatten_state_dict:
                _set_element(self.original_state_dict, tuple(self.mappings[fqn]), obj)
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

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md  # already read, by the restricted unpickler

    planner = _dcp_planner(skip_unsafe)
    try:
        with _quiet_single_process():
            load({}, storage_reader=Reader(path), planner=planner, no_dist=True)
    except Exception as e:  # DCP wraps every failure of a read in its CheckpointException
        raise IntegrityError(
            f"{path}: reading the DCP checkpoint failed ({type(e).__name__}: {_one_line(str(e))})"
        ) from None
    if planner.refused and not skip_unsafe:
        raise CkptStoreError(
            f"{path}: DCP item(s) {', '.join(planner.refused)} need code to load: their pickle "
            "asks for more than tensors and plain data, and ckptstore loads only with "
            "weights_only=True. Import the rest with --skip-unsafe (those entries are dropped)"
        )
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

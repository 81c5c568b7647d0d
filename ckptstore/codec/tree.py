"""The state codec: nested Python data <-> (typed JSON tree, groups of tensors).

``state.json`` holds the structure of the state and every non-tensor leaf, typed so that
everything round-trips exactly: int dict keys stay int, tuples stay tuples, ``-0.0`` and
``nan`` survive, a ``torch.Size`` comes back a ``torch.Size``. Tensors are replaced by
references ``{"t": "tensor", "file": group, "key": name}`` into payload files, one group per
top-level key of the state. Plain JSON scalars (None, bool, int, finite float, str) and lists
are written bare; everything else is an object tagged with ``"t"``.

Tensors that share storage are stored once: an identical view becomes a second reference to
the same payload entry (tied weights stay tied), and a view into a tensor that covers its
whole storage becomes a ``"view"`` node (offset, shape, stride) of that tensor.

Nothing here unpickles unless the caller passes ``allow_pickle=True``.
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import IntegrityError, UnsafeCheckpointError
from .dtypes import ITEMSIZE
from .payload import stored_tensors

try:  # numpy is optional: torch does not require it
    import numpy as _numpy
except ImportError:  # pragma: no cover - numpy is present wherever tests run
    _numpy = None  # type: ignore[assignment]
np: Any = _numpy

__all__ = [
    "STATE_FORMAT",
    "SUPPORTED_DTYPES",
    "TreeDecoder",
    "TreeEncoder",
    "format_path",
    "is_key",
    "stored_tensors",
]

#: Version of the state.json tree format.
STATE_FORMAT = 1

#: dtype name <-> torch dtype for every dtype the payload formats store.
SUPPORTED_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ITEMSIZE}
_DTYPE_NAMES = {v: k for k, v in SUPPORTED_DTYPES.items()}
_ALL_TORCH_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_MAX_DEPTH = 200
#: ``isinstance`` with a tuple: ``A | B`` builds a union object at every call (~0.45 us on the
#: test VM against 0.05), and the decoder asks once a node of ``state.json``.
_SCALARS = (bool, int, str, float)
_KEY_TYPES = (str, int)
#: Ints beyond this many bits are stored as hex: decimal JSON stops at 4300 digits.
_MAX_JSON_INT_BITS = 14_000


def is_key(k: object) -> bool:
    """Whether ``k`` may be a dict key of a stored state: a str or an int (not a bool).

    What the encoder writes and the decoder accepts; a walk of ``state.json`` that reads
    keys before the decoder does (to plan a read) refuses the others the same way.
    """
    return not isinstance(k, bool) and isinstance(k, _KEY_TYPES)


def format_path(path: tuple[Any, ...]) -> str:
    """Spell a path in the state the way Python would index it: ``state['opt']['state'][0]``."""
    return "state" + "".join(f"[{p!r}]" for p in path)


def _float_node(v: float) -> Any:
    if math.isfinite(v):
        return v
    # Keep the exact bits: NaN payloads and the sign of an infinity survive.
    return {"t": "float", "bits": struct.pack(">d", v).hex()}


def _tensor_dtype_name(t: torch.Tensor, path: tuple[Any, ...]) -> str:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        how = (
            # .to(float32) would drop the imaginary parts
            "e.g. as torch.view_as_real(t) (its real and imaginary parts, float64), and "
            "torch.view_as_complex after loading"
            if t.is_complex()
            else "e.g. with .to(torch.float32)"
        )
        msg = (
            f"{format_path(path)}: tensors of dtype {t.dtype} cannot be stored (supported: "
            f"{', '.join(SUPPORTED_DTYPES)}); convert it, {how}"
        )
        raise UnsafeCheckpointError(msg)
    return name


class _Occurrence:
    __slots__ = ("group", "node", "path", "tensor")

    def __init__(
        self, tensor: torch.Tensor, node: dict[str, Any], group: str, path: tuple[Any, ...]
    ) -> None:
        self.tensor = tensor
        self.node = node
        self.group = group
        self.path = path


class TreeEncoder:
    """Encodes plain state data into a typed JSON tree and groups of tensors.

    Call :meth:`encode` once per top-level entry, then :meth:`finish` to resolve shared
    storage and obtain the tensor groups.
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        dtensor: Callable[[Any, tuple[Any, ...]], dict[str, Any]] | None = None,
    ) -> None:
        self.allow_pickle = allow_pickle
        # DTensor leaves are not payload tensors: a sharded save names them and writes each
        # rank's shards itself (see sharding.py); ``dtensor`` returns their node.
        self._dtensor = dtensor
        self._occurrences: list[_Occurrence] = []

    def encode(self, value: Any, *, group: str, path: tuple[Any, ...]) -> Any:
        """Encode ``value`` found at ``path``; its tensors go to payload group ``group``."""
        return self._enc(value, group, path, 0)

    def _enc(self, v: Any, group: str, path: tuple[Any, ...], depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise UnsafeCheckpointError(
                f"{format_path(path)}: state nested deeper than {_MAX_DEPTH}"
            )
        tv = type(v)
        if tv is int and v.bit_length() > _MAX_JSON_INT_BITS:
            # json refuses ints of more than 4300 digits (CVE-2020-10735 guard): hex them.
            return {"t": "bigint", "hex": hex(v)}
        if v is None or tv is bool or tv is int or tv is str:
            return v
        if tv is float:
            return _float_node(v)
        if isinstance(v, torch.Tensor):
            if _is_dtensor(v):
                if self._dtensor is None:
                    msg = (
                        f"{format_path(path)}: a DTensor can only be saved by a sharded save "
                        "on every rank"
                    )
                    raise UnsafeCheckpointError(msg)
                return self._dtensor(v, path)
            return self._tensor(v, group, path)
        if tv is list:
            return [self._enc(x, group, (*path, i), depth + 1) for i, x in enumerate(v)]
        if tv is tuple:
            return {
                "t": "tuple",
                "v": [self._enc(x, group, (*path, i), depth + 1) for i, x in enumerate(v)],
            }
        if tv is dict or tv is collections.OrderedDict:
            return self._dict(v, group, path, depth)
        if tv is collections.Counter:
            # A dict node that says it was a Counter (MultiStepLR's milestones): read back
            # as a Counter, whose elements() and missing keys the scheduler relies on (an
            # older reader, which ignores the flag, gets the dict).
            node = self._dict(v, group, path, depth)
            if node.get("t") == "dict":
                node["counter"] = True
            return node
        if tv is bytes or tv is bytearray:
            return {"t": tv.__name__, "b64": base64.b64encode(v).decode("ascii")}
        if isinstance(v, torch.dtype):
            return {"t": "dtype", "v": str(v).removeprefix("torch.")}
        if tv is torch.Size:
            return {"t": "size", "v": list(v)}
        if tv is torch.device:
            return {"t": "device", "v": str(v)}
        # Exactly ndarray: a subclass (np.ma.MaskedArray, np.matrix) would lose its type and
        # its mask, so it takes the pickle path like any other object.
        if np is not None and type(v) is np.ndarray:
            return self._ndarray(v, group, path)
        if np is not None and isinstance(v, np.generic) and v.dtype.kind in "biufc":
            return {"t": "npscalar", "dtype": v.dtype.str, "hex": v.tobytes().hex()}
        return self._pickle(v, path, f"objects of type {tv.__module__}.{tv.__qualname__}")

    def _pickle(self, v: Any, path: tuple[Any, ...], what: str) -> Any:
        if not self.allow_pickle:
            msg = (
                f"{format_path(path)}: {what} cannot be stored without pickle. Convert it to "
                "tensors and plain data (dict/list/tuple/str/int/float/bool/None/bytes), give "
                "it state_dict()/load_state_dict(), or pass allow_pickle=True if every reader "
                "of this store is trusted"
            )
            raise UnsafeCheckpointError(msg)
        try:
            data = pickle.dumps(v, protocol=4)
        except Exception as e:
            raise UnsafeCheckpointError(f"{format_path(path)}: cannot pickle {what}: {e}") from e
        return {"t": "pickle", "b64": base64.b64encode(data).decode("ascii")}

    def _dict(self, v: Mapping[Any, Any], group: str, path: tuple[Any, ...], depth: int) -> Any:
        keys: list[Any] = []
        vals: list[Any] = []
        for k, x in v.items():
            tk = type(k)
            if tk is not str and tk is not int:
                return self._pickle(v, path, f"a dict with a key of type {tk.__name__} ({k!r})")
            keys.append(k)
            vals.append(self._enc(x, group, (*path, k), depth + 1))
        node: dict[str, Any] = {
            "t": "odict" if type(v) is collections.OrderedDict else "dict",
            "keys": keys,
            "vals": vals,
        }
        meta = getattr(v, "_metadata", None)  # module versions that state_dict() attaches
        if meta is not None and isinstance(meta, dict):
            node["meta"] = self._enc(dict(meta), group, (*path, "_metadata"), depth + 1)
        return node

    def _tensor(self, t: torch.Tensor, group: str, path: tuple[Any, ...]) -> dict[str, Any]:
        if t.is_nested:  # its layout says strided, and its sizes raise inside torch
            msg = (
                f"{format_path(path)}: nested tensors cannot be stored; store their "
                "components (t.unbind()) as a list of tensors"
            )
            raise UnsafeCheckpointError(msg)
        if t.layout != torch.strided:
            msg = (
                f"{format_path(path)}: {t.layout} tensors cannot be stored; "
                "make it dense with .to_dense()"
            )
            raise UnsafeCheckpointError(msg)
        if t.is_quantized or t.is_meta:
            kind = "quantized" if t.is_quantized else "meta"
            raise UnsafeCheckpointError(f"{format_path(path)}: {kind} tensors cannot be stored")
        node: dict[str, Any] = {
            "t": "tensor",
            "dtype": _tensor_dtype_name(t, path),
            "shape": list(t.shape),
        }
        # type() first: Parameter's isinstance goes through a Python metaclass hook, slow
        # for the plain tensors (optimizer state) that are most of a state.
        tt = type(t)
        if tt is torch.nn.Parameter or (
            tt is not torch.Tensor and isinstance(t, torch.nn.Parameter)
        ):
            node["param"] = True
        if t.requires_grad:
            node["requires_grad"] = True
        if t.is_conj() or t.is_neg():
            # A lazy conjugate or negative view: its memory holds the values before the
            # flag, which its bytes (and an identical view of the same memory) would be
            # stored as. Stored as the values it reads as, on its own.
            t = t.detach().resolve_conj().resolve_neg()
        self._occurrences.append(_Occurrence(t, node, group, path))
        return node

    def _ndarray(self, a: Any, group: str, path: tuple[Any, ...]) -> Any:
        if a.dtype.kind not in "biufc" or a.dtype.str[1:] in ("c16", "f16", "c32"):
            return self._pickle(a, path, f"numpy arrays of dtype {a.dtype}")
        native = a.astype(a.dtype.newbyteorder("=")) if not a.dtype.isnative else a
        # np.array, not np.ascontiguousarray: that one turns a 0-d array into shape (1,).
        t = torch.from_numpy(np.array(native, order="C", copy=True))
        node = self._tensor(t, group, path)
        node["t"] = "ndarray"
        node["np_dtype"] = a.dtype.str
        return node

    def finish(
        self, name_tensor: Callable[[tuple[Any, ...]], str], *, contiguous: bool = True
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Resolve shared storage, name every stored tensor, and return the groups.

        Args:
            name_tensor: maps a path to the tensor's preferred key inside its group; keys are
                made unique with a ``#n`` suffix where two paths collide.
            contiguous: return contiguous CPU tensors (a copy only for non-contiguous or
                device tensors); ``False`` leaves them as found, for a staging copy to do it.

        Returns:
            ``{group: {key: contiguous CPU tensor}}``, ready for a payload writer.
        """
        groups: dict[str, dict[str, torch.Tensor]] = {}

        def store(occ: _Occurrence, tensor: torch.Tensor) -> None:
            g = groups.setdefault(occ.group, {})
            key = name_tensor(occ.path)
            n = 1
            # "__metadata__" is reserved in a safetensors header: a tensor there is unloadable.
            while key in g or key == "__metadata__":
                n += 1
                key = f"{name_tensor(occ.path)}#{n}"
            t = tensor.detach()
            if contiguous:
                if t.device.type != "cpu":
                    t = t.cpu()
                if not t.is_contiguous():
                    t = t.contiguous()
            g[key] = t
            occ.node["file"] = occ.group
            occ.node["key"] = key

        by_storage: dict[tuple[Any, ...], list[_Occurrence]] = {}
        for occ in self._occurrences:
            t = occ.tensor
            storage = t.untyped_storage()
            nbytes = int(storage.nbytes())
            if nbytes == 0 or t.numel() == 0:
                store(occ, t)
                continue
            device = t.device
            sid = (device.type, device.index, storage.data_ptr(), nbytes)
            by_storage.setdefault(sid, []).append(occ)

        for occs in by_storage.values():
            if len(occs) == 1:  # the one reference to its storage (most tensors): as it is
                store(occs[0], occs[0].tensor)
                continue
            base = next((o for o in occs if _covers_storage(o.tensor)), None)
            stored: dict[tuple[Any, ...], _Occurrence] = {}
            if base is not None:
                store(base, base.tensor)
                stored[_view_key(base.tensor)] = base
            for occ in occs:
                if occ is base:
                    continue
                vk = _view_key(occ.tensor)
                first = stored.get(vk)
                if first is not None:  # identical view: one payload entry, two references
                    occ.node["file"] = first.node["file"]
                    occ.node["key"] = first.node["key"]
                elif base is not None and occ.tensor.dtype == base.tensor.dtype:
                    occ.node["t"] = "view" if occ.node["t"] == "tensor" else occ.node["t"]
                    if occ.node["t"] == "view":
                        occ.node["file"] = base.node["file"]
                        occ.node["key"] = base.node["key"]
                        occ.node["offset"] = occ.tensor.storage_offset()
                        occ.node["stride"] = list(occ.tensor.stride())
                    else:  # a numpy array viewing a tensor: store a copy
                        store(occ, occ.tensor)
                else:
                    store(occ, occ.tensor)
                    stored[vk] = occ
        return groups


#: ``state.redistribute.is_dtensor`` once first asked for (state imports codec: it cannot be
#: imported at the top), not an import statement per tensor a save encodes (~2 us each).
_IS_DTENSOR: list[Callable[[Any], bool]] = []


def _is_dtensor(t: torch.Tensor) -> bool:
    if not _IS_DTENSOR:
        from ..state.redistribute import is_dtensor

        _IS_DTENSOR.append(is_dtensor)
    return _IS_DTENSOR[0](t)


def _storage_nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _covers_storage(t: torch.Tensor) -> bool:
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.numel() * t.element_size() == _storage_nbytes(t)
    )


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


class TreeDecoder:
    """Rebuilds plain data from a typed JSON tree and a tensor source.

    Args:
        get_tensor: returns the stored tensor for ``(group, key)``; it is called once per
            distinct entry, so references to one entry come back as one tensor object.
        allow_pickle: unpickle ``"pickle"`` nodes; refused otherwise.
        where: names the checkpoint in error messages.
        meta: return meta tensors built from the shapes and dtypes in the tree, reading no
            payload (to check a checkpoint against its targets before loading it).
    """

    def __init__(
        self,
        get_tensor: Callable[[str, str], torch.Tensor] | None,
        *,
        allow_pickle: bool = False,
        where: str = "state.json",
        meta: bool = False,
        get_dtensor: Callable[[str, tuple[Any, ...]], torch.Tensor] | None = None,
    ) -> None:
        self._get = get_tensor
        self._get_dtensor = get_dtensor
        self.meta = meta
        self._cache: dict[tuple[str, str], torch.Tensor] = {}
        self._params: dict[tuple[str, str, bool], torch.Tensor] = {}
        self._leaves: dict[tuple[str, str], torch.Tensor] = {}
        self.allow_pickle = allow_pickle
        self.where = where

    def decode(self, node: Any, path: tuple[Any, ...] = ()) -> Any:
        """Decode one node (recursively)."""
        try:
            return self._dec(node, path, 0)
        except RecursionError:
            raise IntegrityError(
                f"{self.where}: state nested too deeply; the file is hostile"
            ) from None

    def _bad(self, path: tuple[Any, ...], what: str) -> IntegrityError:
        return IntegrityError(
            f"{self.where}: {format_path(path)}: {what}; the checkpoint is corrupt"
        )

    def _dec(self, n: Any, path: tuple[Any, ...], depth: int) -> Any:
        if depth > _MAX_DEPTH + 5:
            raise self._bad(path, "nested too deeply")
        if n is None or isinstance(n, _SCALARS):
            return n
        if isinstance(n, list):
            return [self._dec(x, (*path, i), depth + 1) for i, x in enumerate(n)]
        if not isinstance(n, dict):
            raise self._bad(path, f"unexpected JSON {type(n).__name__}")
        t = n.get("t")
        try:
            if t in {"dict", "odict"}:
                keys, vals = n["keys"], n["vals"]
                if (
                    not isinstance(keys, list)
                    or not isinstance(vals, list)
                    or len(keys) != len(vals)
                ):
                    raise self._bad(path, "dict keys and values do not match")
                out: dict[Any, Any] = {} if t == "dict" else collections.OrderedDict()
                if t == "dict" and n.get("counter") is True:
                    out = collections.Counter()
                for k, x in zip(keys, vals, strict=True):
                    if not is_key(k):
                        raise self._bad(path, f"dict key {k!r} is not str or int")
                    out[k] = self._dec(x, (*path, k), depth + 1)
                if "meta" in n:
                    meta = self._dec(n["meta"], (*path, "_metadata"), depth + 1)
                    if t == "odict":
                        out._metadata = meta  # type: ignore[attr-defined]
                return out
            if t == "bigint":
                return int(str(n["hex"]), 16)
            if t == "tuple":
                return tuple(self._dec(x, (*path, i), depth + 1) for i, x in enumerate(n["v"]))
            if t == "float":
                return struct.unpack(">d", bytes.fromhex(n["bits"]))[0]
            if t in ("bytes", "bytearray"):
                raw = base64.b64decode(n["b64"], validate=True)
                return raw if t == "bytes" else bytearray(raw)
            if t == "dtype":
                dt = _ALL_TORCH_DTYPES.get(n["v"])
                if dt is None:
                    raise self._bad(path, f"unknown dtype {n['v']!r}")
                return dt
            if t == "size":
                return torch.Size([int(x) for x in n["v"]])
            if t == "device":
                return torch.device(str(n["v"]))
            if t == "npscalar":
                if np is None:
                    raise IntegrityError(
                        f"{format_path(path)}: numpy is needed to load numpy scalars"
                    )
                npdt = np.dtype(str(n["dtype"]))
                if npdt.kind not in "biufc":
                    raise self._bad(path, f"numpy dtype {npdt} is not numeric")
                return np.frombuffer(bytes.fromhex(n["hex"]), dtype=npdt)[0]
            if t in ("tensor", "view", "ndarray"):
                return self._tensor(n, path)
            if t == "dtensor":
                return self._dtensor_leaf(n, path)
            if t == "pickle":
                if not self.allow_pickle:
                    msg = (
                        f"{self.where}: {format_path(path)} holds a pickled object; pickles "
                        "can run code, so they load only with allow_pickle=True, for stores "
                        "you trust"
                    )
                    raise UnsafeCheckpointError(msg)
                return pickle.loads(base64.b64decode(n["b64"]))
        # IndexError: an empty numpy scalar; RuntimeError: torch refusing a device string;
        # OverflowError: a size past int64 (an int(inf) where JSON is parsed leniently).
        except (
            KeyError,
            TypeError,
            ValueError,
            IndexError,
            RuntimeError,
            OverflowError,
            struct.error,
        ) as e:
            if isinstance(e, IntegrityError | UnsafeCheckpointError):
                raise
            raise self._bad(path, f"malformed {t!r} node ({type(e).__name__}: {e})") from None
        raise self._bad(path, f"unknown node type {t!r}")

    def _dtensor_leaf(self, n: Mapping[str, Any], path: tuple[Any, ...]) -> Any:
        """A sharded tensor: read by the caller from the chunk index, by its flat name."""
        name = n["name"]
        dtype = SUPPORTED_DTYPES.get(n["dtype"])
        if not isinstance(name, str) or dtype is None:
            raise self._bad(path, "malformed sharded tensor reference")
        shape = [int(s) for s in n["shape"]]
        if self.meta or self._get_dtensor is None:
            return torch.empty(shape, dtype=dtype, device="meta")
        t = self._get_dtensor(name, path)
        if list(t.shape) != shape:
            raise self._bad(path, f"sharded tensor {name!r} is {list(t.shape)}, not {shape}")
        return t

    def _tensor(self, n: Mapping[str, Any], path: tuple[Any, ...]) -> Any:
        group, key = n["file"], n["key"]
        if not isinstance(group, str) or not isinstance(key, str):
            raise self._bad(path, "tensor reference is not (file, key)")
        dtype = SUPPORTED_DTYPES.get(n["dtype"])
        if dtype is None:
            raise self._bad(path, f"unsupported dtype {n['dtype']!r}")
        shape = [int(s) for s in n["shape"]]
        if self.meta or self._get is None:
            return torch.empty(shape, dtype=dtype, device="meta")
        base = self._cache.get((group, key))
        if base is None:
            base = self._get(group, key)
            self._cache[(group, key)] = base
        if n["t"] == "view":
            if base.dtype != dtype:
                raise self._bad(path, f"view of {dtype} into a {base.dtype} tensor")
            stride = [int(s) for s in n["stride"]]
            offset = int(n["offset"])
            if len(stride) != len(shape) or offset < 0 or any(s < 0 for s in stride + shape):
                raise self._bad(path, "malformed view")
            last = offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True) if d > 0)
            if any(d == 0 for d in shape):
                last = offset
            if last >= max(base.numel(), 1) and base.numel() > 0:
                raise self._bad(path, "view runs past the tensor it views")
            t = torch.as_strided(base, shape, stride, offset)
        else:
            t = base
            if t.dtype != dtype or list(t.shape) != shape:
                got = f"{t.dtype}{list(t.shape)}"
                raise self._bad(
                    path, f"payload {group}:{key} is {got}, state.json says {dtype}{shape}"
                )
        if n["t"] == "ndarray":
            if np is None:
                raise IntegrityError(f"{format_path(path)}: numpy is needed to load numpy arrays")
            want = np.dtype(str(n["np_dtype"]))
            if want.kind not in "biufc":
                raise self._bad(path, f"numpy dtype {want} is not numeric")
            return t.numpy().astype(want, copy=True)
        if n.get("param"):
            pk = (group, key, bool(n.get("requires_grad")))
            p = self._params.get(pk) if n["t"] == "tensor" else None
            if p is None:
                p = torch.nn.Parameter(t, requires_grad=bool(n.get("requires_grad")))
                if n["t"] == "tensor":
                    self._params[pk] = p
            return p
        if n.get("requires_grad") and (t.is_floating_point() or t.is_complex()):
            # One leaf per stored tensor, as for Parameters: a leaf referenced twice in the
            # state (a list of params and a dict of them) comes back as one object, or the
            # gradients through one would never reach the other.
            if n["t"] != "tensor":
                return t.detach().requires_grad_(True)
            leaf = self._leaves.get((group, key))
            if leaf is None:
                leaf = self._leaves[(group, key)] = t.detach().requires_grad_(True)
            return leaf
        return t


_SAFE_KEY_RE = re.compile(r"[^A-Za-z0-9_.\-#]")


def tensor_key(path: tuple[Any, ...]) -> str:
    """A readable key for a tensor inside its group: its path after the top-level key.

    A model's ``state_dict`` keys come through unchanged (``layer.0.weight``), so the
    payload of a model loads with plain ``safetensors`` under the names people expect.
    """
    inner = path[1:]
    if not inner:
        return "_"
    return ".".join(str(p) for p in inner)

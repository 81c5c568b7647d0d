"""A state tree (``state.json``) checked as a restore decodes it, building nothing: ``verify``.

Deep ``verify`` checked that a state file is JSON, and restore then decoded it
(``codec/tree.py``'s ``TreeDecoder``): a step whose state names a tensor no payload holds,
contradicts a payload's header (another dtype or shape), or holds a malformed node
verified OK and could not be restored. Retention keeps "the newest step that verifies", so
``ckptstore prune`` deleted the older steps that did restore (found by review). This walks
the tree as the decoder does and says what it would refuse, reading only the payloads'
headers.

No torch: ``ckptstore verify`` and ``prune`` run without it (issue 12). Two checks of the
decoder ask torch (is this a device string; a dtype name of this torch): where torch is
loaded they ask it too, else they check the string's form. numpy's dtype names likewise.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from .dtypes import ITEMSIZE, SAFETENSORS_CODES

__all__ = ["TREE_MAX_DEPTH", "Contents", "check_state", "group_contents"]

#: As ``codec/tree.py``'s decoder: nodes nested deeper are refused (its ``_MAX_DEPTH + 5``).
TREE_MAX_DEPTH = 205

#: What a payload group holds: key -> (dtype name, shape); None where only the payload's own
#: decoder can tell (a ``torch.save`` zip: its tensors are described inside its pickle).
Contents = Mapping[str, tuple[str, list[int]]] | None

_NAME = re.compile(r"[a-z][a-z0-9_]*")
_DEVICE = re.compile(r"[a-z][a-z0-9_]*(:[0-9]+)?")
_NUMERIC_KINDS = "biufc"
#: The most problems reported for one state file (each top-level entry's first).
_MAX_PROBLEMS = 10


class _Bad(Exception):
    def __init__(self, path: tuple[Any, ...], what: str) -> None:
        super().__init__(what)
        self.path = path


def group_contents(
    groups: Mapping[str, list[str]],
    codes_of: Callable[[str], Mapping[str, tuple[str, list[int], int, int]] | None],
) -> dict[str, Contents]:
    """What each payload group holds, from its files' safetensors headers.

    ``codes_of(file)``: the file's header entries (``Header.codes``: key -> (safetensors
    code, shape, start, end)), or None where only its own decoder can tell (a zip, a
    compressed file, one whose check failed): its whole group is then unknown.
    """
    out: dict[str, Contents] = {}
    for group, names in groups.items():
        merged: dict[str, tuple[str, list[int]]] = {}
        for name in sorted(names):
            codes = codes_of(name)
            if codes is None:
                out[group] = None
                break
            for key, (code, shape, _a, _b) in codes.items():
                merged[key] = (SAFETENSORS_CODES[code], shape)
        else:
            out[group] = merged
    return out


def check_state(doc: Any, groups: Mapping[str, Contents], where: str) -> list[str]:
    """What a restore would refuse in the decoded state file ``doc``; ``[]`` if nothing.

    Args:
        doc: the state file's JSON, decoded.
        groups: the payload groups of this state file, by name.
        where: names the state file in the messages.
    """
    if not isinstance(doc, dict) or doc.get("ckptstore_state") != 1:
        return [f"{where}: not a ckptstore state (format 1)"]
    root = doc.get("root")
    keys = root.get("keys") if isinstance(root, dict) else None
    vals = root.get("vals") if isinstance(root, dict) else None
    if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
        return [f"{where}: malformed root"]
    out: list[str] = []
    walker = _Walker(groups)
    for k, node in zip(keys, vals, strict=True):
        if not _is_key(k):
            out.append(f"{where}: top-level key {k!r} is not str or int")
            break
        if isinstance(node, dict) and node.get("t") == "stateful":
            node = node.get("v")  # a module's, optimizer's...: unwrapped at the top only
        try:
            walker.node(node, (k,), 0)
        except _Bad as e:
            out.append(f"{where}: {_format_path(e.path)}: {e}; the checkpoint is corrupt")
        except RecursionError:
            out.append(f"{where}: state nested too deeply; the file is hostile")
        if len(out) >= _MAX_PROBLEMS:
            break
    return out


class _Walker:
    def __init__(self, groups: Mapping[str, Contents]) -> None:
        self.groups = groups

    def node(self, n: Any, path: tuple[Any, ...], depth: int) -> None:
        if depth > TREE_MAX_DEPTH:
            raise _Bad(path, "nested too deeply")
        if n is None or isinstance(n, bool | int | str | float):
            return
        if isinstance(n, list):
            for i, x in enumerate(n):
                self.node(x, (*path, i), depth + 1)
            return
        if not isinstance(n, dict):
            raise _Bad(path, f"unexpected JSON {type(n).__name__}")
        t = n.get("t")
        try:
            if t in ("dict", "odict"):
                keys, vals = n["keys"], n["vals"]
                if not isinstance(keys, list) or not isinstance(vals, list):
                    raise _Bad(path, "dict keys and values do not match")
                if len(keys) != len(vals):
                    raise _Bad(path, "dict keys and values do not match")
                for k, x in zip(keys, vals, strict=True):
                    if not _is_key(k):
                        raise _Bad(path, f"dict key {k!r} is not str or int")
                    self.node(x, (*path, k), depth + 1)
                if "meta" in n:
                    self.node(n["meta"], (*path, "_metadata"), depth + 1)
            elif t == "bigint":
                int(str(n["hex"]), 16)
            elif t == "tuple":
                v = n["v"]
                if not isinstance(v, list | str | dict):  # what the decoder can iterate
                    raise _Bad(path, f"malformed 'tuple' node ({type(v).__name__} 'v')")
                for i, x in enumerate(v):
                    self.node(x, (*path, i), depth + 1)
            elif t == "float":
                if len(bytes.fromhex(n["bits"])) != 8:
                    raise _Bad(path, "malformed 'float' node (not 8 bytes)")
            elif t in ("bytes", "bytearray"):
                base64.b64decode(n["b64"], validate=True)
            elif t == "dtype":
                if not _torch_dtype(n["v"]):
                    raise _Bad(path, f"unknown dtype {n['v']!r}")
            elif t == "size":
                [int(x) for x in n["v"]]
            elif t == "device":
                _device(n["v"], path)
            elif t == "npscalar":
                np = _numeric_numpy(str(n["dtype"]), path)
                raw = bytes.fromhex(n["hex"])
                if np is not None:
                    np.frombuffer(raw, dtype=np.dtype(str(n["dtype"])))[0]
            elif t in ("tensor", "view", "ndarray"):
                self.tensor(n, path)
            elif t == "dtensor":
                name, dtype = n["name"], n["dtype"]
                if not isinstance(name, str) or dtype not in ITEMSIZE:
                    raise _Bad(path, "malformed sharded tensor reference")
                [int(s) for s in n["shape"]]
            elif t == "pickle":
                # Never unpickled here: a restore with allow_pickle=True unpickles it.
                base64.b64decode(n["b64"])
            else:
                raise _Bad(path, f"unknown node type {t!r}")
        except _Bad:
            raise
        except (
            KeyError,
            TypeError,
            ValueError,
            IndexError,
            OverflowError,
            binascii.Error,
        ) as e:
            raise _Bad(path, f"malformed {t!r} node ({type(e).__name__}: {e})") from None

    def tensor(self, n: Mapping[str, Any], path: tuple[Any, ...]) -> None:
        group, key = n["file"], n["key"]
        if not isinstance(group, str) or not isinstance(key, str):
            raise _Bad(path, "tensor reference is not (file, key)")
        dtype = n["dtype"]
        if dtype not in ITEMSIZE:
            raise _Bad(path, f"unsupported dtype {dtype!r}")
        shape = [int(s) for s in n["shape"]]
        if group not in self.groups:
            raise _Bad(path, f"no payload file for group {group!r}")
        contents = self.groups[group]
        if n["t"] == "ndarray":
            _numeric_numpy(str(n["np_dtype"]), path)
        if n.get("param") and n.get("requires_grad") and not _differentiable(dtype):
            # torch refuses it: "Only Tensors of floating point and complex dtype can
            # require gradients".
            raise _Bad(path, f"a torch.{dtype} parameter cannot require gradients")
        if contents is None:
            if n["t"] == "view":
                _view_form(n, shape, path)
            return  # what the zip holds is for its own decoder to say
        stored = contents.get(key)
        if stored is None:
            raise _Bad(path, f"tensor {key!r} missing from payload {group!r}")
        got_dtype, got_shape = stored
        if n["t"] == "view":
            if got_dtype != dtype:
                raise _Bad(path, f"view of torch.{dtype} into a torch.{got_dtype} tensor")
            offset, stride = _view_form(n, shape, path)
            numel = math.prod(got_shape)
            last = offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True) if d > 0)
            if any(d == 0 for d in shape):
                last = offset
            if last >= max(numel, 1) and numel > 0:
                raise _Bad(path, "view runs past the tensor it views")
        elif got_dtype != dtype or got_shape != shape:
            raise _Bad(
                path,
                f"payload {group}:{key} is torch.{got_dtype}{got_shape}, state.json says "
                f"torch.{dtype}{shape}",
            )


def _differentiable(dtype: str) -> bool:
    return dtype.startswith(("float", "complex")) or dtype == "bfloat16"


def _view_form(
    n: Mapping[str, Any], shape: list[int], path: tuple[Any, ...]
) -> tuple[int, list[int]]:
    stride = [int(s) for s in n["stride"]]
    offset = int(n["offset"])
    if len(stride) != len(shape) or offset < 0 or any(s < 0 for s in stride + shape):
        raise _Bad(path, "malformed view")
    return offset, stride


def _is_key(k: object) -> bool:
    return isinstance(k, str | int) and not isinstance(k, bool)


def _torch_dtype(name: object) -> bool:
    """Whether ``name`` names a dtype of torch (its form, where torch is not loaded)."""
    if not isinstance(name, str):
        return False
    torch = sys.modules.get("torch")
    if torch is not None:
        return name in _torch_dtype_names(torch)
    return name in ITEMSIZE or _NAME.fullmatch(name) is not None


@functools.cache
def _torch_dtype_names(torch: Any) -> frozenset[str]:
    """The names the decoder takes: each dtype's own (``float32``), not an alias (``float``)."""
    return frozenset(
        str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)
    )


def _device(v: object, path: tuple[Any, ...]) -> None:
    """Refuse what ``torch.device(str(v))`` refuses (its form, where torch is not loaded)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.device(str(v))
        except RuntimeError as e:
            raise _Bad(path, f"malformed 'device' node (RuntimeError: {e})") from None
    elif _DEVICE.fullmatch(str(v)) is None:
        raise _Bad(path, f"malformed 'device' node ({str(v)!r} is not a device string)")


def _numeric_numpy(name: str, path: tuple[Any, ...]) -> Any:
    """The numpy module where it is loaded, once ``name`` is a numeric dtype of it; else None.

    numpy has many spellings of its dtypes: where it is not loaded, its decoder says.
    """
    np = sys.modules.get("numpy")
    if np is None:
        return None
    kind = np.dtype(name).kind
    if kind not in _NUMERIC_KINDS:
        raise _Bad(path, f"numpy dtype {np.dtype(name)} is not numeric")
    return np


def _format_path(path: tuple[Any, ...]) -> str:
    """As ``codec/tree.py``'s ``format_path``: ``state['opt']['state'][0]``."""
    return "state" + "".join(f"[{p!r}]" for p in path)

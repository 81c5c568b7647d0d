"""Comparing two checkpoints entry by entry, tensors by their largest absolute difference.

What ``ckptstore diff`` prints, for Python: :func:`diff_steps`. Full tensors are compared one
pair at a time; DTensor checkpoints are consolidated from their chunks, so steps saved on
different world sizes, or a DTensor step and a replicated one, compare value by value.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from .._fmt import key_text
from ..codec.tree import np
from ..sharded.consolidate import StepTensors, TensorRef
from .stores import committed_step, open_store, partial_copies_explained, reaching

__all__ = ["DiffResult", "DiffRow", "diff_steps"]


@dataclasses.dataclass
class DiffRow:
    """One difference between two checkpoints."""

    path: str
    change: str  # "added", "removed", "changed"
    a: str = ""
    b: str = ""
    max_abs_diff: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        d = dataclasses.asdict(self)
        if self.max_abs_diff is not None and not math.isfinite(self.max_abs_diff):
            d["max_abs_diff"] = str(self.max_abs_diff)
        return d


@dataclasses.dataclass
class DiffResult:
    """What ``ckptstore diff`` found."""

    root: str
    a: int
    b: int
    rows: list[DiffRow]
    same: int
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "root": self.root,
            "a": self.a,
            "b": self.b,
            "same": self.same,
            "differences": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        }


def _describe(v: Any) -> str:
    if isinstance(v, TensorRef):
        return v.describe()
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if np is not None and (isinstance(a, np.ndarray) or isinstance(b, np.ndarray)):
        # Element by element: their repr (the fallback below) elides arrays of over 1,000
        # elements and rounds floats to 8 digits, so differing arrays compared "same".
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        # Item by item: a == b holds NaN != NaN, so identical lists of a NaN differed.
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except (ValueError, RuntimeError):  # other array-likes
        return repr(a) == repr(b)


def _equal_but_nans(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` (one dtype, one shape) are equal but for NaNs in one place.

    Infinities stay themselves (``nan_to_num`` turned them into the largest finite values,
    so +inf compared equal to ``finfo.max``), and a complex tensor's parts are compared
    each.
    """
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    if not x.is_floating_point():
        return False
    if x.element_size() == 1:  # float8: no masked_fill; float32 holds each value exactly
        x, y = x.float(), y.float()
    nx, ny = x.isnan(), y.isnan()
    return torch.equal(nx, ny) and torch.equal(x.masked_fill(nx, 0), y.masked_fill(ny, 0))


def _component(p: Any) -> str:
    """One key of a leaf's path as ``diff`` prints it, joined with ``/``.

    No two keys print the same, or diff called two changed tensors "same"
    (:func:`~ckptstore._fmt.key_text`).
    """
    return key_text(p, "/")


def _leaves(src: StepTensors) -> dict[str, Any]:
    """``{"model/inp.weight": TensorRef, "step": 3, ...}``: the state's leaves by path."""
    out: dict[str, Any] = {}
    for key in src.keys:
        for path, value in src.leaves(key):
            out["/".join(_component(p) for p in path)] = value
    return out


def _param_groups(leaves: Mapping[str, Any], key: str) -> list[Any] | None:
    groups: list[Any] = []
    while isinstance(leaves.get(f"{key}/param_groups/{len(groups)}/params"), list):
        groups.append(leaves[f"{key}/param_groups/{len(groups)}/params"])
    return groups or None


def _match_optimizer_names(
    left: dict[str, Any], right: dict[str, Any], keys: set[str], steps: tuple[int, int]
) -> list[str]:
    """Key numbered optimizer state (``Optimizer.state_dict()``) by parameter name.

    A DTensor save stores optimizer state keyed by parameter name, in its parameter groups'
    order; a replicated save of the same optimizer numbers the parameters in that order. When
    one side names and the other numbers, with groups of the same sizes, the numbered side
    is renamed (in place) so the two compare entry by entry. Returns a note per entry.
    """
    notes = []
    for key in sorted(keys):
        gl, gr = _param_groups(left, key), _param_groups(right, key)
        if gl is None or gr is None or [len(g) for g in gl] != [len(g) for g in gr]:
            continue
        fl = [p for g in gl for p in g]
        fr = [p for g in gr for p in g]
        named = None
        if all(isinstance(p, str) for p in fl) and all(type(p) is int for p in fr):
            named, numbered, names, ids = 0, right, fl, fr
        elif all(isinstance(p, str) for p in fr) and all(type(p) is int for p in fl):
            named, numbered, names, ids = 1, left, fr, fl
        if named is None or len(set(names)) != len(names):
            continue
        rename = {str(i): n for i, n in zip(ids, names, strict=True)}
        prefix = f"{key}/state/"
        for path in [p for p in numbered if p.startswith(prefix)]:
            pid, sep, rest = path[len(prefix) :].partition("/")
            if pid in rename:
                numbered[f"{prefix}{_component(rename[pid])}{sep}{rest}"] = numbered.pop(path)
        for g, group in enumerate(gl if named == 1 else gr):
            numbered[f"{key}/param_groups/{g}/params"] = [rename[str(i)] for i in group]
        notes.append(
            f"{key}: step {steps[1 - named]} numbers the optimizer's parameters, step "
            f"{steps[named]} names them (a DTensor save); matched by position in the "
            "parameter groups"
        )
    return notes


def _diff_tensors(path: str, x: Any, y: Any) -> DiffRow | None:
    """``None`` when equal (NaNs in the same places count as equal), else the row."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        if _same_value(x, y):
            return None
        return DiffRow(path, "changed", a=_describe(x), b=_describe(y))
    if x.dtype != y.dtype or x.shape != y.shape:
        return DiffRow(path, "changed", a=_describe(x), b=_describe(y))
    if torch.equal(x, y) or _equal_but_nans(x, y):
        return None
    return DiffRow(path, "changed", a=_describe(x), b=_describe(y), max_abs_diff=_max_diff(x, y))


def _max_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """The largest ``|x - y|`` of two tensors of one dtype and shape that differ (NaN: inf).

    Integers are subtracted as integers: through float64, 2**62 + 1 and 2**62 differed by
    0 (found by review).
    """
    if x.numel() == 0:
        return 0.0
    if x.is_floating_point() or x.is_complex():
        wide = torch.complex128 if x.is_complex() else torch.float64
        return float((x.to(wide) - y.to(wide)).abs().nan_to_num(nan=math.inf).max())
    if x.dtype == torch.uint64:
        # Its bits as int64 with the top bit flipped: u - 2**63, in the same order, so
        # every difference is exact (through float64, 2**63 and 2**63 + 1 differed by 0).
        top = torch.tensor(-(2**63), dtype=torch.int64)
        xi, yi = x.view(torch.int64) ^ top, y.view(torch.int64) ^ top
    else:
        xi, yi = x.to(torch.int64), y.to(torch.int64)
    hi, lo = torch.maximum(xi, yi), torch.minimum(xi, yi)
    d = hi - lo  # below 0 where it wrapped (a difference of 2**63 or more)
    wrapped = d < 0
    if bool(wrapped.any()):
        pairs = zip(hi[wrapped].tolist(), lo[wrapped].tolist(), strict=True)
        return float(max(a - b for a, b in pairs))
    return float(d.max())


def diff_steps(
    root: str | os.PathLike[str],
    a: int,
    b: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> DiffResult:
    """Compare two checkpoints entry by entry (tensors by max absolute difference).

    Full tensors are compared, read one pair at a time (never a whole checkpoint in memory):
    a DTensor checkpoint is consolidated from its chunks, so steps saved on different world
    sizes, or a DTensor step and a replicated step of the same model, compare value by
    value. Optimizer state keyed by parameter name (DTensor saves) is matched with numbered
    state (replicated saves) by position in the parameter groups; ``notes`` says so.

    Args:
        root: the store: a local directory or an fsspec URL.
        a: the first step.
        b: the second step.
        storage_options: fsspec options for a URL.

    Returns:
        The differences (empty when the two are identical) and the number of equal leaves.

    Raises:
        NoCheckpointError: no store at ``root``, or no such step.
        IntegrityError: a checkpoint is corrupt.
        CkptStoreError: per-rank state of several ranks (it has no full form to compare).
    """
    storage = open_store(root, storage_options)
    with reaching(storage.root):
        ma = storage.read_manifest(committed_step(storage, a))
        mb = storage.read_manifest(committed_step(storage, b))
    with (
        partial_copies_explained(storage, ma, mb),
        StepTensors(storage, a, manifest=ma) as sa,
        StepTensors(storage, b, manifest=mb) as sb,
    ):
        left, right = _leaves(sa), _leaves(sb)
        common = {_component(k) for k in sa.keys} & {_component(k) for k in sb.keys}
        notes = _match_optimizer_names(left, right, common, (a, b))
        rows: list[DiffRow] = []
        same = 0
        for path in sorted(set(left) | set(right)):
            if path not in right:
                rows.append(DiffRow(path, "removed", a=_describe(left[path])))
                continue
            if path not in left:
                rows.append(DiffRow(path, "added", b=_describe(right[path])))
                continue
            x, y = left[path], right[path]
            if isinstance(x, TensorRef) and isinstance(y, TensorRef):
                if (x.dtype, x.shape) != (y.dtype, y.shape):
                    rows.append(DiffRow(path, "changed", a=x.describe(), b=y.describe()))
                    continue
                row = _diff_tensors(path, sa.load(x), sb.load(y))  # one pair in memory
            elif isinstance(x, TensorRef) or isinstance(y, TensorRef):
                row = DiffRow(path, "changed", a=_describe(x), b=_describe(y))
            else:
                row = _diff_tensors(path, x, y)
            if row is None:
                same += 1
            else:
                rows.append(row)
    return DiffResult(storage.root, a, b, rows, same, notes)

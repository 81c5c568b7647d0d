"""ckptstore.codec.tree: every supported value round-trips exactly, types included.

Most tests go through ``CheckpointManager.save`` and ``load``/``restore`` for every payload
format and compression (the ``codec`` fixture), so they prove the whole path: encoder, payload
writer, checksum, reader, decoder. The last section pins the typed JSON of ``state.json``
node by node, so the on-disk format cannot change without a test saying so.
"""

from __future__ import annotations

import collections
import dataclasses
import fractions
import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from _helpers import RunsCode

from ckptstore import CheckpointManager, IntegrityError, UnsafeCheckpointError
from ckptstore.codec import payload
from ckptstore.codec.tree import (
    SUPPORTED_DTYPES,
    TreeDecoder,
    TreeEncoder,
    format_path,
    stored_tensors,
    tensor_key,
)

# ---- helpers ------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, for bit-exact comparisons (NaN payloads included)."""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def fbits(x: float) -> str:
    return struct.pack(">d", x).hex()


def from_bits(hexstr: str) -> float:
    return struct.unpack(">d", bytes.fromhex(hexstr))[0]


def assert_identical(got: Any, want: Any, path: str = "state") -> None:
    """Exact equality, recursively: same types, same bits, same key order and key types."""
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, path
        assert got.shape == want.shape, path
        assert got.requires_grad == want.requires_grad, path
        assert got.device.type == "cpu", path
        assert bits(got) == bits(want), path
    elif isinstance(want, np.ndarray):
        assert got.dtype.str == want.dtype.str, path
        assert got.shape == want.shape, path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, np.generic):
        assert got.dtype.str == want.dtype.str, path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, float):
        assert fbits(got) == fbits(want), path
    elif isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], path
        for k in want:
            assert_identical(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_identical(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


@dataclasses.dataclass
class Point:
    x: int
    y: float


def patterned(dtype: torch.dtype, n: int = 8) -> torch.Tensor:
    """A tensor of ``n`` elements whose bytes are 0, 7, 14, ... (every bit pattern differs)."""
    if dtype == torch.bool:
        return torch.tensor([i % 3 == 0 for i in range(n)])
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.tensor([(i * 7 + 3) % 256 for i in range(n * size)], dtype=torch.uint8)
    return raw.view(dtype)


def everything() -> dict[str, Any]:
    """A fresh state holding one of every supported kind of value."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "scalars": {
            "none": None,
            "true": True,
            "false": False,
            "int": 7,
            "neg": -(2**63) - 1,
            "huge": 2**100,
            "nhuge": -(2**100),
            "float": 0.1,
            "tiny": 5e-324,
            "nan": float("nan"),
            "inf": math.inf,
            "ninf": -math.inf,
            "nzero": -0.0,
            "str": "héllo ✓ 日本 \U0001f600 \x00",
            "empty": "",
            "bytes": b"\x00\xff\x80",
            "bytearray": bytearray(b"\x01\x02"),
        },
        "containers": {
            "list": [1, [2, [3]], []],
            "tuple": (1, (2.5, "x"), ()),
            "list_of_tuples": [(1, 2), (3,)],
            "int_keys": {0: "zero", 1: "one", -5: "neg"},
            "mixed_keys": {"1": "str one", 1: "int one"},
            "odict": collections.OrderedDict([("b", 1), ("a", 2)]),
            "empty_dict": {},
        },
        "torch_meta": {
            "dtypes": [torch.float32, torch.bfloat16, torch.complex128, torch.float8_e4m3fn],
            "size": torch.Size([2, 3]),
            "size0": torch.Size([]),
            "cpu": torch.device("cpu"),
            "cuda1": torch.device("cuda", 1),
        },
        "numpy": {
            "f64": np.arange(5, dtype=np.float64) / 3,
            "f32": np.array([1.5, -0.0, np.nan], dtype=np.float32),
            "be_f4": np.arange(4, dtype=">f4"),
            "be_i8": np.array([-1, 2**40], dtype=">i8"),
            "u16": np.array([0, 65535], dtype=np.uint16),
            "u64": np.array([2**64 - 1], dtype=np.uint64),
            "bool": np.array([True, False]),
            "c64": np.array([1 + 2j], dtype=np.complex64),
            "f16": np.array([0.5], dtype=np.float16),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
            "strided": np.arange(10, dtype=np.int16)[::3],
            "zero_d": np.array(3.5),
            "empty": np.zeros((0, 3), dtype=np.float32),
            "s_f32": np.float32(1.5),
            "s_f64": np.float64(-0.0),
            "s_i64": np.int64(-3),
            "s_u8": np.uint8(255),
            "s_bool": np.bool_(True),
            "s_c64": np.complex64(1 - 2j),
            "s_f16": np.float16(0.25),
        },
        "tensors": {
            **{name: patterned(dt) for name, dt in SUPPORTED_DTYPES.items()},
            "zero_d": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
            "empty_cols": torch.zeros(3, 0, dtype=torch.int64),
            "transposed": torch.arange(6, dtype=torch.float64).reshape(2, 3).t(),
            "strided": torch.arange(10, dtype=torch.int32)[::3],
            "expanded": torch.arange(3.0).expand(4, 3),
            "grad": torch.ones(2, requires_grad=True),
            "param": torch.nn.Parameter(torch.full((2,), 3.0)),
            "frozen": torch.nn.Parameter(torch.zeros(2), requires_grad=False),
        },
        "shared": {"base": base, "tied": base, "view": base[1:], "t": base.t()},
    }


# ---- round trip through the manager -------------------------------------------------------


def test_everything_roundtrips_through_load_and_restore(
    tmp_path: Path, codec: dict[str, Any]
) -> None:
    with CheckpointManager(tmp_path / "s", **codec) as mgr:
        mgr.save(3, everything())
        loaded = mgr.load()
        target: dict[str, Any] = dict.fromkeys(everything(), "placeholder")
        assert mgr.restore(target) == 3
    assert_identical(loaded, everything())
    assert_identical(target, everything())


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_stored_tensors_bound_every_payload_from_the_state_alone(tmp_path: Path, fmt: str) -> None:
    # How far restore lets a compressed payload inflate comes from state.json alone; it
    # must hold every payload the manager writes, with room to spare but not unbounded.
    state = everything()
    state["many"] = {
        f"{'k' * 180}.{i}": torch.zeros([1] * (i % 9), dtype=torch.float16) for i in range(300)
    }
    with CheckpointManager(tmp_path / "s", format=fmt) as mgr:
        mgr.save(1, state)
    step = tmp_path / "s" / "step-000000000001"
    tree = json.loads((step / "state.json").read_bytes())["root"]
    stored = stored_tensors(tree)
    manifest = json.loads((step / "manifest.json").read_bytes())
    payloads = {n: e for n, e in manifest["files"].items() if e["codec"] != "json"}
    assert sorted(stored) == sorted(payload.group_of(n) for n in payloads)
    for name in payloads:
        tensors = stored[payload.group_of(name)]
        data = (step / name).read_bytes()
        if fmt == "safetensors":
            keys = set(safetensors.torch.load(data))
        else:
            keys = set(torch.load(step / name, weights_only=True))
        assert keys == set(tensors), name
        held = sum(size for size, _ in tensors.values())
        assert held <= len(data) <= payload.max_payload_bytes(tensors), name
        # ... and no more than a few kB a tensor and 1 MiB a file beyond their data.
        assert payload.max_payload_bytes(tensors) <= held + (1 << 20) + 8192 * len(tensors)
    # Malformed nodes add nothing (decoding reports them); views add no entry of their own.
    assert stored_tensors([{"t": "tensor", "file": "g"}, {"t": "tensor", "dtype": [1]}, 5]) == {}
    view = {"t": "view", "file": "g", "key": "k", "dtype": "float32", "shape": [10**9]}
    assert stored_tensors({"t": "dict", "keys": ["v"], "vals": [view]}) == {}


def test_scalars_exact(roundtrip: Any) -> None:
    nan_payload = from_bits("7ff800000000beef")
    neg_nan = from_bits("fff8000000000000")
    out = roundtrip({"s": {"a": [2**100, -(2**100), -7, nan_payload, neg_nan, -0.0, 0.0]}})
    huge, nhuge, neg, nanp, nnan, nzero, zero = out["s"]["a"]
    assert type(huge) is int
    assert huge == 1267650600228229401496703205376
    assert type(nhuge) is int
    assert nhuge == -1267650600228229401496703205376
    assert type(neg) is int
    assert neg == -7
    assert fbits(nanp) == "7ff800000000beef"
    assert fbits(nnan) == "fff8000000000000"
    assert math.copysign(1.0, nzero) == -1.0
    assert math.copysign(1.0, zero) == 1.0
    inf = roundtrip({"s": (math.inf, -math.inf, float("nan"))})["s"]
    assert type(inf) is tuple
    assert inf[0] == math.inf
    assert inf[1] == -math.inf
    assert fbits(inf[2]) == "7ff8000000000000"


def test_containers_keep_types_keys_and_order(roundtrip: Any) -> None:
    state = {
        "opt": {
            "state": {3: {"step": 1}, 0: {"step": 2}},
            "groups": [{"params": [0, 3], "betas": (0.9, 0.999)}],
        },
        "od": collections.OrderedDict([("z", 1), ("a", (2,))]),
    }
    out = roundtrip(state)
    assert type(out["opt"]) is dict
    assert list(out["opt"]["state"]) == [3, 0]
    assert all(type(k) is int for k in out["opt"]["state"])
    betas = out["opt"]["groups"][0]["betas"]
    assert type(betas) is tuple
    assert betas == (0.9, 0.999)
    assert type(out["od"]) is collections.OrderedDict
    assert list(out["od"].items()) == [("z", 1), ("a", (2,))]


def test_numpy_dtypes_come_back_unchanged(roundtrip: Any) -> None:
    out = roundtrip({"np": everything()["numpy"]})["np"]
    assert out["be_f4"].dtype == np.dtype(">f4")
    assert out["be_f4"].dtype.str == ">f4"
    assert out["be_f4"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out["be_i8"].tolist() == [-1, 2**40]
    assert out["u64"].tolist() == [2**64 - 1]
    assert out["fortran"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["strided"].tolist() == [0, 3, 6, 9]
    assert out["zero_d"].shape == ()
    assert out["zero_d"].item() == 3.5
    assert out["empty"].shape == (0, 3)
    assert out["f64"].flags.writeable
    assert type(out["s_f32"]) is np.float32
    assert out["s_f32"] == np.float32(1.5)
    assert type(out["s_f64"]) is np.float64
    assert math.copysign(1.0, out["s_f64"]) == -1.0
    assert type(out["s_i64"]) is np.int64
    assert out["s_i64"] == -3
    assert type(out["s_bool"]) is np.bool_
    assert bool(out["s_bool"]) is True
    assert type(out["s_c64"]) is np.complex64
    assert out["s_c64"] == np.complex64(1 - 2j)


def test_every_supported_tensor_dtype_bit_exact(roundtrip: Any) -> None:
    state = {"t": {name: patterned(dt) for name, dt in SUPPORTED_DTYPES.items()}}
    out = roundtrip(state)["t"]
    assert list(out) == list(SUPPORTED_DTYPES)
    for name, dt in SUPPORTED_DTYPES.items():
        assert type(out[name]) is torch.Tensor, name
        assert out[name].dtype == dt, name
        assert out[name].shape == (8,), name
        assert bits(out[name]) == bits(state["t"][name]), name


def test_special_tensor_values(roundtrip: Any) -> None:
    state = {
        "bf16": torch.tensor([1.5, -0.0, math.inf, math.nan], dtype=torch.bfloat16),
        "u64": torch.tensor([-1, 5], dtype=torch.int64).view(torch.uint64),
        "u32": torch.tensor([-1], dtype=torch.int32).view(torch.uint32),
        "u16": torch.tensor([-1], dtype=torch.int16).view(torch.uint16),
        "c64": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
        "bool": torch.tensor([[True, False], [False, True]]),
        "f8": torch.tensor([0.5, -2.0, 448.0], dtype=torch.float8_e4m3fn),
    }
    out = roundtrip({"t": state})["t"]
    assert out["bf16"].dtype == torch.bfloat16
    assert bits(out["bf16"]) == bytes([0xC0, 0x3F, 0x00, 0x80, 0x80, 0x7F, 0xC0, 0x7F])
    assert out["u64"].dtype == torch.uint64
    assert out["u64"].view(torch.int64).tolist() == [-1, 5]
    assert out["u32"].view(torch.int32).tolist() == [-1]
    assert out["u16"].dtype == torch.uint16
    assert out["u16"].view(torch.int16).tolist() == [-1]
    assert out["c64"].tolist() == [complex(1, 2), complex(0, -3.5)]
    assert out["bool"].tolist() == [[True, False], [False, True]]
    assert out["f8"].float().tolist() == [0.5, -2.0, 448.0]


def test_zero_d_empty_and_non_contiguous_tensors(roundtrip: Any) -> None:
    m = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    state = {
        "zero_d": torch.tensor(-1.25, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "transposed": m.t(),
        "cols": m[:, 1::2],
        "expanded": torch.tensor([1, 2]).expand(3, 2),
    }
    out = roundtrip({"t": state})["t"]
    assert out["zero_d"].shape == ()
    assert out["zero_d"].item() == -1.25
    assert out["empty"].shape == (0, 3)
    assert out["empty"].dtype == torch.float32
    assert out["transposed"].tolist() == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert out["cols"].tolist() == [[1, 3], [5, 7], [9, 11]]
    assert out["expanded"].tolist() == [[1, 2], [1, 2], [1, 2]]


def test_shared_storage_stays_shared(roundtrip: Any) -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"m": {"a": a, "tied": a, "view": a[1:], "t": a.t()}, "other": {"tied": a}}
    out = roundtrip(state)
    got = out["m"]
    assert got["tied"] is got["a"]
    assert out["other"]["tied"] is got["a"]  # tied across top-level entries too
    assert got["view"].tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert got["t"].tolist() == a.t().tolist()
    assert got["view"].untyped_storage().data_ptr() == got["a"].untyped_storage().data_ptr()
    assert got["view"].data_ptr() == got["a"].data_ptr() + 4 * 4
    got["a"][1, 0] = 100.0
    assert got["view"][0, 0].item() == 100.0
    assert got["t"][0, 1].item() == 100.0


def test_views_are_stored_once(tmp_path: Path) -> None:
    import safetensors.torch

    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    other = torch.arange(4.0)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"m": {"a": a, "tied": a, "view": a[1:], "t": a.t(), "o": other[1:]}})
    on_disk = safetensors.torch.load_file(tmp_path / "step-000000000001" / "m.safetensors")
    # a's views reference it; a view without its base in the state is stored as a copy.
    assert sorted(on_disk) == ["a", "o"]
    assert on_disk["o"].tolist() == [1.0, 2.0, 3.0]
    tree = json.loads((tmp_path / "step-000000000001" / "state.json").read_bytes())
    vals = tree["root"]["vals"][0]["vals"]
    assert vals[1] == {"t": "tensor", "dtype": "float32", "shape": [2, 3], "file": "m", "key": "a"}
    assert vals[2] == {
        "t": "view",
        "dtype": "float32",
        "shape": [1, 3],
        "file": "m",
        "key": "a",
        "offset": 3,
        "stride": [3, 1],
    }
    assert vals[3]["t"] == "view"
    assert vals[3]["stride"] == [1, 3]
    assert vals[3]["offset"] == 0


def test_colliding_and_reserved_tensor_keys(roundtrip: Any) -> None:
    # "a.b" and ["a"]["b"] want the same payload key; "__metadata__" is reserved by safetensors.
    state = {
        "m": {
            "a.b": torch.tensor([1.0]),
            "a": {"b": torch.tensor([2.0])},
            "__metadata__": torch.tensor([3.0]),
            "_": torch.tensor([4.0]),
        },
        "top": torch.tensor([5.0]),
    }
    out = roundtrip(state)
    assert out["m"]["a.b"].tolist() == [1.0]
    assert out["m"]["a"]["b"].tolist() == [2.0]
    assert out["m"]["__metadata__"].tolist() == [3.0]
    assert out["m"]["_"].tolist() == [4.0]
    assert out["top"].tolist() == [5.0]


def test_parameters_and_requires_grad(roundtrip: Any) -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    frozen = torch.nn.Parameter(torch.tensor([3.0]), requires_grad=False)
    leaf = torch.tensor([4.0], requires_grad=True)
    out = roundtrip(
        {
            "t": {"p": p, "p2": p, "frozen": frozen, "leaf": leaf, "plain": leaf.detach()},
            "params": [leaf],
        }
    )
    t = out["t"]
    # A leaf referenced twice is one leaf again (it came back as two, with one storage:
    # the gradients through one never reached the other; found by review).
    assert out["params"][0] is t["leaf"]
    assert type(t["p"]) is torch.nn.Parameter
    assert t["p"].requires_grad is True
    assert t["p2"] is t["p"]
    assert t["p"].tolist() == [1.0, 2.0]
    assert type(t["frozen"]) is torch.nn.Parameter
    assert t["frozen"].requires_grad is False
    assert type(t["leaf"]) is torch.Tensor
    assert t["leaf"].requires_grad is True
    assert t["leaf"].is_leaf
    assert type(t["plain"]) is torch.Tensor
    assert t["plain"].requires_grad is False


def test_lazy_conjugate_and_negative_views_are_stored_as_they_read(roundtrip: Any) -> None:
    """z.conj() is a flag on z's memory: its bytes were stored unconjugated (and, as an
    identical view of z, as z itself), so one of the two came back with the other's values."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    base = torch.tensor([1.0, -2.0])
    neg = torch._neg_view(base)
    assert z.conj().is_conj()
    assert neg.is_neg()
    out = roundtrip({"c": {"z": z, "zc": z.conj(), "base": base, "neg": neg}})["c"]
    assert out["z"].tolist() == [1 + 2j, 3 - 4j]
    assert out["zc"].tolist() == [1 - 2j, 3 + 4j]
    assert out["base"].tolist() == [1.0, -2.0]
    assert out["neg"].tolist() == [-1.0, 2.0]
    assert not out["zc"].is_conj()
    assert not out["neg"].is_neg()
    # A complex leaf keeps requires_grad as a floating one does.
    leaf = torch.tensor([1j], dtype=torch.complex64, requires_grad=True)
    assert roundtrip({"l": leaf})["l"].requires_grad is True


def test_multistep_lr_milestones_come_back_as_a_counter(tmp_path: Path) -> None:
    """MultiStepLR's state holds a collections.Counter (refused as needing pickle); its
    closed form (step(epoch)) calls milestones.elements(), which a plain dict lacks."""

    def job() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.MultiStepLR]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)

    opt, sched = job()
    for _ in range(3):
        opt.step()
        sched.step()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"optimizer": opt, "scheduler": sched})
        opt2, sched2 = job()
        assert mgr.restore({"optimizer": opt2, "scheduler": sched2}) == 3
        assert mgr.load(3)["scheduler"]["milestones"] == collections.Counter([2, 4, 4])
    assert type(sched2.milestones) is collections.Counter
    assert sched2.milestones == sched.milestones
    lrs, lrs2 = [], []
    for o, sc, out in ((opt, sched, lrs), (opt2, sched2, lrs2)):
        for _ in range(3):
            o.step()
            sc.step()
            out.append(sc.get_last_lr())
    assert lrs2 == lrs == [[0.125]] * 3  # 0.5 at epoch 2, 0.5**3 from epoch 4
    assert sched2._get_closed_form_lr() == sched._get_closed_form_lr()


def test_torch_metadata_objects(roundtrip: Any) -> None:
    out = roundtrip({"m": everything()["torch_meta"]})["m"]
    assert out["dtypes"] == [torch.float32, torch.bfloat16, torch.complex128, torch.float8_e4m3fn]
    assert type(out["size"]) is torch.Size
    assert out["size"] == torch.Size([2, 3])
    assert type(out["size0"]) is torch.Size
    assert len(out["size0"]) == 0
    assert out["cpu"] == torch.device("cpu")
    assert out["cuda1"] == torch.device("cuda", 1)
    assert type(out["cuda1"]) is torch.device


# ---- refusals and pickle ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "where", "what"),
    [
        ({"obj": object()}, "state['extra']['obj']", "objects of type builtins.object"),
        ({"s": {1, 2}}, "state['extra']['s']", "objects of type builtins.set"),
        ({"l": [1, 2, 3j]}, "state['extra']['l'][2]", "objects of type builtins.complex"),
        ({(1, 2): 3}, "state['extra']", "a dict with a key of type tuple ((1, 2))"),
        (
            {0: {"p": Point(1, 2.0)}},
            "state['extra'][0]['p']",
            "objects of type test_codec_tree.Point",
        ),
        ({"a": np.array(["x"])}, "state['extra']['a']", "numpy arrays of dtype <U1"),
        (
            {"m": np.ma.masked_array([1.0, 2.0], mask=[False, True])},
            "state['extra']['m']",
            "objects of type numpy.ma.MaskedArray",
        ),
    ],
)
def test_unsupported_objects_are_refused_with_their_path(
    tmp_path: Path, value: Any, where: str, what: str
) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(UnsafeCheckpointError) as ei:
            mgr.save(1, {"extra": value})
        assert mgr.steps() == []
    msg = str(ei.value)
    assert msg.startswith(f"{where}: {what}")
    assert "cannot be stored without pickle" in msg
    assert "allow_pickle=True" in msg


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_unsupported_tensors_are_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(UnsafeCheckpointError) as ei:
            mgr.save(1, {"extra": {"sp": torch.zeros(2, 2).to_sparse()}})
        assert str(ei.value) == (
            "state['extra']['sp']: torch.sparse_coo tensors cannot be stored; "
            "make it dense with .to_dense()"
        )
        with pytest.raises(UnsafeCheckpointError, match=r"sparse_csr.*\.to_dense\(\)"):
            mgr.save(1, {"x": [torch.eye(2).to_sparse_csr()]})
        with pytest.raises(UnsafeCheckpointError, match=r"^state\['x'\]: meta tensors"):
            mgr.save(1, {"x": torch.empty(2, device="meta")})
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
        with pytest.raises(UnsafeCheckpointError, match=r"^state\['n'\]: nested tensors .*unbind"):
            mgr.save(1, {"n": nested})
        with pytest.raises(UnsafeCheckpointError) as ei:
            mgr.save(1, {"x": {"c": torch.zeros(1, dtype=torch.complex128)}})
        assert str(ei.value).startswith(
            "state['x']['c']: tensors of dtype torch.complex128 cannot be stored"
        )
        assert mgr.steps() == []


def test_allow_pickle_roundtrips_other_objects(tmp_path: Path, codec: dict[str, Any]) -> None:
    value = {
        "set": {1, 2},
        "frac": fractions.Fraction(1, 3),
        "point": Point(1, -0.0),
        "complex": 3j,
        "tuple_key": {(1, 2): "x"},
        "strings": np.array(["ab", "c"]),
        "masked": np.ma.masked_array([1.0, 2.0], mask=[False, True]),
    }
    with CheckpointManager(tmp_path, allow_pickle=True, **codec) as mgr:
        mgr.save(1, {"extra": value})
        out = mgr.load()["extra"]
    assert out["set"] == {1, 2}
    assert type(out["set"]) is set
    assert out["frac"] == fractions.Fraction(1, 3)
    assert type(out["point"]) is Point
    assert out["point"] == Point(1, -0.0)
    assert out["complex"] == 3j
    assert out["tuple_key"] == {(1, 2): "x"}
    assert out["strings"].tolist() == ["ab", "c"]
    assert type(out["masked"]) is np.ma.MaskedArray
    assert out["masked"].mask.tolist() == [False, True]


def test_pickle_node_refused_without_allow_pickle_and_no_code_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    store = tmp_path / "store"
    with CheckpointManager(store, allow_pickle=True) as mgr:
        mgr.save(1, {"extra": {"evil": RunsCode(str(marker))}, "n": 1})
    assert not marker.exists()  # saving pickles without running anything
    with CheckpointManager(store) as mgr:
        with pytest.raises(UnsafeCheckpointError) as ei:
            mgr.load()
        assert "state['extra']['evil'] holds a pickled object" in str(ei.value)
        assert "allow_pickle=True" in str(ei.value)
        target: dict[str, Any] = {"extra": "untouched", "n": 0}
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore(target)
        assert target == {"extra": "untouched", "n": 0}
        assert mgr.restore({"n": 0}) == 1  # entries without pickles still load
    assert not marker.exists()
    # The trap is real: with allow_pickle=True the code runs.
    with CheckpointManager(store, allow_pickle=True) as mgr:
        mgr.load()
    assert marker.read_text() == "code ran"


# ---- the typed JSON, node by node ---------------------------------------------------------


def _enc(value: Any) -> Any:
    return TreeEncoder().encode(value, group="g", path=("g",))


@pytest.mark.parametrize(
    ("value", "node"),
    [
        (None, None),
        (True, True),
        (-3, -3),
        (2**100, 2**100),
        (1.5, 1.5),
        (-0.0, -0.0),
        ("s", "s"),
        (float("nan"), {"t": "float", "bits": "7ff8000000000000"}),
        (math.inf, {"t": "float", "bits": "7ff0000000000000"}),
        (-math.inf, {"t": "float", "bits": "fff0000000000000"}),
        ([1, (2,)], [1, {"t": "tuple", "v": [2]}]),
        ({1: "a", "1": "b"}, {"t": "dict", "keys": [1, "1"], "vals": ["a", "b"]}),
        (collections.OrderedDict(a=1), {"t": "odict", "keys": ["a"], "vals": [1]}),
        (
            collections.Counter([4, 2, 4]),
            {"t": "dict", "keys": [4, 2], "vals": [2, 1], "counter": True},
        ),
        (b"\x00\xff", {"t": "bytes", "b64": "AP8="}),
        (bytearray(b"ab"), {"t": "bytearray", "b64": "YWI="}),
        (torch.bfloat16, {"t": "dtype", "v": "bfloat16"}),
        (torch.Size([2, 0]), {"t": "size", "v": [2, 0]}),
        (torch.device("cuda", 1), {"t": "device", "v": "cuda:1"}),
        (np.float32(1.5), {"t": "npscalar", "dtype": "<f4", "hex": "0000c03f"}),
    ],
)
def test_node_forms(value: Any, node: Any) -> None:
    got = _enc(value)
    assert json.dumps(got) == json.dumps(node)
    back = TreeDecoder(lambda g, k: pytest.fail("no tensors here")).decode(got)
    assert_identical(back, value)


def test_tensor_nodes_and_key_collisions() -> None:
    enc = TreeEncoder()
    t1, t2 = torch.ones(2), torch.zeros(3, dtype=torch.int8)
    node = enc.encode({"a.b": t1, "a": {"b": t2}}, group="m", path=("m",))
    groups = enc.finish(tensor_key)
    assert list(groups) == ["m"]
    assert list(groups["m"]) == ["a.b", "a.b#2"]
    assert groups["m"]["a.b"] is not None
    assert torch.equal(groups["m"]["a.b#2"], t2)
    assert node["vals"][0] == {
        "t": "tensor",
        "dtype": "float32",
        "shape": [2],
        "file": "m",
        "key": "a.b",
    }
    assert node["vals"][1]["vals"][0]["key"] == "a.b#2"
    arr = TreeEncoder()
    nd = arr.encode(np.arange(3, dtype=">i2"), group="n", path=("n", "x"))
    arr.finish(tensor_key)
    assert nd == {
        "t": "ndarray",
        "dtype": "int16",
        "shape": [3],
        "np_dtype": ">i2",
        "file": "n",
        "key": "x",
    }


def test_paths_and_keys() -> None:
    assert format_path(("opt", "state", 0, "exp_avg")) == "state['opt']['state'][0]['exp_avg']"
    assert format_path(()) == "state"
    assert tensor_key(("model", "layer", 0, "weight")) == "layer.0.weight"
    assert tensor_key(("x",)) == "_"


def test_encoder_refuses_absurd_nesting() -> None:
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    with pytest.raises(UnsafeCheckpointError, match=r"nested deeper than 200"):
        _enc(deep)


def _decode(node: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    store = tensors or {}
    return TreeDecoder(lambda g, k: store[k], where="x/state.json").decode(node, ("m",))


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"t": "nope"}, "unknown node type 'nope'"),
        ({"t": "dict", "keys": [True], "vals": [1]}, "dict key True is not str or int"),
        ({"t": "dict", "keys": ["a"], "vals": []}, "dict keys and values do not match"),
        ({"t": "dict", "keys": [[1]], "vals": [1]}, "dict key [1] is not str or int"),
        ({"t": "float", "bits": "zz"}, "malformed 'float' node"),
        ({"t": "bytes", "b64": "!!"}, "malformed 'bytes' node"),
        ({"t": "dtype", "v": "float99"}, "unknown dtype 'float99'"),
        ({"t": "npscalar", "dtype": "|O", "hex": ""}, "numpy dtype object is not numeric"),
        ({"t": "tuple"}, "malformed 'tuple' node (KeyError: 'v')"),
        ({"t": "npscalar", "dtype": "<f4", "hex": ""}, "malformed 'npscalar' node (IndexError"),
        ({"t": "npscalar", "dtype": "<f4", "hex": "0000"}, "malformed 'npscalar' node"),
        ({"t": "device", "v": "nonsense"}, "malformed 'device' node (RuntimeError"),
        ({"t": "device", "v": "cuda:-5"}, "malformed 'device' node"),
        (
            {"t": "tensor", "dtype": "float32", "shape": [3], "file": "g", "key": "a"},
            "payload g:a is torch.float32[2], state.json says torch.float32[3]",
        ),
        (
            {"t": "tensor", "dtype": "int4", "shape": [2], "file": "g", "key": "a"},
            "unsupported dtype 'int4'",
        ),
        (
            {
                "t": "view",
                "dtype": "float32",
                "shape": [2],
                "stride": [1],
                "offset": 1,
                "file": "g",
                "key": "a",
            },
            "view runs past the tensor it views",
        ),
        (
            {"t": "view", "dtype": "int8", "shape": [1], "stride": [1], "offset": 0}
            | {"file": "g", "key": "a"},
            "view of torch.int8 into a torch.float32 tensor",
        ),
        ({"t": "pickle", "b64": ""}, "holds a pickled object"),
        (3j, "unexpected JSON complex"),
    ],
)
def test_decoder_rejects_malformed_nodes(node: Any, message: str) -> None:
    with pytest.raises((IntegrityError, UnsafeCheckpointError)) as ei:
        _decode(node, {"a": torch.zeros(2)})
    assert message in str(ei.value)
    assert str(ei.value).startswith("x/state.json: ")


def test_decoder_survives_hostile_nesting() -> None:
    node: Any = 0
    for _ in range(5000):
        node = [node]
    with pytest.raises(IntegrityError, match=r"nested too deeply"):
        _decode(node)

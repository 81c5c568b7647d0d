"""Golden checkpoints of format version 1: they load exactly, and today's bytes are theirs.

``tests/golden/v1-*`` were written once by ``tools/make_golden.py``. The expected values below
are written out by hand, not recomputed, so a change in how values are encoded or decoded
fails here; and saving the same state again must reproduce the checked-in payload files and
``state.json`` byte for byte, so the format cannot drift by accident.
"""

from __future__ import annotations

import collections
import importlib.util
import io
import json
import math
import shutil
import struct
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from ckptstore import CheckpointManager, verify_file

GOLDEN = Path(__file__).parent / "golden"
STEP_DIR = "step-000000001000"
FORMATS = {"v1-safetensors": "safetensors", "v1-torch": "torch"}
EXT = {"safetensors": ".safetensors", "torch": ".pt"}


def _make_golden() -> ModuleType:
    path = Path(__file__).parent.parent / "tools" / "make_golden.py"
    spec = importlib.util.spec_from_file_location("make_golden", path)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


@pytest.fixture(params=list(FORMATS), ids=list(FORMATS))
def golden(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    """A copy of one golden store (tests never write into the checkout) and its format."""
    name = request.param
    copy = tmp_path / name
    shutil.copytree(GOLDEN / name, copy)
    return copy, FORMATS[name]


def test_checked_in_stores_hold_only_the_step() -> None:
    # v2-, v3-, v4-dtensor(-b256k) and v5-dtensor have their own tests
    # (tests/multirank/test_golden_dtensor.py).
    names = sorted(p.name for p in GOLDEN.iterdir())
    assert names == [
        "v1-safetensors",
        "v1-torch",
        "v2-dtensor",
        "v3-dtensor",
        "v4-dtensor",
        "v4-dtensor-b256k",
        "v5-dtensor",
    ]
    for name, fmt in FORMATS.items():
        assert [p.name for p in (GOLDEN / name).iterdir()] == [STEP_DIR]
        ext = EXT[fmt]
        files = sorted(p.name for p in (GOLDEN / name / STEP_DIR).iterdir())
        assert files == sorted(
            ["manifest.json", "state.json", f"model{ext}", f"optimizer{ext}", f"extra{ext}"]
        )
        total = sum(p.stat().st_size for p in (GOLDEN / name / STEP_DIR).iterdir())
        assert total < 16_000  # keep the golden files tiny


def test_manifest(golden: tuple[Path, str]) -> None:
    root, fmt = golden
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1000]
        m = mgr.manifest()
    assert m.step == 1000
    assert m.format_version == 1
    assert m.format == fmt
    assert m.world_size == 1
    assert m.sharded is False
    assert dict(m.metrics) == {"loss": 0.5}
    assert dict(m.metadata) == {"note": "golden v1"}
    ext = EXT[fmt]
    assert sorted(m.files) == sorted(
        ["state.json", f"model{ext}", f"optimizer{ext}", f"extra{ext}"]
    )
    for name, entry in m.files.items():
        assert entry.codec == ("json" if name == "state.json" else fmt)
        assert entry.compression is None
        assert entry.rank is None
        assert entry.bytes == (root / STEP_DIR / name).stat().st_size
    assert m.files["state.json"].bytes == 2607
    assert m.files["state.json"].crc32c == 0x54200F8D
    if fmt == "safetensors":
        assert m.files["model.safetensors"].crc32c == 0xAE82141D
        assert m.files["optimizer.safetensors"].crc32c == 0x62E43097
        assert m.files["extra.safetensors"].crc32c == 0xA0E2B439


def test_verifies_deeply(golden: tuple[Path, str]) -> None:
    root, fmt = golden
    with CheckpointManager(root) as mgr:
        report = mgr.verify(1000, deep=True)
        assert report.problems == []
        assert report.ok
        assert report.files == 4
        assert mgr.verify(deep=False).ok
    for name in ("model", "optimizer", "extra"):
        file_report = verify_file(root / STEP_DIR / f"{name}{EXT[fmt]}", deep=True)
        assert file_report.problems == []


def test_loads_every_value_exactly(golden: tuple[Path, str]) -> None:
    root, _ = golden
    with CheckpointManager(root) as mgr:
        state = mgr.load()
    assert list(state) == ["model", "optimizer", "extra", "step"]
    assert type(state["step"]) is int
    assert state["step"] == 1000

    model = state["model"]
    assert type(model) is collections.OrderedDict
    assert list(model) == ["weight", "bias"]
    assert model._metadata == {"": {"version": 1}}
    assert type(model["weight"]) is torch.Tensor
    assert model["weight"].dtype == torch.float32
    assert model["weight"].tolist() == [[-0.5, -0.25, 0.0], [0.25, 0.5, 0.75]]
    assert model["bias"].tolist() == [0.25, -1.0]

    opt = state["optimizer"]
    assert type(opt) is dict
    assert list(opt) == ["state", "param_groups"]
    assert list(opt["state"]) == [0, 1]
    s0, s1 = opt["state"][0], opt["state"][1]
    assert list(s0) == ["step", "exp_avg", "exp_avg_sq"]
    assert s0["step"].shape == ()
    assert s0["step"].item() == 3.0
    assert s0["exp_avg"].tolist() == [[0.125] * 3] * 2
    assert s0["exp_avg_sq"].tolist() == [[0.0, 1 / 64, 2 / 64], [3 / 64, 4 / 64, 5 / 64]]
    assert s1["exp_avg"].tolist() == [-0.5, 0.5]
    assert s1["exp_avg_sq"].tolist() == [0.0, 1.0]
    assert opt["param_groups"] == [
        {
            "lr": 0.001,
            "betas": (0.9, 0.999),
            "eps": 1e-08,
            "weight_decay": 0.0,
            "amsgrad": False,
            "params": [0, 1],
        }
    ]
    assert type(opt["param_groups"][0]["betas"]) is tuple

    x = state["extra"]
    assert list(x) == [
        "bf16",
        "ids",
        "mask",
        "table",
        "tied",
        "row",
        "scalar",
        "empty",
        "tuple",
        "neg_zero",
        "nan",
        "ninf",
        "huge",
        "text",
        "bytes",
        "dtype",
        "size",
        "np",
        "np_scalar",
        "int_keys",
        "odict",
    ]
    assert x["bf16"].dtype == torch.bfloat16
    assert bits(x["bf16"]) == bytes.fromhex("c03f0080807fc07f")  # 1.5 -0 inf nan
    assert x["ids"].dtype == torch.int64
    assert x["ids"].tolist() == [-(2**40), 0, 4611686018427387905]
    assert x["mask"].dtype == torch.bool
    assert x["mask"].tolist() == [True, False, True, True]
    assert x["table"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert x["tied"] is x["table"]
    assert x["row"].tolist() == [2, 3]
    assert x["row"].data_ptr() == x["table"].data_ptr() + 2 * 8
    assert x["scalar"].dtype == torch.int32
    assert x["scalar"].shape == ()
    assert x["scalar"].item() == 7
    assert x["empty"].dtype == torch.float16
    assert x["empty"].shape == (0, 2)
    assert type(x["tuple"]) is tuple
    assert x["tuple"] == (1, "two", 3.5, None)
    assert math.copysign(1.0, x["neg_zero"]) == -1.0
    assert struct.pack(">d", x["nan"]).hex() == "7ff8000000000000"
    assert x["ninf"] == -math.inf
    assert x["huge"] == 1267650600228229401496703205376
    assert x["text"] == "\u00fcn\u00efcode \u2713"
    assert type(x["bytes"]) is bytes
    assert x["bytes"] == b"\x00\xffck"
    assert x["dtype"] is torch.bfloat16
    assert type(x["size"]) is torch.Size
    assert x["size"] == (2, 3)
    assert type(x["np"]) is np.ndarray
    assert x["np"].dtype.str == ">f4"
    assert x["np"].tolist() == [0.0, 1.0, 2.0]
    assert type(x["np_scalar"]) is np.float32
    assert x["np_scalar"] == 1.5
    assert list(x["int_keys"].items()) == [(0, "a"), (10, "b"), (2, "c")]
    assert type(x["odict"]) is collections.OrderedDict
    assert list(x["odict"].items()) == [("z", 1), ("a", [True, False])]


def test_restores_into_a_module(golden: tuple[Path, str]) -> None:
    root, _ = golden
    model = torch.nn.Linear(3, 2)
    target: dict[str, Any] = {"model": model, "step": 0}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(target) == 1000
        assert mgr.resume({"model": torch.nn.Linear(3, 2)}) == 1001
    assert target["step"] == 1000
    assert model.weight.tolist() == [[-0.5, -0.25, 0.0], [0.25, 0.5, 0.75]]
    assert model.bias.tolist() == [0.25, -1.0]
    assert type(model.weight) is torch.nn.Parameter


def test_payloads_are_standard_files() -> None:
    st_dir = GOLDEN / "v1-safetensors" / STEP_DIR
    pt_dir = GOLDEN / "v1-torch" / STEP_DIR
    for name, keys in [
        ("model", ["bias", "weight"]),
        (
            "optimizer",
            [f"state.{i}.{k}" for i in (0, 1) for k in ("exp_avg", "exp_avg_sq", "step")],
        ),
        ("extra", ["bf16", "empty", "ids", "mask", "np", "scalar", "table"]),
    ]:
        st = safetensors.torch.load_file(st_dir / f"{name}.safetensors")
        pt = torch.load(pt_dir / f"{name}.pt", weights_only=True)
        assert sorted(st) == keys
        assert sorted(pt) == keys
        for k in keys:
            assert st[k].dtype == pt[k].dtype, k
            assert bits(st[k]) == bits(pt[k]), k
    # The payloads hold the data; the tree is the same whatever the payload format.
    assert (st_dir / "state.json").read_bytes() == (pt_dir / "state.json").read_bytes()
    tree = json.loads((st_dir / "state.json").read_bytes())
    assert tree["ckptstore_state"] == 1
    assert tree["root"]["keys"] == ["model", "optimizer", "extra", "step"]


@pytest.mark.parametrize(("name", "fmt"), list(FORMATS.items()))
def test_saving_today_reproduces_the_golden_bytes(tmp_path: Path, name: str, fmt: str) -> None:
    mg = _make_golden()
    assert mg.FORMATS == FORMATS
    today = mg.write_store(tmp_path / name, fmt)
    golden = GOLDEN / name / STEP_DIR
    assert sorted(p.name for p in today.iterdir()) == sorted(p.name for p in golden.iterdir())
    assert (today / "state.json").read_bytes() == (golden / "state.json").read_bytes()
    golden_manifest = json.loads((golden / "manifest.json").read_bytes())
    for group in ("model", "optimizer", "extra"):
        fname = f"{group}{EXT[fmt]}"
        new, old = (today / fname).read_bytes(), (golden / fname).read_bytes()
        if fmt == "safetensors" or golden_manifest["versions"]["torch"] == torch.__version__:
            assert new == old, fname
        else:
            # torch.save archives belong to torch and may change with it: compare contents.
            with zipfile.ZipFile(io.BytesIO(new)) as a, zipfile.ZipFile(io.BytesIO(old)) as b:
                assert a.namelist() == b.namelist(), fname
            t_new = torch.load(io.BytesIO(new), weights_only=True)
            t_old = torch.load(io.BytesIO(old), weights_only=True)
            assert list(t_new) == list(t_old), fname
            for k in t_old:
                assert bits(t_new[k]) == bits(t_old[k]), f"{fname}:{k}"

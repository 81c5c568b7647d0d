"""``dcp.save`` and ``dcp.async_save`` into a ckptstore store through ``CkptStoreWriter``
(issue 23): the step is one ``mgr.save`` writes, restorable on any world size by either API."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from _helpers import flip_byte, index_chunks, run_cli, step_dir
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

from ckptstore import CheckpointManager, ConfigError, UnsafeCheckpointError
from ckptstore.dcp import CkptStoreReader, CkptStoreWriter
from tests.multirank.launch import describe, launch


def quiet(fn: Any, *a: Any, **k: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        return fn(*a, **k)


@pytest.fixture(scope="module")
def dcp_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Steps 3 (``dcp.save``) and 4 (``dcp.async_save``) of a 2-rank FSDP2 job, keep=5."""
    work = tmp_path_factory.mktemp("dcpw")
    res = launch("dcp_scenarios:dcp_save", 2, work, timeout=150, args={"keep": 5})
    assert all(r.ok for r in res), describe(res)
    assert res[0].value == res[1].value, describe(res)
    return work / "store", res[0].value


def test_dcp_save_and_async_save_write_format_4_steps_that_verify(
    dcp_store: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    root, saved = dcp_store
    assert saved["steps"] == [3, 4]
    assert saved["dcp_items"] == 0  # DCP's plan went without items: mgr.save plans its own
    assert saved["3"] != saved["4"]  # one more training step between them
    for step in (3, 4):
        path = root / step_dir(step)
        names = sorted(p.name for p in path.iterdir())
        # ckptstore's files: each rank's shards, the split index, the rank table; no DCP
        # .metadata (a pickle) and no .distcp.
        assert "_shards.rank00000.safetensors" in names
        assert "_shards.rank00001.safetensors" in names
        assert {"manifest.json", "state.json", "dtensors.json", "_ranks.jsonl"} <= set(names)
        assert not [n for n in names if n.endswith((".distcp", ".metadata"))]
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["format_version"] == 4
        assert manifest["world_size"] == 2
        assert manifest["metrics"] == {"loss": 0.5}
        code, out, _ = run_cli(capsys, "verify", root, "--step", step)
        assert code == 0, out
    # Each rank wrote its own half of a sharded weight.
    chunks = index_chunks(root / step_dir(3), "model/inp.weight")
    assert sorted(c["file"] for c in chunks) == [
        "_shards.rank00000.safetensors",
        "_shards.rank00001.safetensors",
    ]


def test_a_dcp_saved_step_loads_in_one_process_bit_exact(
    dcp_store: tuple[Path, dict[str, Any]],
) -> None:
    from tests.multirank.dtensor_scenarios import _sha

    root, saved = dcp_store
    full = CheckpointManager(root).load(4)
    assert full["step"] == 4
    got = {f"model/{k}": _sha(v) for k, v in full["model"].items()}
    got.update(
        {
            f"optim/{p}/{k}": _sha(v)
            for p, st in full["optim"]["state"].items()
            for k, v in st.items()
        }
    )
    assert got == saved["4"]
    assert full["optim"]["param_groups"][0]["lr"] == 1e-2


@pytest.mark.parametrize("world", [3, 1])
def test_a_2_rank_dcp_save_restores_on_another_world_by_both_apis(
    dcp_store: tuple[Path, dict[str, Any]], tmp_path: Path, world: int
) -> None:
    root, saved = dcp_store
    work = tmp_path / "w"
    work.mkdir()
    (work / "store").symlink_to(root)
    res = launch("dcp_scenarios:dcp_restore", world, work, timeout=150, args={"step": 3})
    assert all(r.ok for r in res), describe(res)
    for r in res:
        for how in ("restore", "dcp"):
            assert r.value[how]["digests"] == saved["3"], (how, describe(res))
            assert r.value[how]["step"] == 3


def test_names_one_rank_alone_holds_are_saved_and_load_back_on_that_rank(tmp_path: Path) -> None:
    # DCP keeps every rank's items. torchtitan's dataloader saves dataloader.dp_rank_<r> on
    # rank r alone; mgr.save of DTensor state wrote rank 0's plain values only, so step 1
    # held dp_rank_0 and a resume on 2 ranks failed: "Missing key ... dp_rank_1".
    res = launch("dcp_scenarios:dcp_per_rank", 2, tmp_path, timeout=150)
    assert all(r.ok for r in res), describe(res)
    for rank, r in enumerate(res):
        assert r.value["stored_keys"] == ["dataloader", "model", "rank0", "rank1", "shared"]
        assert r.value["stored_dataloader"] == ["dp_rank_0", "dp_rank_1", "world_size"]
        assert r.value["mine"] == f"position of rank {rank}"
        assert r.value["world_size"] == 2
        assert r.value["tensor"] == [float(rank)] * 3
        assert r.value["epoch"] == 5


def test_a_rank_killed_in_the_write_under_dcp_save_leaves_no_step(tmp_path: Path) -> None:
    timeout = 6.0
    res = launch(
        "dcp_scenarios:dcp_die_in_write",
        3,
        tmp_path,
        timeout=120,
        args={"victim": 2, "timeout": timeout},
    )
    assert res[2].ok is False  # killed
    for r in res[:2]:
        v = r.value
        assert v is not None, describe(res)
        assert v["ok"] is False, describe(res)
        # DCP wraps ckptstore's error; the dead rank is named within the timeout's bound.
        # DCP's gather of the results meets the dead rank and raises gloo's error (or its
        # CheckpointException); ckptstore's error naming the dead rank is the writer's.
        assert v["error_type"] in ("CheckpointException", "RuntimeError"), v
        cause = v["cause"]
        assert cause["error_type"] == "BarrierTimeout", v
        assert cause["missing_ranks"] == [2], v
        assert "rank(s) 2 did not arrive" in cause["message"], v
        assert v["elapsed"] < 4 * timeout + 20, describe(res)
        assert v["steps"] == [1], describe(res)
    root = tmp_path / "store"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [step_dir(1)]
    # The step before it still restores.
    full = CheckpointManager(root).load()
    assert full["step"] == 1


def _corrupt_copy(src: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A copy of the store with a byte of step 4's first ``mid.weight`` chunk flipped; the
    copy's root and that chunk's index row."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(src, root)
    chunk = index_chunks(root / step_dir(4), "model/mid.weight")[0]
    path = root / step_dir(4) / chunk["file"]
    path.write_bytes(flip_byte(path.read_bytes(), chunk["start"] + 3))
    return root, chunk


def test_a_flipped_byte_in_a_dcp_saved_step_fails_both_loads(
    dcp_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    src, _ = dcp_store
    root, _ = _corrupt_copy(src, tmp_path)
    full3 = CheckpointManager(src).load(3)
    target = {"model": {"mid.weight": torch.zeros_like(full3["model"]["mid.weight"])}}
    with pytest.raises(CheckpointException) as info:
        quiet(dcp.load, target, storage_reader=CkptStoreReader(root, step=4), no_dist=True)
    assert "IntegrityError" in str(info.value)
    # mgr.restore passes over the corrupt step to the newest good one, step 3.
    with CheckpointManager(root) as mgr:
        state: dict[str, Any] = {"model": target["model"], "step": -1}
        restored = mgr.restore(state)
    assert restored == 3
    assert state["step"] == 3
    assert torch.equal(state["model"]["mid.weight"], full3["model"]["mid.weight"])


@pytest.mark.parametrize("device", [False, True], ids=["cpu-way", "device-way"])
@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_dcp_load_reads_by_extent_where_the_store_reads_direct(
    dcp_store: tuple[Path, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    runs_read: list[str],
    io: str,
    device: bool,
) -> None:
    """With O_DIRECT (``io``), CkptStoreReader reads the DTensor chunks in runs of their
    files on the read threads (``sharded/extents.py``); either way the same bytes. Targets
    on a GPU (played by CPU tensors: ``extents.DEVICES``) go by runs either way."""
    from ckptstore.sharded import extents

    if device:
        monkeypatch.setattr(extents, "DEVICES", frozenset({"cpu"}))
    root, _ = dcp_store
    full = CheckpointManager(root).load(4)["model"]
    runs_read.clear()  # the runs of that load
    runs = runs_read
    target = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    reader = CkptStoreReader(root, step=4, storage_options={"io": io})
    quiet(dcp.load, target, storage_reader=reader, no_dist=True)
    for k, v in full.items():
        assert torch.equal(target["model"][k], v), k
    if io == "direct" or device:
        assert {f for f in runs} == {
            "_shards.rank00000.safetensors",
            "_shards.rank00001.safetensors",
        }
    else:
        assert runs == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_dcp_load_into_gpu_tensors_reads_by_runs(
    dcp_store: tuple[Path, dict[str, Any]], runs_read: list[str], io: str
) -> None:
    root, _ = dcp_store
    full = CheckpointManager(root).load(4)["model"]
    runs_read.clear()  # the runs of that load
    target = {"model": {k: torch.zeros_like(v, device="cuda") for k, v in full.items()}}
    reader = CkptStoreReader(root, step=4, storage_options={"io": io})
    quiet(dcp.load, target, storage_reader=reader, no_dist=True)
    for k, v in full.items():
        assert target["model"][k].device.type == "cuda"
        assert torch.equal(target["model"][k].cpu(), v), k
    assert set(runs_read) == {"_shards.rank00000.safetensors", "_shards.rank00001.safetensors"}


def test_a_corrupt_block_read_by_extent_never_reaches_the_dcp_target(
    dcp_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    src, _ = dcp_store
    root, chunk = _corrupt_copy(src, tmp_path)
    full = CheckpointManager(src).load(4)["model"]["mid.weight"]
    target = {"model": {"mid.weight": torch.full_like(full, -7.0)}}
    reader = CkptStoreReader(root, step=4, storage_options={"io": "direct"})
    with pytest.raises(CheckpointException) as info:
        quiet(dcp.load, target, storage_reader=reader, no_dist=True)
    assert "does not match its crc32c" in str(info.value)
    got = target["model"]["mid.weight"]
    rows = chunk["sizes"][0]  # the corrupt chunk (one block): nothing of it was copied
    assert bool((got[chunk["offsets"][0] : chunk["offsets"][0] + rows] == -7.0).all())


# One process, no process group: dcp.save runs without collectives.


def small_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2, "tag": "a"}


def test_dcp_save_in_one_process_restores_by_mgr_and_by_dcp(tmp_path: Path) -> None:
    state = small_state()
    with CheckpointManager(tmp_path / "s", keep=2) as mgr:
        writer = CkptStoreWriter(mgr)
        assert writer.process_group is None
        for step in (1, 2, 3):
            quiet(
                dcp.save,
                state,
                checkpoint_id=tmp_path / "s" / f"step-{step}",
                storage_writer=writer,
            )
            assert writer.manifest is not None
            assert writer.manifest.step == step
        assert mgr.steps() == [2, 3]  # the manager's retention applies
        assert not writer.manifest.dtensor
        assert writer.manifest.format_version == 1
        loaded = mgr.load(3)
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert torch.equal(
        loaded["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"]
    )
    assert loaded["epoch"] == 2
    assert loaded["tag"] == "a"
    # Into the objects: the optimizer's state keyed by parameter id again (DCP's flattening
    # named it "0", "1"; loaded so, torch would keep it under keys no parameter has).
    torch.manual_seed(1)
    model = nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(tmp_path / "s") as mgr:
        assert mgr.restore({"model": model, "optim": opt, "epoch": 0, "tag": ""}) == 3
    assert sorted(opt.state_dict()["state"]) == [0, 1]
    for i, p in enumerate(model.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], state["optim"]["state"][i]["exp_avg"])
        assert torch.equal(p.detach(), list(state["model"].values())[i])
    back = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "epoch": 0}
    quiet(dcp.load, back, storage_reader=CkptStoreReader(tmp_path / "s"), no_dist=True)
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert back["epoch"] == 2


def test_an_optimizer_saved_by_dcp_before_its_first_step_restores(tmp_path: Path) -> None:
    # DCP's flattening drops empty dicts: an optimizer's state_dict() before its first step
    # (the checkpoint a job takes at step 0) was saved without "state", and restore refused
    # the step ("no 'state' and 'param_groups'"), where mgr.save of the same state restored.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with CheckpointManager(tmp_path / "s") as mgr:
        quiet(dcp.save, state, storage_writer=CkptStoreWriter(mgr, step=0), no_dist=True)
        assert mgr.load(0)["optim"]["state"] == {}
        fresh = nn.Linear(4, 2)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        assert mgr.restore({"model": fresh, "optim": fresh_opt}) == 0
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    assert fresh_opt.state_dict()["state"] == {}


def test_the_writer_refuses_what_it_cannot_save_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    state = {"w": torch.ones(2)}
    with CheckpointManager(root) as mgr:
        quiet(dcp.save, state, storage_writer=CkptStoreWriter(mgr, step=1))
        cases: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({"storage_writer": CkptStoreWriter(mgr)}, ConfigError, "no step to save"),
            (
                {"storage_writer": CkptStoreWriter(mgr), "checkpoint_id": root / "latest"},
                ConfigError,
                "does not end in step-N",
            ),
            (
                {"storage_writer": CkptStoreWriter(mgr), "checkpoint_id": tmp_path / "x/step-5"},
                ConfigError,
                "is not in the manager's store",
            ),
            (
                {
                    "storage_writer": CkptStoreWriter(mgr, step=5),
                    "planner": _OtherPlanner(),
                },
                ConfigError,
                "is not one",
            ),
            (  # an object that needs pickle: refused as mgr.save refuses it
                {"storage_writer": CkptStoreWriter(mgr, step=5)},
                UnsafeCheckpointError,
                "pickle",
            ),
            (  # the step exists
                {"storage_writer": CkptStoreWriter(mgr, step=1)},
                Exception,
                "already",
            ),
        ]
        for i, (kw, err, text) in enumerate(cases):
            payload = dict(state, obj=_Opaque()) if err is UnsafeCheckpointError else state
            with pytest.raises((err, CheckpointException)) as info:
                quiet(dcp.save, payload, **kw)
            assert text in str(info.value), (i, str(info.value))
        assert mgr.steps() == [1]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(("step-", ".tmp"))) == [
        step_dir(1)
    ]
    assert not (tmp_path / "x").exists()
    assert CkptStoreWriter.validate_checkpoint_id("s3://b/run/step-10")
    assert not CkptStoreWriter.validate_checkpoint_id("s3://b/run/latest")


class _OtherPlanner(SavePlanner):
    """A SavePlanner that is not a DefaultSavePlanner (DCP's abstract base, filled in)."""

    def __init__(self) -> None:
        self._inner = DefaultSavePlanner()

    def set_up_planner(self, *a: Any, **k: Any) -> None:
        self._inner.set_up_planner(*a, **k)

    def create_local_plan(self) -> Any:
        return self._inner.create_local_plan()

    def create_global_plan(self, plans: Any) -> Any:
        return self._inner.create_global_plan(plans)

    def finish_plan(self, plan: Any) -> Any:
        return self._inner.finish_plan(plan)

    def resolve_data(self, item: Any) -> Any:
        return self._inner.resolve_data(item)


class _Opaque:
    """A value only pickle can store."""


def test_exporting_a_sharded_step_imports_neither_dtensor_nor_dcp(
    dcp_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """``ckptstore export`` of an FSDP2 step into one safetensors file consolidates the
    shards without importing ``torch.distributed.tensor`` (the split index's placements are
    read as plain data) or DCP (needed by ``--dcp`` only): ~0.9 s of a 3 s export before.
    The file holds the full tensors."""
    from _helpers import run_python

    root, _ = dcp_store
    out = tmp_path / "model.safetensors"
    code = r"""
import sys
from ckptstore.cli import main
rc = main(["export", "--step", "4", sys.argv[1], sys.argv[2]])
names = ("torch.distributed.tensor", "torch.distributed.checkpoint")
heavy = [k for k in names if k in sys.modules]
print("rc:", rc, "heavy:", heavy)
"""
    r = run_python(code, str(root), str(out))
    assert r.returncode == 0, r.stderr
    assert "rc: 0 heavy: []" in r.stdout, r.stdout + r.stderr
    full = CheckpointManager(root).load(4)["model"]
    got = safetensors.torch.load_file(out)
    assert sorted(got) == sorted(full)
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_exporting_the_model_reads_its_chunks_only(
    dcp_store: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weights export reads the chosen entry's chunks, not the optimizer's moments that
    share its shard files (twice the model's bytes with AdamW): on the bench's 2-rank FSDP2
    step, 256 MB read instead of 768 MB."""
    from ckptstore.ops.export import export_step
    from ckptstore.sharded import targets

    root, _ = dcp_store
    full = CheckpointManager(root).load(4)
    asked: list[str] = []
    real = targets.read_into

    def spy(index: Any, flat: dict[str, Any], *a: Any, **k: Any) -> int:
        asked.extend(flat)
        return real(index, flat, *a, **k)

    monkeypatch.setattr(targets, "read_into", spy)
    res = export_step(root, 4, str(tmp_path / "m.safetensors"), key="model")
    assert res.tensors == len(full["model"])
    # The model's DTensor leaves (its plain ones come from rank 0's payload), none other.
    assert asked
    assert set(asked) <= {f"model/{k}" for k in full["model"]}
    got = safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(got[k], v) for k, v in full["model"].items())

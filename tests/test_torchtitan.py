"""torchtitan's own checkpointer saving through ckptstore (issue 23).

The multi-rank scenarios (``tests/multirank/torchtitan_scenarios.py``) drive torchtitan's
real classes (its ``CheckpointManager`` contract, ``ModelWrapper``, ``OptimizersContainer``,
``LRSchedulersContainer``, a ``StateDictAdapter``) on FSDP2 over gloo, on CPU, through
:class:`~ckptstore.integrations.torchtitan.CkptStoreCheckpointManager`.

torchtitan is not a dependency of ckptstore: its wheel requires wandb, tensorboard, datasets,
torchdata and torch_checkpointing, none of which its checkpointer imports. It is installed
with ``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3`` plus ``tyro``; without
it these tests are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")

import torch
from _helpers import index_chunks, run_cli, step_dir
from safetensors.torch import load_file

from ckptstore import CheckpointManager
from tests.multirank.launch import describe, launch
from tests.timing import healthy

DELAY = 0.3  # each ckptstore write starts this late: training overlaps an async save


def _run(scenario: str, world: int, work: Path, **args: Any) -> list[Any]:
    res = launch(f"torchtitan_scenarios:{scenario}", world, work, timeout=120, args=args)
    assert all(r.ok for r in res), describe(res)
    values = [r.value for r in res]
    # Every rank saw the same (the message shows what differs).
    same = all(v == values[0] for v in values)
    assert same, [{k: x for k, x in v.items() if x != values[0].get(k)} for v in values]
    return values


def _verified(capsys: Any, root: Path, steps: list[int]) -> None:
    for step in steps:
        code, out, _ = run_cli(capsys, "verify", root, "--step", step)
        assert code == 0, out


def _changed(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    assert expected, "nothing was compared"
    return sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """2 ranks, ``async_mode="async"``, ``keep_latest_k=2``: saves 2, 4, 6, 8; a fresh job
    resumes from 6 and trains on to 8."""
    work = tmp_path_factory.mktemp("titan")
    values = _run("train_save_resume", 2, work, async_mode="async", keep=2, delay=DELAY)
    return work / "store", values[0]


def test_async_saves_are_ckptstore_steps_kept_by_retention(
    trained: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    root, v = trained
    # dcp.async_save returned while ckptstore was still writing step 6: training went on.
    assert v["in_flight_after_save_6"] is True
    # keep_latest_k=2 is the store's retention: 2 and 4 are gone once 6 and 8 are in.
    assert v["steps_at_8"] == [6, 8]
    assert CheckpointManager(root, create=False, distributed=False).steps() == [6, 8]
    assert v["manifest_6"] == {"saved_by": "torchtitan", "async_mode": "async"}
    names = {p.name for p in root.iterdir()}
    assert {step_dir(6), step_dir(8)} <= names
    assert not [n for n in names if n.startswith("step-") and n not in {step_dir(6), step_dir(8)}]
    files = {p.name for p in (root / step_dir(6)).iterdir()}
    assert {"_shards.rank00000.safetensors", "_shards.rank00001.safetensors"} <= files
    assert not [n for n in files if n.endswith((".distcp", ".metadata"))]
    # torchtitan's names: the flattened model, the OptimizersContainer's FQN-keyed state.
    chunks = index_chunks(root / step_dir(6), "layers.0.weight")
    assert len(chunks) == 2
    assert len(index_chunks(root / step_dir(6), "optimizer/state.layers.0.weight.exp_avg")) == 2
    _verified(capsys, root, [6, 8])


def test_torchtitan_load_resumes_bit_identically_and_trains_on_alike(
    trained: tuple[Path, dict[str, Any]],
) -> None:
    _, v = trained
    assert v["resumed_step"] == 6
    saved = v["saved"]["6"]
    assert _changed(saved, v["resumed"]) == []
    # The model, optimizer, LR schedule, dataloader and train state all came back: two more
    # steps give what the run that never stopped had at step 8.
    assert saved["lr_scheduler"] == "{'last_epoch': 6}"
    assert saved["dataloader"] == "{'position': 6}"
    assert _changed(v["uninterrupted_8"], v["continued_8"]) == []
    assert v["saved"]["4"] != v["saved"]["6"]


def test_a_2_rank_step_loads_on_3_ranks(
    trained: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, v = trained
    (tmp_path / "store").symlink_to(root)
    values = _run("resume_on_world", 3, tmp_path, step=6, load_only=True)
    assert values[0]["step"] == 6
    assert _changed(v["saved"]["6"], values[0]["digests"]) == []


def test_a_load_only_job_whose_peer_hangs_fails_within_barrier_timeout(
    trained: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """load_only opens no store, and DCP's load ran on the default group: a peer that hung
    left rank 0 waiting for that group's timeout (the worker's 120 s; torch's default is 30
    minutes) or until the peer died, instead of barrier_timeout."""
    root, _ = trained
    (tmp_path / "store").symlink_to(root)
    args = {"step": 6, "timeout": 5.0, "hang": 90.0}
    res = launch("torchtitan_scenarios:load_only_peer_gone", 2, tmp_path, timeout=110, args=args)
    assert res[1].returncode == 3, describe(res)
    got = res[0].value
    assert got is not None, describe(res)
    assert got["ok"] is False, got
    assert got["seconds"] < 5.0 + healthy(5.0), got


@pytest.fixture(scope="module")
def switched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """2 ranks: a stock-torchtitan run switched to ckptstore (``async_with_pinned_mem``),
    then a run to its last step with ``last_save_in_hf``."""
    work = tmp_path_factory.mktemp("titan-switch")
    return work, _run("switch_and_last_step", 2, work, delay=DELAY)[0]


def test_a_run_switched_from_stock_dcp_resumes_and_saves_into_the_store(
    switched: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    work, v = switched
    s = v["switch"]
    # torchtitan's own step-2 and step-4 stay; the switched run resumed from step-4 ...
    assert s["resumed_stock"]["step"] == 4
    assert _changed(s["saved"]["4"], s["resumed_stock"]["digests"]) == []
    # ... and saved 6 and 8 as ckptstore steps (pinned-memory async mode: staged and written
    # in the background, training overlapping the write).
    assert s["folder"] == [step_dir(6), step_dir(8), "step-2", "step-4"]
    assert s["steps"] == [6, 8]
    assert s["in_flight_after_save_8"] is True
    assert s["manifest_8"]["async_mode"] == "async_with_pinned_mem"
    assert s["resumed_store"]["step"] == 8
    assert _changed(s["saved"]["8"], s["resumed_store"]["digests"]) == []
    _verified(capsys, work / "switch" / "store", [6, 8])


def test_last_save_in_hf_is_a_model_only_step_exported_as_hf(
    switched: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    work, v = switched
    h = v["hf"]
    assert h["steps"] == [2, 4]  # keep_latest_k=0: everything is kept
    assert h["manifest_4"] == {
        "saved_by": "torchtitan",
        "async_mode": "disabled",
        "model_only": True,
        "dtype": "bfloat16",
        "hf": True,
    }
    assert h["hf_files"] == ["model.safetensors"]
    from tests.multirank.dtensor_scenarios import _sha

    exported = load_file(str(work / "hf" / "hf" / "step-4" / "model.safetensors"))
    assert {k: _sha(t) for k, t in sorted(exported.items())} == h["expected"]
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    # The step itself holds the same weights under "model", consolidated by the CLI too.
    root = work / "hf" / "store"
    _verified(capsys, root, [2, 4])
    out = work / "again"
    code, text, _ = run_cli(capsys, "export", root, "--step", 4, "--hf", out)
    assert code == 0, text
    again = load_file(str(out / "model.safetensors"))
    assert {k: _sha(t) for k, t in sorted(again.items())} == h["expected"]
    model_only = json.loads((root / step_dir(2) / "manifest.json").read_text())
    assert model_only["metadata"] == {"saved_by": "torchtitan", "async_mode": "disabled"}


def test_the_config_is_torchtitans_with_ckptstores_options() -> None:
    from torchtitan.components.checkpoint import CheckpointManager as Titan
    from torchtitan.components.checkpointer import BaseCheckpointManager

    from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager

    stock = Titan.Config(enable=True, folder="ck", interval=50, keep_latest_k=3, async_mode="async")
    cfg = CkptStoreCheckpointManager.from_config(stock, replica="s3://bucket/run")
    assert isinstance(cfg, BaseCheckpointManager.Config)  # what Trainer.Config.checkpoint is
    assert type(cfg)._owner is CkptStoreCheckpointManager  # what its build() constructs
    assert (cfg.folder, cfg.interval, cfg.keep_latest_k, cfg.async_mode) == ("ck", 50, 3, "async")
    assert cfg.replica == "s3://bucket/run"
    assert cfg.barrier_timeout == 600.0
    with pytest.raises(ValueError, match="at least 2"):  # torchtitan's own validation
        CkptStoreCheckpointManager.Config(enable=True, keep_latest_k=1)
    disabled = CkptStoreCheckpointManager.Config().build(
        dataloader=None,
        model_parts=[],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
    )
    assert disabled.save(10) is False
    assert disabled.load() is False
    disabled.close()


def test_one_process_without_a_process_group_saves_and_loads(tmp_path: Path) -> None:
    import warnings

    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager
    from tests.multirank.torchtitan_scenarios import Data, Tiny, TrainState

    def job(seed: int) -> tuple[Any, ...]:
        torch.manual_seed(seed)
        model = Tiny()
        group = ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01}
        )
        opt = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(
            model_parts=[model]
        )
        sched = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=opt, training_steps=100
        )
        data, state = Data(), TrainState()
        ckpt = CkptStoreCheckpointManager.Config(
            enable=True, folder="store", interval=2, keep_latest_k=2
        ).build(
            dataloader=data,
            model_parts=[model],
            optimizers=opt,
            lr_schedulers=sched,
            states={"train_state": state},
            sd_adapter=None,
            base_folder=str(tmp_path),
        )
        return model, opt, sched, data, state, ckpt

    def tensors(model: Any, opt: Any) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
        out.update(
            {f"opt/{k}": v.clone() for k, v in opt.state_dict().items() if torch.is_tensor(v)}
        )
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is disabled ..."
        model, opt, sched, data, state, ckpt = job(0)
        for step in range(1, 6):  # saves 2 and 4 (interval 2), not 5
            state.step = step
            model(data.batch(step)).pow(2).mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            ckpt.save(step)
            if step == 4:
                want = tensors(model, opt)
        ckpt.close()
        assert CheckpointManager(tmp_path / "store", create=False).steps() == [2, 4]

        model, opt, sched, data, state, ckpt = job(1)
        assert ckpt.load() is True
        assert (state.step, data.position, sched.state_dict()) == (4, 4, {"last_epoch": 4})
        got = tensors(model, opt)
        ckpt.close()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_close_after_a_failed_async_save_closes_the_store_and_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # DCP's CheckpointException is a BaseException: `except Exception` in close() let it
    # through before the log, torchtitan's clean-up and the store's close (its writer lock
    # held until the object was collected).
    import traceback
    from concurrent.futures import Future

    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.errors import ClosedError
    from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager
    from tests.multirank.torchtitan_scenarios import Tiny

    model = Tiny()
    ckpt = CkptStoreCheckpointManager.Config(enable=True, folder="store").build(
        dataloader=None,
        model_parts=[model],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    store = ckpt.store
    failed: Future[Any] = Future()
    cause = (OSError(28, "the disk is full"), traceback.extract_stack())
    failed.set_exception(CheckpointException("write_data", {1: cause}))
    ckpt.save_future = failed
    with caplog.at_level("ERROR", logger="ckptstore"), pytest.raises(CheckpointException):
        ckpt.close()
    assert "the last torchtitan checkpoint save failed" in caplog.text
    assert ckpt.store is None
    with pytest.raises(ClosedError):
        store.save(1, {"x": torch.ones(1)})


def test_resuming_the_newest_step_passes_over_a_corrupt_one(tmp_path: Path) -> None:
    # load_step=-1 (a restarted job): step 6 does not verify, so step 4 is loaded, with a
    # warning, and training saves step 6 anew; an explicit load_step=6 raises instead.
    (v,) = _run("resume_past_a_corrupt_step", 2, tmp_path)[:1]
    assert v["resumed_step"] == 4
    assert _changed(v["saved"]["4"], v["resumed"]) == []
    assert v["steps"] == [2, 4, 6]
    assert v["verify_6"] is True  # the new step 6 replaced the corrupt one
    assert v["explicit"] == "CheckpointException: integrity"

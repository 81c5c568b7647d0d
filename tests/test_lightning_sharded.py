"""CkptStoreIO under Lightning's ModelParallelStrategy (FSDP2 on CPU, gloo): issue 23.

A real ``Trainer(strategy=ModelParallelStrategy(...), plugins=[CkptStoreIO()])`` trains a
small model sharded with ``fully_shard`` in ``configure_model`` on 2 ranks. One 2-rank job
(tests/lightning_sharded_worker.py, started once: each run is a new Trainer in the same
processes) fits 3 epochs, resumes from its epoch-1 checkpoint, loads a copy with a corrupt
shard, resumes ``"last"`` from a copy whose newest checkpoints are corrupt, and saves a
checkpoint holding an object only pickle could store (on both ranks, then on rank 1 only),
and last resumes the checkpoint of a 4-rank job of FSDP2 over tensor parallelism, started
just before it; a 1-rank job resumes the 2-rank checkpoint. Each rank records digests of the
full parameters and Adam state (and the learning rate) when training starts, at each epoch's
end and at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import REPO, run_cli, run_job_ranks
from _once import made_once

from ckptstore import CheckpointManager
from ckptstore.errors import ConfigError

# Lightning (and ckptstore.integrations.lightning, which imports it) is imported by the
# tests that use it in this process, not here: every xdist worker collects this module, and
# importing Lightning, with tests/test_lightning.py's and tests/test_hf.py's imports, cost
# each worker 7 s of CPU before its first test (the jobs' ranks import it in their own
# processes).

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

WORKER = REPO / "tests" / "lightning_sharded_worker.py"
FIT = "fit"  # 3 epochs of 2 steps: epoch=1-step=4 and epoch=2-step=6 kept, and last
# ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2) on 4 ranks, then
# FSDP2 alone on 2 ranks resuming its epoch-1 checkpoint (the module's 2-rank job runs it).
FIT2D = [{"name": "fit2d", "epochs": 2, "tp": 2, "hidden": 6}]
RESUME2D = {"name": "resume2d", "epochs": 3, "hidden": 6, "ckpt": "fit2d/epoch=1-step=4.ckpt"}
# A test of the module's jobs: the first of them to run pays for both (at most 200 s + 170 s).
JOB_TIMEOUT = 420


def launch(out: Path, devices: int, plan: list[dict[str, Any]], timeout: float) -> None:
    """Every rank of the job, started as torchrun would (forked from the test fork server,
    which imports Lightning once); every rank dies on timeout."""
    name = f"job{devices}"
    (out / f"{name}.json").write_text(json.dumps(plan))
    argv = [str(WORKER), str(out), str(devices), str(out / f"{name}.json")]
    run_job_ranks(argv, devices, out / f"{name}.log", timeout, name)


def rows(out: Path, name: str, ranks: int) -> list[dict[str, Any]]:
    """What each rank recorded for run ``name``."""
    found = [out / f"{name}.rank{r}.json" for r in range(ranks)]
    missing = [p.name for p in found if not p.exists()]
    assert not missing, f"no record {missing}:\n" + "".join(
        p.read_text()[-3000:] for p in out.glob("job*.log")
    )
    return [json.loads(p.read_text()) for p in found]


def trained(row: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in row, row["error"]
    return row


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's jobs, run once for the whole pytest run (``made_once``: not once a
    worker); only test_resume_on_another_world_size writes in it, in a directory of its own."""
    return made_once(tmp_path_factory, "lightning-sharded", _jobs)[0]


def _jobs(out: Path) -> None:
    bad = "bad/epoch=2-step=6.ckpt"
    plan = [
        {"name": FIT, "epochs": 3},
        {"name": "resume", "epochs": 3, "ckpt": f"{FIT}/epoch=1-step=4.ckpt"},
        {"name": "extra", "epochs": 3, "extra": True, "ckpt": f"{FIT}/epoch=1-step=4.ckpt"},
        {
            "name": "explicit",
            "epochs": 3,
            "copy": [[f"{FIT}/epoch=2-step=6.ckpt", bad]],
            "corrupt": [f"{bad}/step-*/_shards.rank00001.*"],
            "ckpt": bad,
        },
        {
            "name": "fallback",
            "dir": "fb",
            "epochs": 3,
            "copy": [[FIT, "fb"]],
            "corrupt": [
                "fb/last.ckpt/step-*/_shards.rank00000.*",
                "fb/epoch=2-step=6.ckpt/step-*/_shards.rank00001.*",
            ],
            "ckpt": "last",
        },
    ]
    plan.append({"name": "wfit", "dir": "wf", "epochs": 2, "weights": True})
    plan.append(
        {
            "name": "wfallback",
            "dir": "wf2",
            "epochs": 3,
            "copy": [["wf", "wf2"]],
            "corrupt": ["wf2/last.ckpt/step-*/_shards.rank00000.*"],
            "ckpt": "last",
        }
    )
    # keep=2: last.ckpt holds steps 4 and 6. A copy of it alone, whose newest step has a
    # corrupt entry besides the tensors (Lightning's callbacks), resumes its step 4.
    plan.append({"name": "kfit", "dir": "k", "epochs": 3, "keep": 2})
    plan.append(
        {
            "name": "krest",
            "dir": "k2",
            "epochs": 3,
            "keep": 2,
            "copy": [["k/last.ckpt", "k2/last.ckpt"]],
            "corrupt": ["k2/last.ckpt/step-000000000006/callbacks.safetensors"],
            "ckpt": "last",
        }
    )
    plan.append({"name": "unsafe", "epochs": 1, "unsafe": True})
    plan.append({"name": "unsafe1", "epochs": 1, "unsafe": "rank1"})
    # The 4-rank job of test_fsdp2_over_tensor_parallel_resumes_on_data_parallel_alone
    # first: its 2-rank resume is this job's last run, so one pair of processes (each
    # importing Lightning: ~7 s of CPU) serves every 2-rank run. Its failure is that test's.
    try:
        launch(out, 4, FIT2D, timeout=200)
    except (AssertionError, pytest.fail.Exception) as e:
        (out / "fit2d.failed").write_text(str(e))
    else:
        plan.append(RESUME2D)
    launch(out, 2, plan, timeout=170)


@pytest.mark.timeout(JOB_TIMEOUT)
def test_fit_saves_every_rank_shards_through_ckptstore(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit = [trained(r) for r in rows(job, FIT, 2)]
    assert [r["world_size"] for r in fit] == [2, 2]
    assert [r["end_step"] for r in fit] == [6, 6]
    ckpt = job / FIT
    # epoch=0-step=2.ckpt was pruned by top-2 (remove_checkpoint): gone whole, no leftovers.
    assert sorted(e.name for e in ckpt.iterdir()) == [
        "epoch=1-step=4.ckpt",
        "epoch=2-step=6.ckpt",
        "last.ckpt",
    ]
    for store, step in (("epoch=1-step=4.ckpt", 4), ("epoch=2-step=6.ckpt", 6), ("last.ckpt", 6)):
        with CheckpointManager(ckpt / store, distributed=False, create=False) as mgr:
            assert mgr.steps() == [step]  # last.ckpt: steps 2 and 4 pruned after 6 committed
            manifest = mgr.manifest()
            assert manifest.world_size == 2
            assert manifest.dtensor
            assert manifest.metadata["lightning"]["global_step"] == step
            report = mgr.verify()
            assert report.ok, report.problems
        names = {p.name for p in (ckpt / store).rglob("*") if p.is_file()}
        for r in (0, 1):
            assert any(n.startswith(f"_shards.rank0000{r}.") for n in names), names
        assert not [n for n in names if n.endswith(".distcp") or n in (".metadata", "meta.pt")]
    for store in ("epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"):
        rc, stdout, stderr = run_cli(capsys, "verify", ckpt / store, "--all", "--json")
        assert rc == 0, stdout + stderr
        assert [r["ok"] for r in json.loads(stdout)] == [True]

    # One process, no process group: the plugin gives the full tensors the ranks trained.
    sys.path.insert(0, str(WORKER.parent))
    from lightning_sharded_worker import _sha

    from ckptstore.integrations.lightning import CkptStoreIO

    full = CkptStoreIO().load_checkpoint(ckpt / "last.ckpt")
    assert full["global_step"] == 6
    end = fit[0]["end"]
    params = {k.removeprefix("param/"): v for k, v in end.items() if k.startswith("param/")}
    assert sorted(full["state_dict"]) == sorted(params)
    for name, digest in params.items():
        assert _sha(full["state_dict"][name].contiguous()) == digest, name


@pytest.mark.timeout(JOB_TIMEOUT)
def test_resume_continues_bit_identically(job: Path) -> None:
    fit = [trained(r) for r in rows(job, FIT, 2)]
    for rank, row in enumerate(rows(job, "resume", 2)):
        trained(row)
        assert (row["start_step"], row["start_epoch"]) == (4, 2)
        # Parameters, Adam's moments and steps, and the scheduler's learning rate, as saved.
        assert row["start"] == fit[rank]["epochs"]["1"]
        assert any(k.endswith("/exp_avg_sq") for k in row["start"])
        assert row["end_step"] == 6
        assert row["end"] == fit[rank]["end"]  # the last epoch again: bit for bit the same


@pytest.mark.timeout(JOB_TIMEOUT)
def test_resume_on_another_world_size(job: Path) -> None:
    fit = trained(rows(job, FIT, 2)[0])
    launch(job, 1, [{"name": "one", "epochs": 3, "ckpt": f"{FIT}/epoch=1-step=4.ckpt"}], 120)
    (one,) = rows(job, "one", 1)
    trained(one)
    assert one["world_size"] == 1
    assert (one["start_step"], one["start_epoch"]) == (4, 2)
    assert one["start"] == fit["epochs"]["1"]  # full tensors saved by 2 ranks, on 1
    assert one["end_step"] == 6
    with CheckpointManager(job / "one" / "last.ckpt", distributed=False, create=False) as mgr:
        assert mgr.steps() == [6]
        assert mgr.manifest().world_size == 1
        assert mgr.verify().ok


@pytest.mark.timeout(JOB_TIMEOUT)
def test_a_corrupt_entry_besides_the_tensors_falls_back_to_the_older_version(job: Path) -> None:
    # The newest version's model and optimizer shards verify, its callbacks.safetensors does
    # not: the resume of "last" went to the siblings (none here) and failed on every rank,
    # though step 4 of the same store was whole. It restores step 4 now, model and
    # optimizer alike, bit for bit what the job had at the end of epoch 1.
    with CheckpointManager(job / "k" / "last.ckpt", distributed=False, create=False) as mgr:
        assert mgr.steps() == [4, 6]
    fit = [trained(r) for r in rows(job, "kfit", 2)]
    for rank, row in enumerate(rows(job, "krest", 2)):
        trained(row)
        assert (row["start_step"], row["start_epoch"]) == (4, 2)
        assert row["start"] == fit[rank]["epochs"]["1"]
        assert row["end"] == fit[rank]["end"]


@pytest.mark.timeout(120)
def test_a_checkpoint_saved_without_sharding_is_refused_as_such_and_untouched(
    tmp_path: Path,
) -> None:
    # CkptStoreIO under another strategy writes one full checkpoint; loaded under
    # ModelParallelStrategy it was called corrupt ("does not verify"), after the restore had
    # written its tensors into the model. It is refused by what it is, before any read.
    from ckptstore.integrations.lightning import CkptStoreIO

    ckpt = tmp_path / "plain" / "last.ckpt"
    CkptStoreIO().save_checkpoint(
        {"state_dict": {"net.0.weight": torch.ones(5, 4)}, "global_step": 2, "epoch": 0},
        ckpt,
    )
    plan = [{"name": "plainload", "epochs": 1, "ckpt": "plain/last.ckpt"}]
    launch(tmp_path, 1, plan, timeout=100)
    (row,) = rows(tmp_path, "plainload", 1)
    assert row["error"]["type"] == "StateMismatchError", row["error"]
    assert "was not saved under ModelParallelStrategy" in row["error"]["message"]
    assert "under another strategy" in row["error"]["message"]
    assert "start" not in row  # training never started
    with CheckpointManager(ckpt, distributed=False, create=False) as mgr:
        assert mgr.verify().ok


@pytest.mark.timeout(JOB_TIMEOUT)
def test_a_model_with_another_layer_is_refused_before_anything_is_read(job: Path) -> None:
    # strict_loading: the restore read the layers both have into the model's own shards,
    # then Lightning's load_state_dict raised torch's RuntimeError on the missing keys.
    fit = rows(job, FIT, 2)
    for rank, row in enumerate(rows(job, "extra", 2)):
        assert "start" not in row  # training never began
        assert row["error"]["type"] == "StateMismatchError", row["error"]
        msg = row["error"]["message"]
        assert "net.3.weight" in msg, msg
        assert "which the checkpoint lacks" in msg
        assert "strict_loading" in msg
        # Untouched: the layers both have hold their initial values, not the checkpoint's.
        saved = fit[rank]["epochs"]["1"]
        common = [k for k in row["after_error"] if k in saved]
        assert sorted(common) == [f"param/net.{i}.{p}" for i in (0, 2) for p in ("bias", "weight")]
        assert all(row["after_error"][k] != saved[k] for k in common)


@pytest.mark.timeout(JOB_TIMEOUT)
def test_corrupt_shard_fails_the_load_on_every_rank(job: Path) -> None:
    for row in rows(job, "explicit", 2):
        assert "start" not in row  # training never began from a corrupt checkpoint
        assert row["error"]["type"] == "IntegrityError", row["error"]
        assert "bad/epoch=2-step=6.ckpt" in row["error"]["message"]
        assert "does not verify" in row["error"]["message"]


@pytest.mark.timeout(JOB_TIMEOUT)
def test_corrupt_last_falls_back_to_the_newest_checkpoint_that_verifies(job: Path) -> None:
    fit = [trained(r) for r in rows(job, FIT, 2)]
    for rank, row in enumerate(rows(job, "fallback", 2)):
        trained(row)
        # last.ckpt (6) and epoch=2-step=6 are corrupt: epoch=1-step=4 is loaded instead.
        assert (row["start_step"], row["start_epoch"]) == (4, 2)
        assert row["start"] == fit[rank]["epochs"]["1"]
        assert row["end"] == fit[rank]["end"]


@pytest.mark.timeout(JOB_TIMEOUT)
def test_the_fall_back_passes_over_a_weights_only_checkpoint(job: Path) -> None:
    # A weights-only ModelCheckpoint beside the full one: its checkpoint is the newest after
    # a corrupt last.ckpt, and the fall-back stopped at it (StateMismatchError: no
    # optimizer_states) short of epoch=1-step=4, a full one that loads.
    assert (job / "wf" / "weights-epoch=1.ckpt").is_dir()
    for row in rows(job, "wfallback", 2):
        trained(row)
        assert (row["start_step"], row["start_epoch"]) == (4, 2)


@pytest.mark.timeout(JOB_TIMEOUT)
def test_an_object_that_needs_pickle_fails_the_save_on_every_rank(job: Path) -> None:
    for row in rows(job, "unsafe", 2):
        assert row["error"]["type"] == "UnsafeCheckpointError", row["error"]
        assert "checkpoint['opaque']" in row["error"]["message"]
        assert "allow_pickle=True" in row["error"]["message"]
    # Nothing was committed, and no hidden sibling is left beside the path.
    assert [p.name for p in (job / "unsafe").iterdir()] == []
    # Rank 1 alone holds it: rank 0 gets the same refusal, naming rank 1, and nothing lands.
    zero, one = rows(job, "unsafe1", 2)
    assert one["error"]["type"] == "UnsafeCheckpointError", one["error"]
    assert zero["error"]["type"] == "UnsafeCheckpointError", zero["error"]
    assert "refused by rank(s) 1 (rank 1: checkpoint['opaque']" in zero["error"]["message"]
    assert [p.name for p in (job / "unsafe1").iterdir()] == []


# ---- what is served, what is refused, at construction ------------------------------------


def test_model_parallel_options_ckptstore_cannot_serve_are_refused(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ckptstore.integrations.lightning import CkptStoreIO

    def build(strategy: ModelParallelStrategy, io: CkptStoreIO) -> pl.Trainer:
        return pl.Trainer(
            strategy=strategy,
            plugins=[io],
            accelerator="cpu",
            devices=2,
            logger=False,
            default_root_dir=tmp_path,
        )

    # save_distributed_checkpoint=False: tests/test_lightning.py
    served = CkptStoreIO()
    assert build(ModelParallelStrategy(), served).strategy.checkpoint_io is served
    with pytest.raises(ConfigError, match="compression='zstd' cannot hold sharded"):
        build(ModelParallelStrategy(), CkptStoreIO(compression="zstd"))
    assert list(tmp_path.iterdir()) == []  # nothing was written anywhere


def test_model_parallel_without_the_plugin_keeps_lightnings_own_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy

    import ckptstore.integrations.lightning_sharded as sharded

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("ckptstore's path taken without CkptStoreIO")

    monkeypatch.setattr(sharded, "save_sharded", never)
    strategy = ModelParallelStrategy(save_distributed_checkpoint=False)
    strategy.checkpoint_io = TorchCheckpointIO()
    # Lightning's own full save: rank 0 (no process group here) writes one torch.save file.
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "x.ckpt")
    assert (tmp_path / "x.ckpt").is_file()


@pytest.mark.timeout(120)
def test_a_failure_before_the_save_reaches_every_rank_with_who_failed(tmp_path: Path) -> None:
    # _agree: an all-reduce (MIN) of one integer names the first rank that failed, which
    # broadcasts its error's text; what each rank receives does not grow with the world.
    from tests.multirank.launch import launch as launch_ranks
    from tests.multirank.launch import values

    got = values(launch_ranks("lightning_agree", 3, tmp_path, timeout=60))
    named = "saving X failed on rank 1: ValueError: boom on 1; nothing was saved"
    for rank, v in enumerate(got):
        assert v["none"]["ok"], v["none"]
        one, two = v["one"], v["two"]
        if rank == 1:
            assert (one["error_type"], one["message"]) == ("ValueError", "boom on 1")
        else:
            assert one["error_type"] == "CommitError", one
            assert one["message"] == named
        if rank in (1, 2):  # each failing rank raises its own
            assert (two["error_type"], two["message"]) == ("ValueError", f"boom on {rank}")
        else:  # the first of them is named
            assert two["message"] == named


@pytest.mark.timeout(120)
def test_rank0_failing_to_list_the_fall_backs_fails_every_rank_at_once(tmp_path: Path) -> None:
    # A checkpoint that does not verify sends every rank to the newest one beside it, which
    # rank 0 lists; its failure there left the others in the broadcast for the strategy's
    # timeout (30 minutes by default; found by review).
    from tests.multirank.launch import launch as launch_ranks
    from tests.multirank.launch import values

    got = values(launch_ranks("lightning_fall_back_unlisted", 2, tmp_path, timeout=60))
    for v in got:
        assert v["error_type"] == "IntegrityError", v
        assert "does not match its crc32c" in v["message"], v
        assert "rank 0 could not list the checkpoints beside it" in v["message"], v
        assert "FileNotFoundError" in v["message"], v
        assert v["seconds"] < 20, v  # not after a gloo timeout


@pytest.mark.timeout(JOB_TIMEOUT)
def test_fsdp2_over_tensor_parallel_resumes_on_data_parallel_alone(job: Path) -> None:
    # ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2): the model's
    # layers column- and row-wise parallel, FSDP2 over them (weights (_StridedShard(0),
    # Shard(0))). Saved by 4 ranks through CkptStoreIO (FIT2D), resumed by 2 ranks of FSDP2
    # alone (RESUME2D, the module job's last run), bit for bit, and trained on.
    failed = job / "fit2d.failed"
    assert not failed.exists(), failed.read_text()
    fit = [trained(r) for r in rows(job, "fit2d", 4)]
    store = job / "fit2d" / "epoch=1-step=4.ckpt"
    with CheckpointManager(store, distributed=False, create=False) as mgr:
        index = json.loads((store / f"step-{4:012d}" / "dtensors.json").read_text())
        assert mgr.manifest().world_size == 4
        assert mgr.manifest().format_version == 5  # the split index spells _StridedShard
    placements = {tuple(t["placements"]) for t in index["tensors"].values()}
    assert ("_S(0, 2)", "S(0)") in placements
    resumed = [trained(r) for r in rows(job, "resume2d", 2)]
    assert [r["start_step"] for r in resumed] == [4, 4]
    assert all(r["start"] == fit[0]["epochs"]["1"] for r in resumed)
    assert [r["end_step"] for r in resumed] == [6, 6]

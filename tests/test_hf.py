"""ckptstore.integrations.hf: accelerate's Accelerator and the transformers Trainer.

Both resume a tiny model (built from a config, nothing downloaded) and must end bit-identical
to an uninterrupted run, also when the newest checkpoints are corrupt and resume falls back.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from _helpers import TokenData, step_dir
from torch import nn

from ckptstore import CheckpointManager, ConfigError, StateMismatchError, StepExistsError

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    from ckptstore.integrations.hf import AcceleratorCheckpointer

# accelerate and transformers (with ckptstore.integrations.hf, which imports transformers)
# are imported by the tests that use them, not here: every xdist worker collects this module,
# and these imports, with Lightning's (tests/test_lightning.py), cost each worker 7 s of CPU
# before its first test; the TrainerCallbacks are in tests/hf_callbacks.py for that.
if not (importlib.util.find_spec("accelerate") and importlib.util.find_spec("transformers")):
    pytest.skip("needs accelerate and transformers", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def corrupt(root: Path, step: int, name: str) -> None:
    """Flip one byte in the middle of a payload of a committed step."""
    path = root / step_dir(step) / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- accelerate ----------------------------------------------------------------------


class RunningStats:
    """A custom object for register_for_checkpointing: an int and a tensor."""

    def __init__(self) -> None:
        self.n = 0
        self.total = torch.zeros(())

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self.total.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.total = sd["total"].clone()


STEPS = 10
BATCHES_PER_EPOCH = 4


class AccRun:
    """A prepared model, AdamW, LR schedule, shuffled dataloader and a registered object.

    ``use_seedable_sampler`` and the loader's own generator make the order of an epoch a
    function of its number only, so a run can resume in the middle of one.
    """

    def __init__(self, seed: int) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration

        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        )
        loader = torch.utils.data.DataLoader(
            data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
        )
        config = DataLoaderConfiguration(use_seedable_sampler=True)
        self.acc = Accelerator(cpu=True, dataloader_config=config)
        self.stats = RunningStats()
        self.model, self.opt, self.sched, self.dl = self.acc.prepare(model, opt, sched, loader)
        self.acc.register_for_checkpointing(self.stats)

    def train(
        self, start: int, stop: int, ckpt: AcceleratorCheckpointer | None = None, save_at=()
    ) -> None:
        step = start
        while step < stop:
            self.dl.set_epoch(step // BATCHES_PER_EPOCH)
            skip = step % BATCHES_PER_EPOCH
            batches = self.acc.skip_first_batches(self.dl, skip) if skip else self.dl
            for x, y in batches:
                loss = (self.model(x) - y).square().mean()
                self.acc.backward(loss)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad()
                self.stats.n += 1
                self.stats.total += loss.detach()
                if ckpt is not None and step in save_at:
                    ckpt.save(step, metrics={"loss": loss.item()})
                step += 1
                if step >= stop:
                    break

    def params(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().clone() for k, v in self.acc.unwrap_model(self.model).state_dict().items()
        }


@pytest.fixture(scope="module")
def acc_reference() -> AccRun:
    run = AccRun(0)
    run.train(0, STEPS)
    return run


def test_accelerate_resume_is_bit_identical(tmp_path: Path, acc_reference: AccRun) -> None:
    from ckptstore.integrations.hf import AcceleratorCheckpointer

    root = tmp_path / "ckpt"
    first = AccRun(0)
    with AcceleratorCheckpointer(first.acc, root, keep=3) as ckpt:
        first.train(0, 8, ckpt, save_at=(2, 5))  # then "crashes": steps 6 and 7 are lost
        assert ckpt.manager.steps() == [2, 5]
    with CheckpointManager(root) as mgr:
        stored = set(mgr.load(5))
        assert mgr.verify(5).ok
    assert stored == {
        "model",
        "optimizer",
        "scheduler",
        "dataloader",
        "custom_0",
        "accelerator",
        "rng",
    }

    second = AccRun(1)  # other initial weights: everything must come from the checkpoint
    assert not same(second.params(), acc_reference.params())
    with AcceleratorCheckpointer(second.acc, root, keep=3) as ckpt:
        start = ckpt.resume()
        assert start == 6
        assert second.stats.n == 6
        assert second.dl.iteration == 1  # the epoch the dataloader is in
        second.train(start, STEPS)
    assert same(second.params(), acc_reference.params())
    assert second.stats.n == STEPS
    assert torch.equal(second.stats.total, acc_reference.stats.total)
    assert second.sched.state_dict() == acc_reference.sched.state_dict()


def test_accelerate_falls_back_past_a_corrupt_step(
    tmp_path: Path, acc_reference: AccRun, caplog: pytest.LogCaptureFixture
) -> None:
    from ckptstore.integrations.hf import AcceleratorCheckpointer

    root = tmp_path / "ckpt"
    first = AccRun(0)
    with AcceleratorCheckpointer(first.acc, root) as ckpt:
        first.train(0, 8, ckpt, save_at=(3, 6))
    corrupt(root, 6, "model.safetensors")

    again = AccRun(2)
    with AcceleratorCheckpointer(again.acc, root) as ckpt:
        assert ckpt.resume() == 4  # step 6 does not verify: step 3 is restored
        assert again.stats.n == 4
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            again.train(4, STEPS, ckpt, save_at=(6,))  # saving step 6 replaces the bad one
        assert "does not verify" in caplog.text
        assert ckpt.manager.verify(6).ok
        with pytest.raises(StepExistsError):
            ckpt.save(6)  # a step that verifies is never overwritten
    assert same(again.params(), acc_reference.params())


def test_engines_that_keep_their_own_state_are_refused_and_fsdp2_is_served(
    tmp_path: Path,
) -> None:
    # accelerate sets FSDP, DeepSpeed and Megatron-LM only on accelerators: the accelerator's
    # two attributes the checks read stand in for them (FSDP2 itself: test_gpu_frameworks).
    from accelerate.utils import DistributedType

    from ckptstore.errors import ConfigError
    from ckptstore.integrations.hf import AcceleratorCheckpointer

    class Engine:
        def __init__(self, dtype: DistributedType, fsdp2: bool) -> None:
            self.distributed_type, self.is_fsdp2 = dtype, fsdp2

    with pytest.raises(ConfigError, match="FSDP version 1 keeps parameters in flat buffers"):
        AcceleratorCheckpointer(Engine(DistributedType.FSDP, False), tmp_path / "a")
    for dtype in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        with pytest.raises(ConfigError, match=f"distributed_type {dtype.value} shards"):
            AcceleratorCheckpointer(Engine(dtype, False), tmp_path / "b")
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "b").exists()
    with AcceleratorCheckpointer(Engine(DistributedType.FSDP, True), tmp_path / "c") as ckpt:
        assert ckpt.manager.steps() == []


def test_accelerate_refuses_other_registered_objects(tmp_path: Path) -> None:
    from ckptstore.integrations.hf import AcceleratorCheckpointer

    root = tmp_path / "ckpt"
    run = AccRun(0)
    with AcceleratorCheckpointer(run.acc, root) as ckpt:
        ckpt.save(0)
    other = AccRun(0)
    other.acc.register_for_checkpointing(RunningStats())  # one more than was saved
    with AcceleratorCheckpointer(other.acc, root) as ckpt, pytest.raises(StateMismatchError) as e:
        ckpt.resume()
    # Neither resume() nor restore() takes strict=False: the advice fits the checkpointer.
    assert str(e.value).endswith(
        "has no entry for 'custom_1' (it holds 'model', 'optimizer', 'scheduler', "
        "'dataloader', 'custom_0', 'accelerator', 'rng'): prepare and register the same "
        "objects, in the same order, as the job that saved it"
    ), e.value


def test_accelerate_names_a_store_another_writer_committed(tmp_path: Path) -> None:
    from ckptstore.integrations.hf import AcceleratorCheckpointer

    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:  # what CkptStoreCallback commits, in small
        mgr.save(2, {"model": {"w": torch.ones(2)}, "trainer_state": {"global_step": 2}})
    run = AccRun(0)
    with AcceleratorCheckpointer(run.acc, root) as ckpt, pytest.raises(StateMismatchError) as e:
        ckpt.resume()
    assert str(e.value).endswith(
        "it was not saved by AcceleratorCheckpointer: point the checkpointer at the store its "
        "own save() wrote"
    ), e.value
    assert "strict" not in str(e.value)
    with CheckpointManager(root) as mgr:  # nothing changed
        assert mgr.steps() == [2]


# ---- transformers Trainer ----------------------------------------------------------------


def gpt2(seed: int) -> GPT2LMHeadModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    return GPT2LMHeadModel(config)  # dropout on: the RNG state matters


def trainer(out: Path, seed: int, callbacks: list[Any]) -> Trainer:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        save_strategy="steps",
        save_steps=2,
        max_steps=6,
        per_device_train_batch_size=2,
        logging_steps=1,
        learning_rate=1e-3,
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=gpt2(seed), args=args, train_dataset=TokenData(), callbacks=callbacks)


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def test_trainer_saves_and_resumes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from hf_callbacks import StopAfter

    from ckptstore.integrations.hf import CkptStoreCallback

    reference = trainer(tmp_path / "ref", 0, [])
    reference.train()
    assert reference.state.global_step == 6
    ref = weights(reference)

    root = tmp_path / "ckpt"
    # 1. killed after step 5: steps 2 and 4 are committed
    cb = CkptStoreCallback(root, keep=3, keep_hf_checkpoints=False)
    killed = trainer(tmp_path / "a", 0, [cb, StopAfter(5)])
    cb.train(killed)
    assert cb.resumed_step is None
    assert killed.state.global_step == 5
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [2, 4]
        assert mgr.manifest(4).metrics["loss"] > 0
        assert mgr.manifest(4).metadata["transformers"]["global_step"] == 4
        stored = mgr.load(4)
    assert stored["trainer_state"]["global_step"] == 4
    assert stored["trainer_state"]["epoch"] == 1.0
    assert not list((tmp_path / "a").glob("checkpoint-*"))  # keep_hf_checkpoints=False

    # 2. a fresh process (other initial weights) resumes from step 4 and finishes
    cb = CkptStoreCallback(root, keep=3)
    resumed = trainer(tmp_path / "b", 1, [cb])
    cb.train(resumed)
    assert cb.resumed_step == 4
    assert resumed.state.global_step == 6
    assert [e["step"] for e in resumed.state.log_history if "loss" in e][:2] == [1, 2]
    assert same(weights(resumed), ref)

    # 3. the two newest steps are corrupt: resume from step 2, in the middle of epoch 0
    corrupt(root, 6, "model.safetensors")
    corrupt(root, 4, "optimizer.safetensors")
    cb = CkptStoreCallback(root, keep=3)
    fallback = trainer(tmp_path / "c", 2, [cb])
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        cb.train(fallback)
    assert "skipping step 6" in caplog.text
    assert "skipping step 4" in caplog.text
    assert cb.resumed_step == 2
    assert fallback.state.global_step == 6
    assert same(weights(fallback), ref)
    with CheckpointManager(root) as mgr:  # steps 4 and 6 were saved again, whole
        assert mgr.steps() == [2, 4, 6]
        assert all(mgr.verify(s).ok for s in mgr.steps())


def test_trainer_resume_checks_the_model(tmp_path: Path) -> None:
    from hf_callbacks import StopAfter
    from transformers import GPT2Config, GPT2LMHeadModel

    from ckptstore.integrations.hf import CkptStoreCallback

    root = tmp_path / "ckpt"
    cb = CkptStoreCallback(root)
    first = trainer(tmp_path / "a", 0, [cb, StopAfter(2)])
    cb.train(first)
    torch.manual_seed(0)
    wider = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100))
    other = trainer(tmp_path / "b", 0, [])
    other.model = wider
    with pytest.raises(StateMismatchError, match="mismatched"):
        CkptStoreCallback(root).train(other)


# ---- export --hf: a directory from_pretrained loads (issue 22 #8) ----------------------


def _hf_dir_loads(out_dir: Path, model: GPT2LMHeadModel) -> None:
    """``out_dir`` has a config.json and weights that ``from_pretrained`` loads exactly."""
    from transformers import GPT2LMHeadModel

    assert (out_dir / "config.json").is_file()
    loaded = GPT2LMHeadModel.from_pretrained(str(out_dir))
    assert loaded.config.n_embd == model.config.n_embd == 32
    assert loaded.config.n_layer == 2
    assert same(
        {k: v.detach() for k, v in loaded.state_dict().items()},
        {k: v.detach() for k, v in model.state_dict().items()},
    )


def test_trainer_export_hf_writes_the_config_from_pretrained_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from _helpers import run_cli
    from hf_callbacks import StopAfter

    from ckptstore.integrations.hf import CkptStoreCallback

    root = tmp_path / "ckpt"
    cb = CkptStoreCallback(root)
    t = trainer(tmp_path / "a", 0, [cb, StopAfter(2)])
    cb.train(t)
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [2]
        recorded = mgr.manifest(2).metadata["hf_configs"]["model"]
    assert recorded["n_embd"] == 32
    assert recorded["model_type"] == "gpt2"
    out_dir = tmp_path / "hf"
    rc, out, err = run_cli(capsys, "export", root, "--step", "2", "--hf", out_dir)
    assert rc == 0, err
    assert "config.json" in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "model.safetensors"]
    _hf_dir_loads(out_dir, t.model)


def test_accelerate_export_hf_writes_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from _helpers import run_cli
    from accelerate import Accelerator

    from ckptstore.integrations.hf import AcceleratorCheckpointer

    acc = Accelerator(cpu=True)
    model = acc.prepare(gpt2(3))
    ckpt = AcceleratorCheckpointer(acc, tmp_path / "ckpt")
    ckpt.save(1, metadata={"run": "x"}).wait()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        md = mgr.manifest(1).metadata
    assert md["run"] == "x"  # the caller's metadata is kept beside the config
    assert md["hf_configs"]["model"]["n_embd"] == 32
    root = tmp_path / "ckpt"
    rc, _, err = run_cli(capsys, "export", root, "--step", "1", "--hf", tmp_path / "hf")
    assert rc == 0, err
    _hf_dir_loads(tmp_path / "hf", acc.unwrap_model(model))


def test_export_hf_config_flag_for_other_stores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from _helpers import run_cli

    model = gpt2(4)
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "step": 1})
    # No config recorded: the directory has the weights only, and the output says so.
    rc, out, err = run_cli(capsys, "export", root, "--step", "1", "--hf", tmp_path / "w")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["model.safetensors"]
    assert "no config.json" in out
    # --config PATH: a config.json written by save_pretrained, copied into the directory.
    model.config.save_pretrained(str(tmp_path / "cfg"))
    cfg = tmp_path / "cfg" / "config.json"
    rc, out, err = run_cli(
        capsys, "export", root, "--step", "1", "--hf", tmp_path / "hf", "--config", cfg
    )
    assert rc == 0, err
    assert (tmp_path / "hf" / "config.json").read_bytes() == cfg.read_bytes()
    _hf_dir_loads(tmp_path / "hf", model)
    # A config that is not a JSON object is refused, and nothing is written.
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    rc, out, err = run_cli(
        capsys, "export", root, "--step", "1", "--hf", tmp_path / "hf2", "--config", bad
    )
    assert rc != 0
    assert str(bad) in err
    assert not (tmp_path / "hf2").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    # --config without --hf is a usage error.
    rc, _, err = run_cli(
        capsys, "export", root, "--step", "1", tmp_path / "x.safetensors", "--config", cfg
    )
    assert rc == 2, err


@pytest.mark.timeout(120)
def test_trainer_saves_go_on_while_the_replica_uploads(tmp_path: Path) -> None:
    # Removing the Trainer's checkpoint-N twin of a step waited for every upload
    # (CheckpointManager.wait): training stood still at each save until the replica had
    # every step. It needs only the step committed locally.
    from hf_callbacks import HoldUploads

    from ckptstore.integrations.hf import CkptStoreCallback

    root, replica = tmp_path / "ckpt", tmp_path / "replica"
    cb = CkptStoreCallback(root, replica=str(replica), replica_keep=None)
    hold = HoldUploads(cb, release_s=60)
    cb.train(trainer(tmp_path / "a", 0, [cb, hold]))  # its end waits for the uploads
    # Every step's end came with nothing on the replica yet: no save waited for one.
    assert hold.seen == [(s, []) for s in range(1, 7)]
    assert not list((tmp_path / "a").glob("checkpoint-*"))
    with CheckpointManager(replica, create=False) as there:
        assert there.steps() == [2, 4, 6]
        assert all(there.verify(s).ok for s in (2, 4, 6))


@pytest.mark.timeout(120)
def test_a_failed_async_save_keeps_the_trainers_own_checkpoint(tmp_path: Path) -> None:
    # Step 2's background save runs out of disk: its checkpoint-2 twin is then the only
    # copy of step 2, so it stays; the failure is raised (here by close at the end).
    from faults import Injector, injected
    from hf_callbacks import StopAfter

    from ckptstore import CommitError
    from ckptstore.integrations.hf import CkptStoreCallback

    root = tmp_path / "ckpt"
    cb = CkptStoreCallback(root, async_save=True)
    fault = Injector(1, "ENOSPC", op="_open_write", target=step_dir(2))
    full = f"{step_dir(2)} failed: the disk is full"
    with injected(fault) as inj, pytest.raises(CommitError, match=full):
        cb.train(trainer(tmp_path / "a", 0, [cb, StopAfter(3)]))
    assert inj.fired is not None
    assert [p.name for p in (tmp_path / "a").glob("checkpoint-*")] == ["checkpoint-2"]
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == []


# ---- the Trainer's own checkpoint-N directories (issue 22 #10) --------------------------


def _best_args(out: Path, max_steps: int) -> TrainingArguments:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        max_steps=max_steps,
        learning_rate=1e-2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        per_device_train_batch_size=2,
        disable_tqdm=True,
        seed=0,
    )


@pytest.mark.timeout(120)
def test_a_checkpoint_dir_that_was_the_best_goes_once_another_is(tmp_path: Path) -> None:
    # load_best_model_at_end keeps the best model's checkpoint-N for the Trainer. One that
    # was the best when saved stayed for good once a better one came: with an improving
    # metric every folder stayed, each step's state on disk twice.
    from transformers import Trainer

    from ckptstore.integrations.hf import CkptStoreCallback

    args = _best_args(tmp_path / "out", 8)
    cb = CkptStoreCallback(tmp_path / "ckpt", keep=3)
    t = Trainer(
        model=gpt2(0),
        args=args,
        train_dataset=TokenData(),
        eval_dataset=TokenData(),
        callbacks=[cb],
    )
    cb.train(t)
    best = t.state.best_model_checkpoint
    assert best is not None
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == [Path(best).name]
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.steps() == [4, 6, 8]


@pytest.mark.timeout(180)
def test_a_restart_neither_strands_the_best_folder_nor_rewinds_to_it(tmp_path: Path) -> None:
    """The best model's checkpoint-N, spared by a run that was killed, stayed on disk for
    good after the restart (the new callback did not know it); and
    trainer.train(resume_from_checkpoint=True) took that folder, the newest left, went
    back to its step without a word and failed steps later on a committed step (found by
    review). The score of each evaluation is scripted: step 2 is the best until step 8."""
    from hf_callbacks import StopAfter
    from transformers import Trainer

    from ckptstore.integrations.hf import CkptStoreCallback

    out, root = tmp_path / "out", tmp_path / "ckpt"
    score = {2: 1.0, 4: 0.0, 6: 0.0, 8: 5.0}

    def job(extra: list[Any]) -> tuple[Trainer, CkptStoreCallback]:
        cb = CkptStoreCallback(root, keep=3)
        args = _best_args(out, 8)
        args.metric_for_best_model, args.greater_is_better = "score", True
        t = Trainer(
            model=gpt2(0),
            args=args,
            train_dataset=TokenData(),
            eval_dataset=TokenData(),
            callbacks=[cb, *extra],
            compute_metrics=lambda _: {"score": score[t.state.global_step]},
        )
        return t, cb

    killed, cb = job([StopAfter(5)])
    cb.train(killed)
    cb.close()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # the best
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [2, 4]
    # The usual HF resume takes that folder: refused before a step is trained.
    again, _ = job([])
    with pytest.raises(ConfigError, match=r"step-0*4 is committed, and this run starts at step 2"):
        again.train(resume_from_checkpoint=True)
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [2, 4]
    # The callback's resume: on to the end; the folder spared before the restart goes once
    # step 8 is the best, as in a run that never stopped.
    resumed, cb = job([])
    cb.train(resumed)
    assert cb.resumed_step == 4
    assert resumed.state.global_step == 8
    assert Path(resumed.state.best_model_checkpoint).name == "checkpoint-8"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-8"]


def test_trainer_checkpoint_dirs_are_removed_by_default(tmp_path: Path) -> None:
    from hf_callbacks import StopAfter

    from ckptstore.integrations.hf import CkptStoreCallback

    root = tmp_path / "ckpt"
    cb = CkptStoreCallback(root)
    assert cb.keep_hf_checkpoints is False
    t = trainer(tmp_path / "a", 0, [cb, StopAfter(4)])
    cb.train(t)
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [2, 4]
        assert all(mgr.verify(s).ok for s in mgr.steps())
    # Only ckptstore's copy of each step takes disk space.
    assert not list((tmp_path / "a").glob("checkpoint-*"))
    # Asking for them keeps them.
    cb = CkptStoreCallback(tmp_path / "ckpt2", keep_hf_checkpoints=True)
    t = trainer(tmp_path / "b", 0, [cb, StopAfter(2)])
    cb.train(t)
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-2"]

"""``ckptstore import`` of foreign checkpoints (ckptstore.ops.importers): plain torch.save dicts,
Lightning ``.ckpt`` files and torch.distributed.checkpoint (DCP) directories.

Each source is imported into a store, ``ckptstore verify`` passes, and what the store holds
equals the source exactly; nothing is ever unpickled beyond tensors and plain data.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import deflated, run_cli
from torch import nn

from ckptstore import CheckpointManager

SIDE_EFFECTS: list[str] = []


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal values, types included; tensors bit for bit (dtype, shape, values)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, where
        assert a.shape == b.shape, where
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.bf16 = nn.Parameter(torch.randn(2, 2).to(torch.bfloat16))


def trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "bf16"], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    for _ in range(2):
        model.norm(model.fc(torch.randn(5, 4))).square().mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


# ---- Lightning .ckpt -------------------------------------------------------------------


def lightning_ckpt(hyper_parameters: dict[str, Any]) -> dict[str, Any]:
    """The dict Lightning 2.x writes (Trainer.save_checkpoint), with a real training state."""
    model, opt, sched = trained()
    progress = {"total": {"ready": 2, "completed": 2}, "current": {"ready": 2, "completed": 2}}
    return {
        "epoch": 1,
        "global_step": 2,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": collections.OrderedDict(
            (f"model.{k}", v) for k, v in model.state_dict().items()
        ),
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.state_dict": {"_batches_that_stepped": 2},
                "epoch_loop.batch_progress": {**progress, "is_last_batch": True},
                "epoch_loop.automatic_optimization.optim_progress": {
                    "optimizer": {"step": progress}
                },
            },
            "validate_loop": {"state_dict": {}},
        },
        "callbacks": {
            "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0}": {
                "best_model_path": "./checkpoints/epoch=0-step=2.ckpt",
                "best_model_score": None,
                "kth_value": torch.tensor(float("inf")),
                "best_k_models": {},
            }
        },
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": hyper_parameters,
    }


class HParams:
    """A custom hyper-parameter object: weights_only refuses it, nothing of it may run."""

    def __init__(self) -> None:
        self.width = 4

    def __setstate__(self, state: dict[str, Any]) -> None:
        SIDE_EFFECTS.append("HParams.__setstate__ ran")
        self.__dict__.update(state)


def test_lightning_ckpt_imports_as_written(tmp_path: Path, capsys) -> None:
    src = lightning_ckpt({"lr": 0.1, "layers": [4, 3], "name": "net"})
    path = tmp_path / "epoch=1-step=2.ckpt"
    torch.save(src, path)
    root = tmp_path / "store"
    rc, out, err = run_cli(capsys, "import", path, root, "--step", "2", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["kind"] == "lightning"
    assert "a Lightning checkpoint (Lightning 2.6.6, epoch 1, global step 2)" in res["notes"][0]
    assert run_cli(capsys, "verify", root, "--step", "2")[0] == 0
    with CheckpointManager(root) as mgr:
        assert mgr.manifest(2).metadata["lightning"] == {"global_step": 2, "epoch": 1}
        stored = mgr.load(2)
    assert_same(stored, torch.load(path, weights_only=True))

    # the state loads back into the objects that made it
    model, opt, sched = trained(seed=5)
    model.load_state_dict({k[len("model.") :]: v for k, v in stored["state_dict"].items()})
    opt.load_state_dict(stored["optimizer_states"][0])
    sched.load_state_dict(stored["lr_schedulers"][0])
    assert_same(opt.state_dict(), src["optimizer_states"][0])


def test_a_lightning_module_named_module_keeps_its_names(tmp_path: Path, capsys) -> None:
    # A LightningModule whose network is self.module saves "module.fc.weight": its own
    # names (Lightning never writes a DDP prefix). The import stripped "module." as from a
    # DDP state dict, and the module's load_state_dict of the imported state failed.
    src = lightning_ckpt({"lr": 0.1})
    src["state_dict"] = collections.OrderedDict(
        (f"module.{k[len('model.') :]}", v) for k, v in src["state_dict"].items()
    )
    path = tmp_path / "last.ckpt"
    torch.save(src, path)
    root = tmp_path / "store"
    rc, out, err = run_cli(capsys, "import", path, root, "--step", "2", "--json")
    assert rc == 0, err
    assert not any("stripped" in n for n in json.loads(out)["notes"])
    with CheckpointManager(root) as mgr:
        stored = mgr.load(2)
    assert list(stored["state_dict"]) == list(src["state_dict"])
    assert_same(stored["state_dict"], src["state_dict"])


def test_lightning_unsafe_hparams_refused_or_skipped(tmp_path: Path, capsys) -> None:
    src = lightning_ckpt({"lr": 0.1, "cfg": HParams(), "keep": [1, 2]})
    path = tmp_path / "last.ckpt"
    torch.save(src, path)
    root = tmp_path / "store"

    rc, out, err = run_cli(capsys, "import", path, root, "--step", "2")
    assert rc == 1
    assert out == ""
    assert f"GLOBAL {__name__}.HParams" in err
    assert "weights_only=True" in err
    assert "--skip-unsafe" in err
    assert err.count("\n") == 1
    assert not root.exists() or not any(root.glob("step-*"))

    rc, out, err = run_cli(capsys, "import", path, root, "--step", "2", "--skip-unsafe")
    assert rc == 0, err
    assert "note: dropped entry ['hyper_parameters']['cfg']: it needs code to load" in out
    assert f"never loaded {__name__}.HParams" in out
    assert SIDE_EFFECTS == []  # the class's code never ran
    assert run_cli(capsys, "verify", root)[0] == 0
    with CheckpointManager(root) as mgr:
        stored = mgr.load(2)
    assert stored["hyper_parameters"] == {"lr": 0.1, "keep": [1, 2]}
    del src["hyper_parameters"]["cfg"]
    assert_same(stored, src)


def test_skip_unsafe_never_loads_blocked_code(tmp_path: Path, capsys) -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"model": nn.Linear(2, 2).state_dict(), "x": Evil()}, path)
    rc, _, err = run_cli(capsys, "import", path, tmp_path / "store", "--step", "1", "--skip-unsafe")
    assert rc == 1
    assert "GLOBAL posix.system from a module that is never loaded" in err
    assert "--skip-unsafe cannot drop it" in err
    assert not (Path.cwd() / "pwned").exists()


# ---- plain torch.save ----------------------------------------------------------------------


def test_torch_save_ddp_dict_imports_exactly(tmp_path: Path, capsys) -> None:
    model, opt, sched = trained()
    src = {
        "model": {f"module.{k}": v for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": 70,
    }
    path = tmp_path / "ddp.pt"
    torch.save(src, path)
    root = tmp_path / "store"
    rc, out, err = run_cli(capsys, "import", path, root, "--step", "70")
    assert rc == 0, err
    assert "stripped 'module.' from the keys of 'model'" in out
    assert run_cli(capsys, "verify", root)[0] == 0
    fresh, fresh_opt, fresh_sched = trained(seed=9)
    state = {"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched, "step": 0}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 70
    assert_same(dict(fresh.state_dict()), dict(model.state_dict()))
    assert_same(fresh_opt.state_dict(), opt.state_dict())
    assert state["step"] == 70


def test_import_places_an_older_step_than_the_newest(tmp_path: Path, capsys) -> None:
    model, _, _ = trained()
    path = tmp_path / "m.pt"
    torch.save({"model": model.state_dict()}, path)
    root = tmp_path / "store"
    assert run_cli(capsys, "import", path, root, "--step", "90")[0] == 0
    # Saving step 50 from training would be refused (resume() forgotten); an import names
    # its step on purpose.
    rc, _, err = run_cli(capsys, "import", path, root, "--step", "50")
    assert rc == 0, err
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [50, 90]
        assert mgr.verify(50).ok


def test_torch_save_with_a_compressed_member_is_refused_uninflated(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zipfile

    model, _, _ = trained()
    path = tmp_path / "model.pt"
    torch.save({"model": model.state_dict(), "step": 3}, path)
    path.write_bytes(deflated(path.read_bytes()))  # torch.save never compresses a member

    def no_inflating(*args: Any) -> Any:
        raise AssertionError("a zip member was inflated")

    monkeypatch.setattr(zipfile, "_get_decompressor", no_inflating)
    root = tmp_path / "store"
    rc, out, err = run_cli(capsys, "import", path, root, "--step", "3")
    assert rc == 1, out
    assert f"{path}: zip member 'model/data.pkl' is compressed (deflate" in err
    assert "refused without inflating anything" in err
    assert "Traceback" not in err
    assert not root.exists() or CheckpointManager(root).steps() == []


# ---- DCP directories ---------------------------------------------------------------------


class Opaque:
    """A non-tensor DCP item that only pickle can load."""

    def __init__(self) -> None:
        self.v = 1


def save_dcp(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def dcp_source() -> tuple[dict[str, Any], Net, torch.optim.Optimizer]:
    model, opt, _ = trained()
    state = {
        # a DDP-wrapped model's state dict, as saved from the wrapper
        "model": {f"module.{k}": v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "step": 7,
        "extra": {"name": "run1", "losses": [0.5, float("inf")], "empty": torch.empty(0, 3)},
    }
    return state, model, opt


def test_dcp_directory_imports_exactly(tmp_path: Path, capsys) -> None:
    src, model, opt = dcp_source()
    ckpt = tmp_path / "dcp"
    save_dcp(src, ckpt)
    root = tmp_path / "store"
    rc, out, err = run_cli(capsys, "import", ckpt, root, "--step", "7")
    assert rc == 0, err
    assert "note: a torch.distributed.checkpoint directory" in out
    assert "stripped 'module.' from the keys of 'model'" in out
    assert "['optimizer']['state']: keys made ints again" in out
    assert run_cli(capsys, "verify", root, "--step", "7")[0] == 0

    with CheckpointManager(root) as mgr:
        stored = mgr.load(7)
    assert_same(stored["model"], {k: v for k, v in model.state_dict().items()})
    assert stored["model"]["bf16"].dtype == torch.bfloat16
    assert_same(stored["optimizer"], opt.state_dict())
    assert stored["step"] == 7
    assert_same(
        stored["extra"], {"name": "run1", "losses": [0.5, float("inf")], "empty": torch.empty(0, 3)}
    )

    # and it restores into live objects
    fresh, fresh_opt, _ = trained(seed=3)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": fresh, "optimizer": fresh_opt}, strict=False)
    assert_same(dict(fresh.state_dict()), dict(model.state_dict()))
    assert_same(fresh_opt.state_dict(), opt.state_dict())


def test_dcp_corrupt_or_hostile_is_refused(tmp_path: Path, capsys) -> None:
    src, _, _ = dcp_source()
    root = tmp_path / "store"

    bad = tmp_path / "flipped"
    save_dcp(src, bad)
    (data,) = bad.glob("*.distcp")
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    rc, _, err = run_cli(capsys, "import", bad, root, "--step", "1")
    assert rc == 1
    assert "CRC-32 mismatch" in err or "not a valid torch.save item" in err

    cut = tmp_path / "cut"
    save_dcp(src, cut)
    (data,) = cut.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:-100])
    rc, _, err = run_cli(capsys, "import", cut, root, "--step", "1")
    assert rc == 1
    assert "beyond the file" in err

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch pwned",))

    hostile = tmp_path / "hostile"
    save_dcp(src, hostile)
    (hostile / ".metadata").write_bytes(pickle.dumps(Boom()))
    rc, _, err = run_cli(capsys, "import", hostile, root, "--step", "1")
    assert rc == 1
    assert "GLOBAL posix.system is not part of DCP metadata" in err or "os.system" in err
    assert not (Path.cwd() / "pwned").exists()

    # A FIFO where a data file or .metadata lies: refused at once (the open hung for good).
    for victim, said in (
        ("*.distcp", "{}: not a regular file"),
        (".metadata", "{}: a directory without .metadata is not a torch.distributed"),
    ):
        piped = tmp_path / f"fifo{len(victim)}"
        save_dcp(src, piped)
        (data,) = piped.glob(victim)
        data.unlink()
        os.mkfifo(data)
        for flag in ([], ["--sharded"]):
            rc, _, err = run_cli(capsys, "import", piped, root, "--step", "1", *flag)
            assert rc == 1
            assert said.format(data if victim != ".metadata" else piped) in err, err

    rc, _, err = run_cli(capsys, "import", tmp_path, root, "--step", "1")
    assert rc == 1
    assert "not a torch.distributed.checkpoint checkpoint" in err
    assert not root.exists() or not any(root.glob("step-*"))


def test_a_source_that_expands_far_past_its_size_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: 1.8 KB of nested shared lists (``l = [l, l]``, 2**40 visits to
    walk) ran an import out of time and memory; one float viewed with stride 0 as 2**28
    was written as a 1 GiB step from 1.4 KB. Refused, bounded, naming the file."""
    root = tmp_path / "store"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": {"w": torch.arange(3.0)}})
    nested: list[Any] = []
    for _ in range(40):
        nested = [nested, nested]
    dag = tmp_path / "dag.pt"
    torch.save({"w": torch.ones(2), "l": nested}, dag)
    wide = tmp_path / "wide.pt"
    torch.save({"w": torch.ones(1).expand(1 << 27)}, wide)
    assert dag.stat().st_size < 4096
    assert wide.stat().st_size < 4096
    for src, said in (
        (dag, "its objects expand to more than 1000000 values"),
        (wide, "its tensors expand to more than 268435456 bytes"),
    ):
        for flags in ([], ["--skip-unsafe"]):
            rc, out, err = run_cli(capsys, "import", src, root, "--step", "2", *flags)
            assert (rc, out) == (1, ""), err
            assert err.startswith(f"ckptstore: error: {src}: {said}"), err
    with CheckpointManager(root) as mgr:  # nothing committed; the step before still loads
        assert mgr.steps() == [1]
        assert torch.equal(mgr.load(1)["model"]["w"], torch.arange(3.0))


def _forged(tmp_path: Path, name: str, edit: Any) -> Path:
    """A real DCP directory whose ``.metadata`` was re-pickled after ``edit`` (DCP's own
    classes only: the restricted unpickler admits it)."""
    path = tmp_path / name
    save_dcp({"w": torch.ones(4), "extra": [5]}, path)
    md = pickle.loads((path / ".metadata").read_bytes())
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    return path


@pytest.mark.parametrize("sharded", [False, True])
def test_a_forged_dcp_layout_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sharded: bool
) -> None:
    """Found by review: a tensor declared larger than its one chunk imported exit 0 with
    heap garbage in the rest of it (saved, and verified, as the step's values); declared at
    10**8 elements, 400 MB from a 3 KB directory; a planner_data list index of 10**12
    appended Nones until memory ran out."""
    root = tmp_path / "store"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": {"w": torch.arange(3.0)}})

    def grow(n: int) -> Any:
        def edit(md: Any) -> None:
            md.state_dict_metadata["w"].size = torch.Size([n])

        return edit

    def far(md: Any) -> None:
        md.planner_data["extra"] = ("extra", 10**12)

    flag = ["--sharded"] if sharded else []
    cases = [
        (_forged(tmp_path, "gap", grow(8)), "its chunks do not cover the [8] tensor exactly"),
        (_forged(tmp_path, "huge", grow(10**8)), "declares 400000000 bytes ([100000000])"),
        (_forged(tmp_path, "far", far), "1000000000000 is not a key, nor a list index below"),
    ]
    for src, said in cases:
        rc, out, err = run_cli(capsys, "import", src, root, "--step", "2", *flag)
        assert (rc, out) == (1, ""), err
        assert f"{src / '.metadata'}" in err, err
        assert said in err, err
    with CheckpointManager(root) as mgr:  # nothing committed; the step before still loads
        assert mgr.steps() == [1]
        assert torch.equal(mgr.load(1)["model"]["w"], torch.arange(3.0))


def test_a_load_that_fails_inside_dcp_or_torch_load_is_one_line(tmp_path: Path, capsys) -> None:
    # DCP wraps a failed read in CheckpointException, a BaseException that `except
    # Exception` let through, and a .pt whose pickle is cut short (its zip's CRCs intact)
    # failed in the unpickler with an IndexError: both printed a Python traceback.
    import io

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    root = tmp_path / "store"
    bad = tmp_path / "dcp"
    save_dcp({"w": torch.ones(2), "n": 1}, bad)
    md = FileSystemReader(str(bad)).read_metadata()
    (index,) = [i for i in md.storage_data if i.fqn == "w"]
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save(torch.ones(1), buf)  # a valid item, shorter than the metadata says
    data = bad / info.relative_path
    end = data.stat().st_size
    data.write_bytes(data.read_bytes() + buf.getvalue())
    md.storage_data[index] = type(info)(info.relative_path, end, len(buf.getvalue()))
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(md, f)
    rc, out, err = run_cli(capsys, "import", bad, root, "--step", "1")
    assert rc == 1
    assert "reading the DCP checkpoint failed (CheckpointException" in err
    assert "Traceback" not in out + err

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(3), "n": 5}, src)
    import zipfile

    cut = tmp_path / "cut.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(cut, "w") as zout:
        for item in zin.infolist():
            blob = zin.read(item.filename)
            if item.filename.endswith("data.pkl"):
                blob = blob[: len(blob) // 2]
            zout.writestr(item, blob)
    rc, out, err = run_cli(capsys, "import", cut, root, "--step", "1")
    assert rc == 1
    assert "cut.pt: torch.load failed (" in err
    assert "Traceback" not in out + err
    assert not root.exists() or not any(root.glob("step-*"))


def test_an_entry_the_store_cannot_hold_without_pickle_is_named(tmp_path: Path, capsys) -> None:
    # torch.load(weights_only=True) reads a set; the store holds one only with pickle. The
    # import passed on mgr.save's "pass allow_pickle=True", an option it does not have.
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2), "seen": {1, 2}}, src)
    root = tmp_path / "store"
    for extra in ([], ["--skip-unsafe"]):
        rc, out, err = run_cli(capsys, "import", src, root, "--step", "1", *extra)
        assert rc == 1
        assert f"{src}: state['seen']: objects of type builtins.set load" in err
        assert "an import stores no pickles" in err
        assert "allow_pickle" not in err
        assert "Traceback" not in out + err
    assert not any(root.glob("step-*"))


@pytest.mark.parametrize("via", ["pt", "dcp"])
def test_an_ema_exported_and_imported_restores_its_averages(
    tmp_path: Path, capsys, via: str
) -> None:
    """``export OUT.pt`` (or ``--dcp``) then ``import`` kept the EMA's {"weights",
    "counters"} but not its kind: restoring the imported step rebuilt the EMA from the
    model (n_averaged 5 -> 1, the averages gone) with only a warning."""
    from torch.optim.swa_utils import AveragedModel

    from ckptstore import EMA

    model, _, _ = trained()
    ema = AveragedModel(model)
    for _ in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        ema.update_parameters(model)
    root = tmp_path / "store"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "ema": EMA(ema, source=model)})
    out = tmp_path / ("full.pt" if via == "pt" else "dcp")
    rc, _, err = run_cli(
        capsys, "export", root, "--step", "1", *([out] if via == "pt" else ["--dcp", out])
    )
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "import", out, root, "--step", "2")
    assert rc == 0, err
    model2 = Net()
    ema2 = AveragedModel(model2)
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"model": model2, "ema": EMA(ema2, source=model2)}, step=2) == 2
    assert int(ema2.n_averaged) == 5
    for name, t in ema.module.state_dict().items():
        assert torch.equal(ema2.module.state_dict()[name], t), name
    # Exported to .safetensors, the imported step's EMA gives its averaged weights under the
    # same names as the step saved with its kind (the file held "weights.*" and
    # "counters.*" names: a file no model loads).
    from safetensors.torch import load_file

    files = {}
    for step in (1, 2):
        files[step] = tmp_path / f"ema{step}.safetensors"
        args = ("export", root, "--step", str(step), "--key", "ema", files[step])
        rc, _, err = run_cli(capsys, *args)
        assert rc == 0, err
    direct, imported = load_file(files[1]), load_file(files[2])
    assert sorted(imported) == sorted(direct) == sorted(ema.module.state_dict())
    for name, t in direct.items():
        assert torch.equal(imported[name], t), name


def test_an_entry_held_as_self_module_round_trips_through_export_and_import(
    tmp_path: Path, capsys
) -> None:
    """A wrapper holding its network as ``self.module`` (timm's ModelEmaV2) saves
    ``module.weight``; the import strips ``module.`` as from a DDP model. The imported
    step restores into the wrapper all the same (it raised StateMismatchError)."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(4, 2)

    saved = Wrapper()
    root = tmp_path / "store"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"ema": saved})
    rc, _, err = run_cli(capsys, "export", root, "--step", "1", tmp_path / "full.pt")
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "import", tmp_path / "full.pt", root, "--step", "2")
    assert rc == 0, err
    assert "stripped 'module.' from the keys of 'ema'" in out + err
    target = Wrapper()
    with CheckpointManager(root) as mgr:
        assert list(mgr.load(2)["ema"]) == ["weight", "bias"]
        assert mgr.restore({"ema": target}, step=2) == 2
    assert torch.equal(target.module.weight, saved.module.weight)
    assert torch.equal(target.module.bias, saved.module.bias)


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested"])
def test_a_tensor_no_format_stores_is_refused_in_one_line(
    tmp_path: Path, capsys, kind: str
) -> None:
    # Its work bound asked for data_ptr() and strides, which these raise: a RuntimeError
    # traceback out of the CLI, a bare RuntimeError out of the API.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors: a prototype
        t = {
            "sparse_coo": lambda: torch.eye(4).to_sparse(),
            "sparse_csr": lambda: torch.eye(4).to_sparse_csr(),
            "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        }[kind]()
    src = tmp_path / "src.pt"
    torch.save({"model": {"emb": t}}, src)
    root = tmp_path / "new" / "store"
    rc, out, err = run_cli(capsys, "import", src, root, "--step", "1")
    assert rc == 1
    assert "Traceback" not in out + err
    what = "nested tensors" if kind == "nested" else f"torch.{kind} tensors"
    assert f"{src}: state['model']['emb']: {what} cannot be stored" in err
    # Refused before the store was made: a refused import into a new root left its
    # directories and .ckptstore.lock behind.
    assert not (tmp_path / "new").exists()


def test_a_refused_import_into_a_new_root_leaves_nothing(tmp_path: Path, capsys) -> None:
    src = tmp_path / "c128.pt"
    torch.save({"w": torch.ones(3, dtype=torch.complex128)}, src)
    root = tmp_path / "runs" / "new" / "ckpt"
    rc, _, err = run_cli(capsys, "import", src, root, "--step", "1")
    assert rc == 1
    assert "complex128" in err
    assert not (tmp_path / "runs").exists()


def test_dcp_unsafe_item_refused_or_skipped(tmp_path: Path, capsys) -> None:
    src, model, _ = dcp_source()
    src["extra"]["obj"] = Opaque()
    ckpt = tmp_path / "dcp"
    save_dcp(src, ckpt)
    root = tmp_path / "store"
    rc, _, err = run_cli(capsys, "import", ckpt, root, "--step", "1")
    assert rc == 1
    assert "'extra.obj'" in err
    assert "--skip-unsafe" in err

    rc, out, err = run_cli(capsys, "import", ckpt, root, "--step", "1", "--skip-unsafe")
    assert rc == 0, err
    assert "dropped entry ['extra']['obj']" in out
    with CheckpointManager(root) as mgr:
        stored = mgr.load(1)
    assert "obj" not in stored["extra"]
    assert_same(stored["model"], {k: v for k, v in model.state_dict().items()})

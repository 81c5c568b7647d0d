"""Modules: wrappers removed on save and on load, EMA kinds, RNG state.

DDP runs in a one-rank gloo group created in this process. ``torch.compile`` objects are
created but never called: an ``OptimizedModule``'s state dict carries ``_orig_mod.`` without
a forward pass, and compiling one costs tens of seconds.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _helpers import assert_same, module_bytes, step_dir
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ckptstore import EMA, CheckpointManager, RNGState, StateMismatchError
from ckptstore.state.modules import de_parallel, module_state

pytestmark = pytest.mark.timeout(60)  # DDP runs in a (one-rank) process group


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo group, so DistributedDataParallel can be constructed."""
    if dist.is_initialized():  # pragma: no cover - another module left one behind
        yield
        return
    init = tmp_path_factory.mktemp("pg") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.backbone = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.norm.running_mean.copy_(torch.randn(6, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.backbone(x)))


PLAIN_KEYS = list(Net().state_dict())

WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,
    "dp": nn.DataParallel,
    "ddp": DDP,
    "compiled": torch.compile,
    "compiled(ddp)": lambda m: torch.compile(DDP(m)),
    "ddp(compiled)": lambda m: DDP(torch.compile(m)),
}


def wrap(kind: str, m: nn.Module) -> nn.Module:
    return WRAPPERS[kind](m)


def weights(m: nn.Module) -> dict[str, torch.Tensor]:
    """The de-parallelized weights, keyed as in a plain model."""
    return module_bytes(de_parallel(m))


def stored_keys(root: Path, step: int, group: str) -> list[str]:
    """Keys in the payload file and names in state.json, read below ckptstore."""
    d = root / step_dir(step)
    keys = list(safetensors.torch.load_file(d / f"{group}.safetensors"))
    keys += json.dumps(json.loads((d / "state.json").read_text())).split('"')
    return keys


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_de_parallel(kind: str) -> None:
    m = Net()
    assert de_parallel(wrap(kind, m)) is m


def test_wrapped_state_dicts_carry_prefixes() -> None:
    # What the stripping is for: each wrapper prefixes its keys.
    m = Net()
    assert next(iter(DDP(m).state_dict())).startswith("module.")
    assert next(iter(torch.compile(m).state_dict())).startswith("_orig_mod.")
    assert next(iter(torch.compile(DDP(m)).state_dict())).startswith("_orig_mod.module.")
    assert next(iter(DDP(torch.compile(m)).state_dict())).startswith("module._orig_mod.")


@pytest.mark.parametrize("saved_as", list(WRAPPERS))
def test_stored_keys_are_de_parallelized(tmp_path: Path, saved_as: str) -> None:
    src = Net(1)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": wrap(saved_as, src)})
        loaded = mgr.load()["model"]
    assert list(loaded) == PLAIN_KEYS
    for k in stored_keys(tmp_path / "s", 1, "model"):
        assert "module." not in k
        assert "_orig_mod" not in k
    assert_same(dict(loaded), weights(src))


@pytest.mark.parametrize("into", list(WRAPPERS))
@pytest.mark.parametrize("saved_as", ["plain", "compiled(ddp)", "ddp(compiled)"])
def test_restore_across_wrappers(tmp_path: Path, saved_as: str, into: str) -> None:
    src = Net(1)
    target = wrap(into, Net(2))
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": wrap(saved_as, src)})
        assert mgr.restore({"model": target}) == 1
    assert_same(weights(target), weights(src))


@pytest.mark.parametrize("old", ["ddp", "compiled", "compiled(ddp)", "ddp(compiled)"])
@pytest.mark.parametrize("into", ["plain", "ddp", "compiled"])
def test_old_checkpoints_with_prefixed_keys_load(tmp_path: Path, old: str, into: str) -> None:
    src = Net(1)
    prefixed = wrap(old, src).state_dict()  # stored as plain data, prefixes and all
    assert all(k.startswith(("module.", "_orig_mod.")) for k in prefixed)
    target = wrap(into, Net(2))
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": prefixed})
        assert mgr.restore({"model": target}) == 1
    assert_same(weights(target), weights(src))


def test_compiled_submodule(tmp_path: Path) -> None:
    src = Net(1)
    src.backbone = torch.compile(src.backbone)  # type: ignore[assignment]
    assert "backbone._orig_mod.weight" in src.state_dict()
    assert list(module_state(src)) == PLAIN_KEYS
    plain, partly = Net(2), Net(3)
    partly.backbone = torch.compile(partly.backbone)  # type: ignore[assignment]
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": src})
        assert list(mgr.load()["model"]) == PLAIN_KEYS
        mgr.restore({"model": plain})
        mgr.restore({"model": partly})
        # An old checkpoint that kept the inner prefix also loads into a plain model.
        mgr.save(2, {"model": src.state_dict()})
        plain2 = Net(4)
        mgr.restore({"model": plain2}, step=2)
    expected = module_bytes(Net(1))
    assert_same(module_bytes(plain), expected)
    assert_same(module_state(partly), module_state(plain))
    assert_same(module_bytes(plain2), expected)


def test_ddp_state_dict_is_never_called(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Going through the wrapper can run collectives on one rank only: the seeds' deadlock.
    def forbidden(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("DDP.state_dict / load_state_dict called")

    src = DDP(Net(1))
    ema = AveragedModel(Net(1), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    monkeypatch.setattr(DDP, "state_dict", forbidden)
    monkeypatch.setattr(DDP, "load_state_dict", forbidden)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": src, "ema": EMA(DDP(ema), source=src)})
        target = DDP(Net(2))
        ema2 = AveragedModel(Net(3))
        mgr.restore({"model": target, "ema": EMA(ema2, source=target, rebuild=True)})
    assert_same(weights(target), weights(src))
    assert_same(module_bytes(ema2.module), weights(src))


# ---- mismatches -------------------------------------------------------------------------


class Wider(Net):
    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.head = nn.Linear(6, 3)


class Extra(Net):
    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.extra = nn.Linear(2, 2)


def test_mismatch_lists_everything_and_loads_nothing(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": Extra(1), "other": Net(1)})
        # The second module fits; the first has a shape, a dtype and a key problem.
        target = Wider(2)
        target.backbone.double()
        other = Net(2)
        before, before_other = module_bytes(target), module_bytes(other)
        with pytest.raises(StateMismatchError) as ei:
            mgr.restore({"other": other, "model": DDP(target)})
        e = ei.value
        assert e.unexpected == ["extra.weight", "extra.bias"]
        assert e.missing == []
        assert sorted(e.mismatched) == [
            "backbone.bias: checkpoint torch.float32, model torch.float64",
            "backbone.weight: checkpoint torch.float32, model torch.float64",
            "head.bias: checkpoint (2,), model (3,)",
            "head.weight: checkpoint (2, 6), model (3, 6)",
        ]
        msg = str(e)
        assert "extra.weight" in msg
        assert "head.weight: checkpoint (2, 6), model (3, 6)" in msg
        # strict=False skips keys, never other shapes or dtypes: not offered as the way out.
        assert "strict=False skips missing and unexpected keys, never a shape" in msg
        assert "or restore with strict=False" not in msg
        assert_same(module_bytes(target), before)
        assert_same(module_bytes(other), before_other)

        # Missing keys the other way round; strict=False loads what fits.
        with pytest.raises(StateMismatchError) as ei2:
            mgr.restore({"other": Extra(5)})
        assert ei2.value.missing == ["extra.weight", "extra.bias"]
        assert "missing keys (2): extra.weight, extra.bias" in str(ei2.value)
        assert "or restore with strict=False to skip the missing" in str(ei2.value)
        small = Net(5)
        with pytest.raises(StateMismatchError):
            mgr.restore({"model": small})  # unexpected extra.*
        mgr.restore({"model": small}, strict=False)
        assert_same(module_bytes(small), module_bytes(Net(1)))
        with pytest.raises(StateMismatchError, match=r"head\.weight"):
            mgr.restore({"model": Wider(5)}, strict=False)  # shapes refuse even then


def test_missing_entry_in_checkpoint(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": Net(1)})
        target, opt_model = Net(2), Net(3)
        opt = torch.optim.SGD(opt_model.parameters(), lr=0.1)
        before = module_bytes(target)
        with pytest.raises(StateMismatchError, match="'optimizer'") as ei:
            mgr.restore({"model": target, "optimizer": opt})
        assert ei.value.missing == ["optimizer"]
        assert_same(module_bytes(target), before)
        assert mgr.restore({"model": target, "optimizer": opt}, strict=False) == 1
        assert_same(module_bytes(target), module_bytes(Net(1)))


# ---- EMA ------------------------------------------------------------------------------


class ModelEmaV2(nn.Module):
    """timm's ModelEmaV2, in miniature: the averaged copy is ``.module``."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        for e, m in zip(
            self.module.state_dict().values(), model.state_dict().values(), strict=True
        ):
            if e.dtype.is_floating_point:
                e.mul_(self.decay).add_(m, alpha=1 - self.decay)


def perturb(m: nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(by)


def make_ema(kind: str, model: nn.Module) -> tuple[Any, nn.Module]:
    """An EMA object of ``kind`` averaging ``model``, and the module holding its weights."""
    if kind == "averaged":
        avg = AveragedModel(de_parallel(model), multi_avg_fn=get_ema_multi_avg_fn(0.9))
        return avg, avg.module
    if kind == "timm":
        t = ModelEmaV2(de_parallel(model))
        return t, t.module
    plain = copy.deepcopy(de_parallel(model))
    return plain, plain


def update(kind: str, ema: Any, model: nn.Module) -> None:
    if kind == "averaged":
        ema.update_parameters(model)
    elif kind == "timm":
        ema.update(model)
    else:
        with torch.no_grad():
            for e, m in zip(ema.parameters(), model.parameters(), strict=True):
                e.mul_(0.9).add_(m, alpha=0.1)


EMA_KINDS = ["averaged", "timm", "plain"]


@pytest.mark.parametrize("kind", EMA_KINDS)
def test_ema_is_saved_and_restored(tmp_path: Path, kind: str) -> None:
    model = Net(1)
    ema, ema_mod = make_ema(kind, model)
    for i in range(3):
        perturb(model, 0.5 + i)
        update(kind, ema, model)
    saved_ema = module_bytes(ema_mod)
    saved_model = module_bytes(model)
    assert not torch.equal(saved_ema["head.weight"], saved_model["head.weight"])

    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": DDP(model), "ema": EMA(ema, source=model)})
        model2 = DDP(Net(2))
        ema2, ema_mod2 = make_ema(kind, Net(3))
        if kind == "timm":
            ema2.decay, ema2.updates = 0.5, 0
        mgr.restore({"model": model2, "ema": EMA(ema2, source=model2)})

    assert_same(module_bytes(ema_mod2), saved_ema)  # the EMA's weights, not the model's
    assert_same(weights(model2), saved_model)
    if kind == "averaged":
        assert int(ema2.n_averaged) == 3
    if kind == "timm":
        assert (ema2.decay, ema2.updates) == (0.9, 3)


@pytest.mark.parametrize("kind", EMA_KINDS)
@pytest.mark.parametrize("why", ["absent", "rebuild"])
def test_ema_is_rebuilt_from_the_restored_model(tmp_path: Path, kind: str, why: str) -> None:
    model = Net(1)
    ema, _ = make_ema(kind, model)
    perturb(model, 1.0)
    update(kind, ema, model)
    state: dict[str, Any] = {"model": model}
    if why == "rebuild":
        state["ema"] = EMA(ema, source=model)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, state)
        model2 = torch.compile(DDP(Net(2)))
        ema2, ema_mod2 = make_ema(kind, Net(3))
        target = {"model": model2, "ema": EMA(ema2, source=model2, rebuild=why == "rebuild")}
        mgr.restore(target)
    assert_same(module_bytes(ema_mod2), module_bytes(model))
    assert_same(weights(model2), module_bytes(model))
    if kind == "averaged":
        assert int(ema2.n_averaged) == 1, "averaging continues from the restored model"


def test_ema_without_source_cannot_be_rebuilt(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": Net(1)})
        with pytest.raises(StateMismatchError, match="source"):
            mgr.restore({"model": Net(2), "ema": EMA(Net(3))})


def test_ema_mismatch_loads_nothing(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": Net(1), "ema": EMA(Net(1))})
        target, wrong_ema = Net(2), Wider(3)
        before, before_ema = module_bytes(target), module_bytes(wrong_ema)
        with pytest.raises(StateMismatchError, match=r"head\.weight"):
            mgr.restore({"model": target, "ema": EMA(wrong_ema, source=target)})
        assert_same(module_bytes(target), before)
        assert_same(module_bytes(wrong_ema), before_ema)


def test_ema_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match="module"):
        EMA(object())


# ---- RNG ------------------------------------------------------------------------------


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_continues_identically(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"rng": RNGState()})
        expected = [draws() for _ in range(3)]
        random.seed(10)
        np.random.seed(20)
        torch.manual_seed(30)
        assert [draws() for _ in range(3)] != expected
        assert mgr.restore({"rng": RNGState()}) == 1
        assert [draws() for _ in range(3)] == expected
        raw = mgr.load()["rng"]
    assert set(raw) >= {"python", "numpy", "torch"}
    assert isinstance(raw["python"], tuple)
    assert raw["torch"].dtype == torch.uint8


@pytest.mark.parametrize("saved", ["averaged_model", "averaged_module"])
def test_ema_saved_as_a_plain_module_is_restored_not_rebuilt(tmp_path: Path, saved: str) -> None:
    model = Net(1)
    ema, ema_mod = make_ema("averaged", model)
    for i in range(3):
        perturb(model, 0.5 + i)
        update("averaged", ema, model)
    saved_ema = module_bytes(ema_mod)
    with CheckpointManager(tmp_path / "s") as mgr:
        # {"ema": averaged_model}: no EMA marker, so it is stored as a plain module.
        mgr.save(1, {"model": model, "ema": ema if saved == "averaged_model" else ema_mod})
        model2 = DDP(Net(2))
        ema2, ema_mod2 = make_ema("averaged", Net(3))
        mgr.restore({"model": model2, "ema": EMA(ema2, source=model2)})
    assert_same(module_bytes(ema_mod2), saved_ema)  # the stored averages, not the model
    # The counter comes back with the AveragedModel; with the bare module it is at least 1,
    # so the next update averages instead of copying the model over the restored weights.
    assert int(ema2.n_averaged) == (3 if saved == "averaged_model" else 1)


def _averaged(model: nn.Module) -> AveragedModel:
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))


def _averaged_bytes(avg: AveragedModel) -> dict[str, torch.Tensor]:
    return module_bytes(de_parallel(avg.module))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
@pytest.mark.parametrize(
    ("saved_ddp", "target_ddp"), [(False, True), (True, False), (True, True)], ids=str
)
def test_a_plain_averaged_model_of_a_ddp_model_restores_either_way(
    tmp_path: Path, saved_ddp: bool, target_ddp: bool, strict: bool
) -> None:
    """``{"ema": AveragedModel(ddp_model)}`` (a DDP script's EMA, saved without ``EMA``)
    stores ``module.module.*`` keys; one averaging a plain model ``module.*``. Each restores
    into the other with its stored averages and ``n_averaged``: the wrapper inside the
    averaged model was taken for a different model (a StateMismatchError, and with the
    strict=False it advised, the counter restored and none of the averages)."""
    model = Net(1)
    wrapped: nn.Module = DDP(model) if saved_ddp else model
    ema = _averaged(wrapped)
    for i in range(3):
        perturb(model, 0.5 + i)
        ema.update_parameters(wrapped)
    saved = _averaged_bytes(ema)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": wrapped, "ema": ema})
        keys = set(mgr.load()["ema"])
        assert ("module.module.head.weight" in keys) == saved_ddp
        model2 = Net(2)
        target: nn.Module = DDP(model2) if target_ddp else model2
        ema2 = _averaged(target)
        assert not torch.equal(_averaged_bytes(ema2)["head.weight"], saved["head.weight"])
        assert mgr.restore({"model": target, "ema": EMA(ema2, source=target)}, strict=strict) == 1
    assert_same(_averaged_bytes(ema2), saved)  # the stored averages, not the model's weights
    assert int(ema2.n_averaged) == 3


def test_a_plain_ema_whose_counter_does_not_fit_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    model = Net(1)
    ema = _averaged(model)
    ema.update_parameters(model)
    stored = dict(ema.state_dict())
    stored["n_averaged"] = torch.tensor([3, 4])
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "ema": stored})
        model2, ema2 = Net(2), _averaged(Net(3))
        before, before_ema = module_bytes(model2), _averaged_bytes(ema2)
        with pytest.raises(StateMismatchError, match=r"EMA counters do not fit: n_averaged"):
            mgr.restore({"model": model2, "ema": EMA(ema2, source=model2)})
    assert_same(module_bytes(model2), before)
    assert_same(_averaged_bytes(ema2), before_ema)
    assert int(ema2.n_averaged) == 0


def test_an_ema_is_not_rebuilt_from_a_source_this_restore_does_not_restore(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint without an EMA rebuilds it from the restored model; from a model the
    restore did not touch (an evaluation script asking for the EMA alone) it copied
    untrained weights and returned the step. Refused now, before anything changes;
    strict=False leaves the EMA as it was; ``rebuild=True`` still copies the source."""
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": Net(1)})
        model, ema = Net(2), _averaged(Net(3))
        before = _averaged_bytes(ema)
        with pytest.raises(StateMismatchError, match="source model is not restored by this call"):
            mgr.restore({"ema": EMA(ema, source=model)})
        assert_same(_averaged_bytes(ema), before)
        with pytest.raises(StateMismatchError, match="no source model to rebuild from"):
            mgr.restore({"model": Net(4), "ema": EMA(_averaged(Net(3)))})
        with caplog.at_level("WARNING", logger="ckptstore"):
            assert mgr.restore({"ema": EMA(ema, source=model)}, strict=False) == 1
        assert "leaves the EMA as it is" in caplog.text
        assert_same(_averaged_bytes(ema), before)
        assert int(ema.n_averaged) == 0
        # A submodule of a restored model is restored too: the EMA of the backbone alone.
        whole, ema_b = Net(5), _averaged(nn.Linear(4, 6))
        mgr.restore({"model": whole, "ema": EMA(ema_b, source=whole.backbone)})
        assert_same(_averaged_bytes(ema_b), module_bytes(Net(1).backbone))
        mgr.restore({"ema": EMA(ema, source=model, rebuild=True)})
    assert_same(_averaged_bytes(ema), module_bytes(model))


def test_rng_derive_is_deterministic_and_distinct_per_rank() -> None:
    torch.manual_seed(5)
    saved = RNGState().state_dict()
    a, b = RNGState.derive(saved, 2), RNGState.derive(saved, 2)
    assert_same(a, b)
    assert set(a) == set(saved)
    other = RNGState.derive(saved, 3)
    assert not torch.equal(a["torch"], other["torch"])
    assert a["python"] != other["python"]
    assert not torch.equal(a["torch"], saved["torch"])
    RNGState().load_state_dict(a)
    first = torch.rand(2)
    RNGState().load_state_dict(b)
    assert torch.equal(torch.rand(2), first)


def test_a_save_and_restore_import_no_compiler_or_dtensor_where_none_can_exist(
    tmp_path: Path,
) -> None:
    """A process that never compiled a module nor made a DTensor (an eval script, a tool,
    a restore before the optimizer exists) saves and restores without importing
    ``torch._dynamo`` or ``torch.distributed.tensor``: importing them to ask "is this a
    compiled module / a DTensor?" made such a process's first save take ~1 s, not ms."""
    from _helpers import run_python

    code = r"""
import sys, torch
from ckptstore import CheckpointManager
from ckptstore.state.modules import de_parallel
m = torch.nn.Linear(4, 3)
with CheckpointManager(sys.argv[1]) as mgr:
    mgr.save(1, {"model": m, "extra": {"w": torch.ones(2)}})
    fresh = torch.nn.Linear(4, 3)
    assert mgr.restore({"model": fresh}) == 1
    assert torch.equal(fresh.weight, m.weight)
    assert de_parallel(m) is m
heavy = [k for k in ("torch._dynamo", "torch.distributed.tensor") if k in sys.modules]
print("heavy:", heavy)
"""
    r = run_python(code, str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    assert "heavy: []" in r.stdout


def test_an_ema_rebuilt_from_an_fsdp2_source_into_a_whole_copy_is_refused_first(
    mesh: object, tmp_path: Path
) -> None:
    # The checkpoint holds no EMA (the first resume after adding one): it is rebuilt from
    # its source. An FSDP2 source's state_dict() holds DTensors and a plain EMA copy whole
    # tensors: torch raised "got mixed torch.Tensor and DTensor" from inside the restore,
    # after the model had been overwritten with the step's values.
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    ema_copy = AveragedModel(copy.deepcopy(model), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    fully_shard(model, mesh=mesh)
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # trained on: the step's values differ from the model's
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    refused = r"the source model's '0\.weight' \(and 3"
    with CheckpointManager(root) as mgr, pytest.raises(StateMismatchError, match=refused):
        mgr.restore({"model": model, "ema": EMA(ema_copy, source=model)})
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)

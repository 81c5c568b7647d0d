"""state: what is captured of each kind of object, and how restored data is applied."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import TinyNet, assert_same, module_bytes
from torch import nn

from ckptstore import EMA, CheckpointManager, RNGState, StateMismatchError
from ckptstore.state.capture import apply_state, capture, kind_of


class Counter:
    """A Stateful that is not a module: tensors and plain data."""

    def __init__(self) -> None:
        self.n = 0
        self.hist = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "hist": self.hist.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if set(sd) != {"n", "hist"}:
            raise KeyError(f"bad keys {sorted(sd)}")
        self.n = sd["n"]
        self.hist = sd["hist"]


def test_kind_of() -> None:
    m = TinyNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert kind_of(m) == "module"
    assert kind_of(EMA(m)) == "ema"
    assert kind_of(RNGState()) == "rng"
    assert kind_of(opt) == "stateful"
    assert kind_of(Counter()) == "stateful"
    for plain in (1, "x", {"a": 1}, [1], torch.zeros(1), None):
        assert kind_of(plain) is None


def test_capture() -> None:
    m = TinyNet()
    assert list(capture(m)) == list(m.state_dict())
    assert capture(Counter())["n"] == 0
    data = {"a": 1}
    assert capture(data) is data


def test_apply_replaces_plain_values_and_loads_objects() -> None:
    m, c = TinyNet(), Counter()
    src = TinyNet()
    state: dict[str, Any] = {"model": m, "counter": c, "step": 0, "cfg": None}
    stored = {
        "model": src.state_dict(),
        "counter": {"n": 5, "hist": torch.ones(3)},
        "step": 42,
        "cfg": {"lr": 0.1},
        "unused": 1,
    }
    kinds = {"model": "module", "counter": "stateful", "step": None, "cfg": None}
    apply_state(state, stored, kinds)
    assert state["model"] is m
    assert state["counter"] is c
    assert (state["step"], state["cfg"], c.n) == (42, {"lr": 0.1}, 5)
    assert "unused" not in state
    assert_same(module_bytes(m), module_bytes(src))


def test_apply_missing_entry() -> None:
    state: dict[str, Any] = {"a": 1, "b": 2}
    with pytest.raises(StateMismatchError, match="'b'") as ei:
        apply_state(state, {"a": 10}, {}, where="ckpt")
    assert ei.value.missing == ["b"]
    assert "strict=False" in str(ei.value)
    assert state == {"a": 1, "b": 2}
    apply_state(state, {"a": 10}, {}, strict=False)
    assert state == {"a": 10, "b": 2}


def test_a_lenient_restore_that_finds_no_entry_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """strict=False skips what the checkpoint lacks; when that is every entry (a typo in a
    key), the restore returns a step and restored nothing: a warning names both sides."""
    src, fresh = TinyNet(), TinyNet()
    before = module_bytes(fresh)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"model": src, "step": 3})
        with caplog.at_level(logging.WARNING, "ckptstore"):
            assert mgr.restore({"modle": fresh}, strict=False) == 3
        assert_same(module_bytes(fresh), before)
        said = [r.getMessage() for r in caplog.records if "none of the entries" in r.getMessage()]
        assert len(said) == 1, caplog.text
        assert all(f"'{k}'" in said[0] for k in ("modle", "model", "step")), said
        caplog.clear()
        with caplog.at_level(logging.WARNING, "ckptstore"):
            assert mgr.restore({"model": fresh, "extra": {"x": 1}}, strict=False) == 3
        assert "none of the entries" not in caplog.text
        assert_same(module_bytes(fresh), module_bytes(src))


def test_modules_are_all_checked_before_any_is_loaded() -> None:
    first, second = TinyNet(), TinyNet(width=8)
    before = module_bytes(first), module_bytes(second)
    stored = {"first": TinyNet().state_dict(), "second": TinyNet(width=5).state_dict()}
    with pytest.raises(StateMismatchError, match=r"\['second'\]") as ei:
        apply_state({"first": first, "second": second}, stored, {})
    assert ei.value.mismatched
    assert_same((module_bytes(first), module_bytes(second)), before)
    with pytest.raises(StateMismatchError, match="not a state dict"):
        apply_state({"first": first}, {"first": [1, 2]}, {})


def test_stateful_refusal_is_a_state_mismatch() -> None:
    c = Counter()
    with pytest.raises(StateMismatchError, match=r"\['counter'\]: Counter.load_state_dict"):
        apply_state({"counter": c}, {"counter": {"x": 1}}, {"counter": "stateful"})
    assert c.n == 0


def test_stateful_objects_round_trip(tmp_path: Path) -> None:
    c = Counter()
    c.n, c.hist = 3, torch.tensor([1.0, 2.0, 3.0])
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"counter": c, "optimizer": opt, "scaler": scaler})
        c2 = Counter()
        m2 = nn.Linear(2, 2)
        opt2 = torch.optim.SGD(m2.parameters(), lr=0.5)
        scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
        mgr.restore({"counter": c2, "optimizer": opt2, "scaler": scaler2})
    assert c2.n == 3
    assert torch.equal(c2.hist, c.hist)
    assert_same(opt2.state_dict(), opt.state_dict())
    assert scaler2.get_scale() == scaler.get_scale()


# ---- a refused restore changes nothing (issue 10, item 8) ------------------------------


def _model_and_adam(seed: int, groups: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    params = list(m.parameters())
    if groups == 1:
        opt = torch.optim.Adam(params, lr=0.01)
    else:  # the same parameters, in two groups (say, no weight decay on biases)
        opt = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}])
    m(torch.ones(3, 4)).sum().backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("in_place", [False, True])
def test_optimizer_with_other_param_groups_is_refused_before_the_model_changes(
    tmp_path: Path, in_place: bool
) -> None:
    model, opt = _model_and_adam(0)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
        model2, opt2 = _model_and_adam(1, groups=2)
        before, opt_before = module_bytes(model2), copy.deepcopy(opt2.state_dict())
        with pytest.raises(StateMismatchError, match=r"parameter groups do not match") as ei:
            mgr.restore({"model": model2, "optimizer": opt2}, in_place=in_place)
    assert "it has 2 group(s) of [2, 2] parameters" in str(ei.value)
    assert "the checkpoint 1 group(s) of [4]" in str(ei.value)
    assert_same(module_bytes(model2), before)  # bit-identical: nothing was loaded
    assert_same(opt2.state_dict(), opt_before)


def test_optimizer_buffers_of_other_shapes_are_refused(tmp_path: Path) -> None:
    _, opt = _model_and_adam(0)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"optimizer": opt})
        other = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))  # as many params, other shapes
        opt2 = torch.optim.Adam(other.parameters())
        with pytest.raises(StateMismatchError, match=r"state\[0\]\['exp_avg'\]") as ei:
            mgr.restore({"optimizer": opt2})
    assert "checkpoint (8, 4), parameter (6, 4)" in ei.value.mismatched[0]
    assert opt2.state_dict()["state"] == {}


class Refuser:
    """A Stateful whose load_state_dict refuses for a reason no check can foresee."""

    def state_dict(self) -> dict[str, Any]:
        return {"v": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise ValueError("version 1 states are no longer supported")


def test_a_refusal_no_check_foresaw_puts_back_what_was_loaded(tmp_path: Path) -> None:
    model, opt = _model_and_adam(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    sched.step()
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt, "sched": sched, "z": Refuser()})
        model2, opt2 = _model_and_adam(1)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=5)
        before = copy.deepcopy((module_bytes(model2), opt2.state_dict(), sched2.state_dict()))
        target = {"model": model2, "optimizer": opt2, "sched": sched2, "z": Refuser()}
        # in_place=False: nothing is read into the targets before every entry has loaded
        # (the default streams tensors into them first: see the test below).
        with pytest.raises(StateMismatchError, match=r"\['z'\]: Refuser.load_state_dict"):
            mgr.restore(target, in_place=False)
    assert_same((module_bytes(model2), opt2.state_dict(), sched2.state_dict()), before)


def _sequential(opt: torch.optim.Optimizer, last: str) -> Any:
    lr = torch.optim.lr_scheduler
    firsts = [lr.LinearLR(opt, 0.1, total_iters=3)]
    if last == "step":
        firsts.append(lr.StepLR(opt, 2))
    elif last == "lambda":
        firsts.append(lr.LambdaLR(opt, lambda e: 0.9**e))
    else:  # "two": a constant and a cosine after the linear
        firsts += [lr.ConstantLR(opt, 0.5, total_iters=3), lr.CosineAnnealingLR(opt, 10)]
    return lr.SequentialLR(opt, firsts, milestones=[3, 6][: len(firsts) - 1])


@pytest.mark.parametrize(
    ("saved", "target", "raised"),
    [
        ("two", "step", "list index out of range"),  # IndexError: was not caught at all
        ("step", "lambda", "'lr_lambdas'"),  # KeyError: the refusing scheduler stayed half-set
    ],
)
def test_any_refusal_of_a_scheduler_puts_back_everything_it_and_others_took(
    tmp_path: Path, saved: str, target: str, raised: str
) -> None:
    """A SequentialLR of other sub-schedulers than saved raises in torch's
    load_state_dict after it took part of the stored state: the optimizer loaded before it
    kept the step's moments, the scheduler its last_epoch and first sub-scheduler, and an
    IndexError escaped as itself (found by review)."""
    model, opt = _model_and_adam(0)
    sched = _sequential(opt, saved)
    for _ in range(4):
        opt.step()
        sched.step()
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(4, {"model": model, "optimizer": opt, "sched": sched})
        model2, opt2 = _model_and_adam(1)
        sched2 = _sequential(opt2, target)
        subs = sched2._schedulers
        before = copy.deepcopy(
            (module_bytes(model2), opt2.state_dict(), sched2.last_epoch, subs[0].last_epoch)
        )
        with pytest.raises(StateMismatchError) as ei:
            mgr.restore({"model": model2, "optimizer": opt2, "sched": sched2}, in_place=False)
    assert "['sched']: SequentialLR.load_state_dict refused" in str(ei.value)
    assert raised in str(ei.value)
    assert "nothing was restored" in str(ei.value)
    after = (module_bytes(model2), opt2.state_dict(), sched2.last_epoch, subs[0].last_epoch)
    assert_same(after, before)


class _Versioned(nn.Linear):
    """A layer that refuses the extra state of another version of its code."""

    version = 2

    def get_extra_state(self) -> Any:
        return {"version": self.version}

    def set_extra_state(self, state: Any) -> None:
        if state["version"] != self.version:
            raise ValueError(f"checkpoint version {state['version']}, code {self.version}")


def test_a_modules_own_refusal_puts_back_the_optimizer_and_says_what_it_left(
    tmp_path: Path,
) -> None:
    """A module's set_extra_state raising (no check can foresee it): the optimizer, loaded
    first, kept the step's state, and the raw ValueError named no entry (found by review).
    The optimizer and plain values go back; the module, loaded in part, is named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Versioned(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt, "epoch": 7})
        model2 = nn.Sequential(nn.Linear(3, 4), _Versioned(4, 2))
        model2[1].version = 3
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
        target: dict[str, Any] = {"optimizer": opt2, "epoch": 0, "model": model2}
        with pytest.raises(StateMismatchError) as ei:
            mgr.restore(target, in_place=False)
    msg = str(ei.value)
    assert "['model']: loading it raised ValueError: checkpoint version 2, code 3" in msg
    assert "plain values of the state were put back" in msg
    assert "'model' may hold part of the checkpoint's values" in msg
    assert len(opt2.state) == 0  # the optimizer's step-1 moments were put back out
    assert target["epoch"] == 0


def test_a_refusal_after_an_in_place_read_says_what_changed(tmp_path: Path) -> None:
    model, opt = _model_and_adam(0)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt, "z": Refuser()})
        model2, opt2 = _model_and_adam(1)
        target = {"model": model2, "optimizer": opt2, "z": Refuser()}
        with pytest.raises(StateMismatchError) as ei:
            mgr.restore(target)
    msg = str(ei.value)
    assert "Refuser.load_state_dict refused" in msg
    assert "already read in place from step 1" in msg
    assert "in_place=False" in msg
    # What the message says: the model's tensors hold step 1.
    assert_same(module_bytes(model2), module_bytes(model))

"""Resume over a corrupt newest step lands on the previous one, for every kind of entry.

Issue 22 #1: with the README's own state (a model, its optimizer, an EMA of it, the RNG and
the step), a flipped byte in the newest step made ``resume()`` raise ``IntegrityError`` for
``ema/counters.n_averaged`` although the older step holds it. Each test restores a state of
every kind of entry (module parameters and buffers, optimizer moments, EMA weights and
counters, a Stateful object that hands out copies, the RNG, plain tensors, scalars and
non-tensor data) over a corrupt newer step, and checks every value equals the older step's.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import flip_byte
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ckptstore import EMA, CheckpointManager, RNGState


class Net(nn.Module):
    """Parameters and buffers (BatchNorm's running stats and its integer counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) * self.scale


class Tally:
    """A Stateful that is not a module: its ``state_dict`` hands out copies."""

    def __init__(self) -> None:
        self.count = 0
        self.hist = torch.zeros(6)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "hist": self.hist.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.count = int(sd["count"])
        self.hist.copy_(sd["hist"])


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = EMA(AveragedModel(model), source=model)
    return {
        "model": model,
        "optimizer": opt,
        "ema": ema,
        "rng": RNGState(),
        "tally": Tally(),
        "step": 0,
        "extra": {"epoch": 0, "name": "start", "lrs": [0.0], "t": torch.zeros(3)},
    }


def train(state: dict[str, Any], steps: int, seed: int) -> None:
    """Changes every entry: weights, buffers, moments, EMA weights and counter, the rest."""
    g = torch.Generator().manual_seed(seed)
    model, opt = state["model"], state["optimizer"]
    for _ in range(steps):
        loss = model(torch.randn(8, 5, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["ema"].ema.update_parameters(model)
    with torch.no_grad():
        model.scale.mul_(1.5)
    state["tally"].count += steps
    state["tally"].hist += torch.rand(6, generator=g)
    state["step"] += steps
    state["extra"] = {
        "epoch": state["extra"]["epoch"] + 1,
        "name": f"after-{seed}",
        "lrs": [*state["extra"]["lrs"], 0.1 * seed],
        "t": torch.rand(3, generator=g),
    }
    torch.rand(seed)  # the global generator moves on
    random.random()


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Every value of ``state`` as detached copies (bytes of tensors, exact scalars)."""
    ema = state["ema"]
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optimizer": copy.deepcopy(state["optimizer"].state_dict()),
        "ema_weights": {k: v.detach().clone() for k, v in ema.module.state_dict().items()},
        "ema_counters": copy.deepcopy(ema.state_dict()["counters"]),
        "rng": copy.deepcopy(state["rng"].state_dict()),
        "tally": copy.deepcopy(state["tally"].state_dict()),
        "step": state["step"],
        "extra": copy.deepcopy(state["extra"]),
    }


def assert_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(raw[0], raw[1]), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype, path
        assert np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert set(a) == set(b), (path, sorted(a), sorted(b))
        for k in a:
            assert_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b), path
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b), (path, a, b)
        assert a == b, (path, a, b)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A store with steps 1 and 2 of the same state, and a snapshot of step 1's values."""
    root = tmp_path_factory.mktemp("fallback") / "store"
    state = make_state(0)
    train(state, 2, seed=1)
    with CheckpointManager(root) as mgr:
        mgr.save(1, state)
        first = snapshot(state)
        train(state, 3, seed=2)
        mgr.save(2, state)
    return root, first


def payloads(root: Path, step: int) -> list[str]:
    doc = json.loads((root / f"step-{step:012d}" / "manifest.json").read_text())
    return sorted(n for n, e in doc["files"].items() if e["codec"] != "json")


def test_the_store_has_a_payload_per_entry(two_steps: tuple[Path, dict[str, Any]]) -> None:
    root, _ = two_steps
    names = payloads(root, 2)
    for entry in ("model", "optimizer", "ema", "rng", "tally"):
        assert f"{entry}.safetensors" in names, names


@pytest.mark.parametrize("in_place", [None, True, False])
@pytest.mark.parametrize(
    "bad", ["optimizer.safetensors", "model.safetensors", "ema.safetensors", "state.json"]
)
def test_resume_over_a_corrupt_newer_step_restores_every_entry_of_the_older(
    tmp_path: Path, two_steps: tuple[Path, dict[str, Any]], bad: str, in_place: bool | None
) -> None:
    src, first = two_steps
    root = tmp_path / "store"
    import shutil

    shutil.copytree(src, root)
    path = root / "step-000000000002" / bad
    data = path.read_bytes()
    # A byte in the tensor data (the last one), or one inside state.json's text.
    path.write_bytes(flip_byte(data, len(data) - 1 if bad != "state.json" else len(data) // 2))
    state = make_state(7)  # different values everywhere: nothing passes by chance
    train(state, 1, seed=9)
    with CheckpointManager(root) as mgr:
        assert mgr.resume(state, in_place=in_place) == 2
    got = snapshot(state)
    for key, want in first.items():
        assert_equal(got[key], want, key)
    # The EMA counter is the object's own, not a copy that was loaded and dropped.
    assert int(state["ema"].ema.n_averaged) == 2

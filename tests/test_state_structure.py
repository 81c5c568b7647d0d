"""ckptstore.state.structure: a replicated state's shape in a few bytes, values left out."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ckptstore import EMA, RNGState
from ckptstore.state.structure import differences, structure_digest


def _state(seed: int = 0, **extra: Any) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt, "step": seed, "rng": RNGState(), **extra}


def test_values_do_not_count_only_entries_dtypes_and_shapes() -> None:
    a, b = structure_digest(_state(0)), structure_digest(_state(1))
    assert a is not None
    assert a == b  # other weights, moments, step number and random streams
    assert set(a) == {"'model'", "'opt'", "'step'"}  # RNGState: per rank by design
    assert differences([a, b, None]) is None  # a rank without a digest is not compared


def test_each_kind_of_difference_is_named() -> None:
    ref = structure_digest(_state(seen=[1, 2]))
    longer = structure_digest(_state(seen=[1, 2, 3]))
    extra = structure_digest(_state(seen=[1, 2], loader={"pos": 1}))
    half = structure_digest({**_state(seen=[1, 2]), "model": nn.Linear(4, 8).half()})
    lacking = structure_digest({k: v for k, v in _state(seen=[1, 2]).items() if k != "opt"})
    msg = differences([ref, ref, longer, extra])
    assert msg is not None
    assert msg.startswith(
        "a replicated save writes rank 0's state alone, and the state of rank(s) 2, 3 differs "
        "from it (rank 2: other entries, dtypes or shapes in 'seen'): theirs would be lost; "
        "nothing was saved."
    )
    assert "also 'loader'" in str(differences([ref, extra]))
    assert "in 'model'" in str(differences([ref, half]))
    assert "no 'opt'" in str(differences([ref, lacking]))
    many = differences([ref, *[longer] * 6])
    assert "rank(s) 1, 2, 3, 4 and 2 more" in str(many)


def test_ema_long_lists_and_deep_nesting_are_bounded() -> None:
    model = nn.Linear(4, 4)
    ema, other = EMA(model), EMA(nn.Linear(4, 5))
    assert structure_digest({"e": ema}) != structure_digest({"e": other})
    # A long list: its length and its ends, not every item.
    long_a = list(range(100_000))
    long_b = [*range(50_000), "x", *range(49_999)]
    assert structure_digest({"l": long_a}) == structure_digest({"l": long_b})
    assert structure_digest({"l": long_a}) != structure_digest({"l": long_a[:-1]})
    deep: Any = []
    for _ in range(10_000):
        deep = [deep]
    assert structure_digest({"d": deep}) is not None


def test_a_state_that_cannot_be_described_is_not_compared() -> None:
    class Broken(nn.Module):
        def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("lazy")

    assert structure_digest({"m": Broken()}) is None

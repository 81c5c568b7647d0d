"""ckptstore.state.structure: a replicated state's shape in a few bytes, values left out."""

from __future__ import annotations

from typing import Any

import pytest
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


def test_values_and_leaf_types_do_not_count_only_entries_dtypes_and_shapes() -> None:
    # HF's TrainerState: best_model_checkpoint stays None on ranks of other nodes.
    a = structure_digest(_state(0, trainer={"best": None}))
    b = structure_digest(_state(1, trainer={"best": "/ckpt/7"}))
    assert a is not None
    assert a == b  # other weights, moments, step number, random streams; None against a path
    assert set(a) == {"'model'", "'opt'", "'step'", "'trainer'"}  # RNGState: per rank by design
    assert differences([a, b, None]) is None  # a rank without a digest is not compared


def test_what_a_rank_holds_that_rank_0_lacks_is_named() -> None:
    ref = structure_digest(_state(seen=[1, 2]))
    longer = structure_digest(_state(seen=[1, 2, 3]))
    extra = structure_digest(_state(seen=[1, 2], loader={"pos": 1}))
    half = structure_digest({**_state(seen=[1, 2]), "model": nn.Linear(4, 8).half()})
    msg = differences([ref, ref, longer, extra])
    assert msg == (
        "a replicated save writes rank 0's state alone, and rank(s) 2, 3 hold state it lacks "
        "(rank 2: other entries, dtypes or shapes in 'seen'): theirs is not saved. Keep "
        "replicated state alike on every rank; keep per-rank random streams in RNGState, and "
        "save other per-rank state with sharded=True (every rank writes its own)"
    )
    assert "(rank 1: also 'loader')" in str(differences([ref, extra]))
    assert "in 'model'" in str(differences([ref, half]))
    assert "rank(s) 1, 2, 3, 4 and 2 more" in str(differences([ref, *[longer] * 6]))


def test_a_rank_holding_less_than_rank_0_loses_nothing() -> None:
    """torch's full state dict with cpu_offload is empty on every rank but 0; an entry a
    rank lacks is rank 0's to save."""
    full = _state(seen=[1, 2])
    ref = structure_digest(full)
    empty = structure_digest({"model": {}, "opt": {}, "step": 0, "seen": None, "more": []})
    lacking = structure_digest({k: v for k, v in full.items() if k != "opt"})
    assert empty == {"'step'": structure_digest({"step": 0})["'step'"]}  # type: ignore[index]
    assert differences([ref, empty, lacking]) is None


def test_non_persistent_buffers_are_not_state() -> None:
    """A rotary cache sized by the longest sequence a rank has seen is not saved."""

    def model(cache: int) -> nn.Module:
        m = nn.Linear(4, 4)
        m.register_buffer("cos", torch.zeros(cache), persistent=False)
        m.register_buffer("scale", torch.ones(4))
        return m

    assert structure_digest({"m": model(8)}) == structure_digest({"m": model(16)})
    ema, other = EMA(nn.Linear(4, 4)), EMA(nn.Linear(4, 5))
    assert structure_digest({"e": ema}) != structure_digest({"e": other})


def test_long_lists_are_read_by_their_ends() -> None:
    long_a = list(range(100_000))
    long_b = [*range(50_000), [1, 2], *range(49_999)]
    assert structure_digest({"l": long_a}) == structure_digest({"l": long_b})
    assert structure_digest({"l": long_a}) != structure_digest({"l": long_a[:-1]})


@pytest.mark.timeout(60)
def test_hostile_structures_are_bounded_and_not_compared() -> None:
    """A branching cycle (a tree with parent links) has 2^64 paths within the depth bound:
    the digest spun while every rank waited at the save's first exchange (found by review)."""
    deep: Any = []
    for _ in range(10_000):
        deep = [deep]
    node: dict[str, Any] = {}
    node["left"] = node
    node["right"] = node
    wide = {i: i for i in range(200_000)}
    assert structure_digest({"d": deep}) is None
    assert structure_digest({"cycle": node}) is None  # unbounded, it spun for minutes
    assert structure_digest({"wide": wide}) is None

    class Broken(nn.Module):
        def named_modules(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("lazy")

    assert structure_digest({"m": Broken()}) is None
    assert differences([structure_digest({"m": nn.Linear(2, 2)}), None]) is None

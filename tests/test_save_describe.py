"""Rank 0's description of the DTensors (``ShardJob.describe``): made beside its writes, once.

The first save of a layout describes every DTensor for ``dtensors.json`` on a thread of the
write phase, not before the first byte is written; the description is kept for the next
saves of the layout, and one that failed is made again by the next save.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptstore import CheckpointManager
from ckptstore.sharded import plan as sharding


def _model(mesh: object, seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]
    return model


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def test_the_description_is_made_off_the_callers_thread_once_per_layout(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = sharding.tensor_meta

    def counted(flat: Any) -> Any:
        calls.append(threading.get_ident())
        return real(flat)

    monkeypatch.setattr(sharding, "tensor_meta", counted)
    model = _model(mesh, 1)
    with CheckpointManager(tmp_path / "ck", keep=None) as mgr:
        mgr.save(1, {"model": model})
        mgr.save(2, {"model": model})  # the same layout: described already
    assert len(calls) == 1
    assert calls[0] != threading.get_ident()  # beside the writes, not before them
    with CheckpointManager(tmp_path / "ck") as mgr:
        fresh = _model(mesh, 2)
        mgr.restore({"model": fresh}, step=2)
    want, got = _values(model), _values(fresh)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_description_that_failed_fails_its_save_and_is_made_again_by_the_next(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = sharding.tensor_meta
    failures = [OSError("description failed (test)")]

    def once(flat: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(flat)

    monkeypatch.setattr(sharding, "tensor_meta", once)
    model = _model(mesh, 3)
    root = tmp_path / "ck"
    with CheckpointManager(root, keep=None) as mgr:
        with pytest.raises(OSError, match="description failed"):
            mgr.save(1, {"model": model})
        assert mgr.steps() == []  # nothing of step 1 is visible
        mgr.save(2, {"model": model})  # the same manager and layout: described now
        assert mgr.steps() == [2]
        assert mgr.verify(2).ok
    assert not failures
    with CheckpointManager(root) as mgr:
        fresh = _model(mesh, 4)
        assert mgr.restore({"model": fresh}) == 2
    want, got = _values(model), _values(fresh)
    assert all(torch.equal(want[k], got[k]) for k in want)

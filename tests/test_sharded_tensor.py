"""FSDP1 ``ShardedTensor`` state (Lightning's ``FSDPStrategy``) through DTensor views.

FSDP1 needs a GPU (``tests/test_gpu_frameworks.py`` runs Lightning's ``FSDPStrategy`` there);
its ``ShardedTensor``s do not: here 2 gloo ranks save them (built by FSDP's own chunking) and
3 ranks and one process read them back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ckptstore import CheckpointManager
from tests.multirank.launch import describe, launch
from tests.multirank.sharded_tensor_scenarios import full_tensors


def test_fsdp1_sharded_tensors_restore_on_another_world_size(tmp_path: Path) -> None:
    res = launch("sharded_tensor_scenarios:st_save", 2, tmp_path, timeout=120)
    assert all(r.ok for r in res), describe(res)
    # A ShardedTensor chunked along dim 1 is refused before anything is written.
    for r in res:
        refused = r.value["refused"]
        assert refused["error"] == "ConfigError", refused
        msg = refused["message"]
        assert msg.startswith("state_dict['w']: a ShardedTensor of shape [4, 4] that is not"), msg
        assert "rank 0 holds offsets [0, 0], sizes [4, 2]" in msg
    store = tmp_path / "store"
    # Each rank wrote its own shards: a DTensor step, not one file from rank 0.
    (step,) = store.glob("step-*")
    assert sorted(p.name.split(".")[1] for p in step.glob("_shards.rank*")) == [
        "rank00000",
        "rank00001",
    ]
    res = launch("sharded_tensor_scenarios:st_restore", 3, tmp_path, timeout=120)
    assert all(r.ok for r in res), describe(res)
    for r in res:
        assert r.value == {"step": 1, "bad": [], "lr": 0.1}, r.value
    # One process: full tensors, as saved.
    with CheckpointManager(store) as mgr:
        loaded = mgr.load(1)
    for k, full in full_tensors(1).items():
        assert torch.equal(loaded["state_dict"][k], full)
        assert torch.equal(loaded["optimizer_states"][0]["state"][k]["exp_avg"], full * 2)

"""A replicated checkpoint (one process or DDP: whole tensors) restored into FSDP2 shards.

Before, such a restore read the stored bytes "in place" into the DTensor parameters, which
have no memory of their own (``data_ptr() == 0``), and the ranks died of a segmentation
fault. Now each rank takes its part of every whole tensor, parameters and optimizer
moments alike, and training goes on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointManager, StateMismatchError
from ckptstore.codec.safetensors import fits, tensor_bytes
from tests.multirank.dtensor_scenarios import digests, make_net, train
from tests.multirank.launch import describe, launch


@pytest.mark.parametrize(("fmt", "world"), [("safetensors", 3), ("torch", 2)])
def test_a_replicated_step_restores_into_fsdp2(tmp_path: Path, fmt: str, world: int) -> None:
    model = make_net(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 3)
    with CheckpointManager(tmp_path / "store", format=fmt) as mgr:
        mgr.save(3, {"model": model, "optim": opt})
        assert not mgr.manifest(3).dtensor  # whole tensors, written by one process
    saved = digests(model, opt)
    res = launch(
        "dtensor_scenarios:plain_into_fsdp", world, tmp_path / f"w{world}", timeout=120,
        args={"root": str(tmp_path / "store")},
    )  # fmt: skip
    assert all(r.ok for r in res), describe(res)
    for r in res:
        assert r.value["step"] == 3
        assert r.value["restored"] == saved
        assert r.value["layouts"] == ["True:True"]
        # Training goes on from there: one more step moved every value, alike on all ranks.
        assert r.value["trained"] == res[0].value["trained"]
        kept = [
            k
            for k, v in saved.items()
            if k.startswith(("model/", "optim/")) and k not in ("model/scale", "optim/groups")
            and not k.endswith("/step") and r.value["trained"][k] == v
        ]  # fmt: skip
        assert kept == []


def test_a_fall_back_from_a_corrupt_dtensor_step_to_a_replicated_one_completes(
    tmp_path: Path,
) -> None:
    # Step 4 (FSDP2, 2 ranks) fails its checksum and the restore falls back to step 3 (one
    # process: whole tensors), which writes every parameter. Its writes into the FSDP2
    # targets were not counted (only tensors with their own memory were), so the restore
    # raised "partly written by a newer step ... this step holds no value for them".
    model = make_net(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 3)
    root = tmp_path / "store"
    with CheckpointManager(root) as mgr:
        mgr.save(3, {"model": model, "optim": opt})
    saved = digests(model, opt)
    args = {"root": str(root)}
    res = launch("dtensor_scenarios:fsdp_save_into", 2, tmp_path / "s", args={**args, "step": 4})
    assert all(r.ok for r in res), describe(res)
    (shard,) = (root / "step-000000000004").glob("_shards.rank00001.*")
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + n])
    first = min(v["data_offsets"][0] for k, v in head.items() if not k.startswith("_"))
    data[8 + n + first] ^= 0xFF  # a byte of a tensor (not of the padding between them)
    shard.write_bytes(bytes(data))
    res = launch("dtensor_scenarios:plain_into_fsdp", 2, tmp_path / "r", timeout=120, args=args)
    assert all(r.ok for r in res), describe(res)
    for r in res:
        assert r.value["step"] == 3
        assert r.value["restored"] == saved


def test_no_byte_path_takes_a_dtensor_for_a_plain_tensor() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        d = distribute_tensor(torch.zeros(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
        assert d.data_ptr() == 0  # what the restore wrote through before
        assert not fits(d, torch.float32, [4, 3])
        assert fits(d.to_local(), torch.float32, [4, 3])
        with pytest.raises(ValueError, match="memory of its own"):
            tensor_bytes(d)
    finally:
        dist.destroy_process_group()


def test_a_replicated_step_restores_into_a_state_dict_of_dtensors(tmp_path: Path) -> None:
    # DCP's way of holding a model: {"model": get_model_state_dict(fsdp_model)}. The whole
    # stored tensors come back as DTensors laid out like the dict's values, as DTensor
    # leaves do; before, every rank's DTensor was replaced by the whole tensor.
    model = make_net(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 3)
    with CheckpointManager(tmp_path / "store") as mgr:
        mgr.save(3, {"model": model.state_dict()})
    saved = {k: v for k, v in digests(model, None).items() if k.startswith("model/")}
    res = launch(
        "dtensor_scenarios:plain_into_state_dict", 2, tmp_path / "w2", timeout=120,
        args={"root": str(tmp_path / "store")},
    )  # fmt: skip
    assert all(r.ok for r in res), describe(res)
    for r in res:
        assert r.value["step"] == 3
        assert r.value["layouts"]
        assert all(r.value["layouts"].values()), r.value["layouts"]
        assert {k: v for k, v in r.value["restored"].items() if k.startswith("model/")} == saved


def test_a_whole_tensor_is_not_cut_into_partial_placements_and_nothing_changes(
    mesh: object, tmp_path: Path
) -> None:
    # A Partial placement's local tensor is a summand, not a piece: a replicated step is
    # refused for it, by name, before the optimizer (loaded first) or the module changes.
    from torch import nn
    from torch.distributed.tensor import DTensor, Partial

    src = nn.Linear(3, 2)
    with CheckpointManager(tmp_path / "s", distributed=False) as mgr:
        mgr.save(1, {"model": src, "optim": torch.optim.SGD(src.parameters(), lr=0.1)})
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    model.weight = nn.Parameter(DTensor.from_local(before.clone(), mesh, [Partial()]))  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with (
        CheckpointManager(tmp_path / "s") as mgr,
        pytest.raises(
            StateMismatchError, match=r"weight: a whole tensor cannot be laid out as \(P"
        ),
    ):
        mgr.restore({"model": model, "optim": opt})
    assert torch.equal(model.weight.to_local(), before)
    assert opt.param_groups[0]["lr"] == 0.5


def test_whole_tensors_in_lists_and_tuples_come_back_laid_out_like_their_targets(
    mesh: object, tmp_path: Path
) -> None:
    # Plain data nests lists and tuples too: each whole tensor whose target is a DTensor of
    # its shape comes back as one (this rank's part), the rest as saved, tuples as tuples.
    from torch.distributed.tensor import DTensor, Replicate, Shard

    a, b, c = torch.randn(4, 3), torch.randn(5), torch.arange(6)
    with CheckpointManager(tmp_path / "s", distributed=False) as mgr:
        mgr.save(1, {"w": [a, (b, c)], "n": 3})

    def dt(t: torch.Tensor, p: object) -> DTensor:
        return DTensor.from_local(torch.zeros_like(t), mesh, [p])  # type: ignore[arg-type]

    state = {"w": [dt(a, Shard(0)), (dt(b, Replicate()), torch.zeros(6))], "n": 0}
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.restore(state)
    w0, (w1, w2) = state["w"]
    assert isinstance(state["w"][1], tuple)
    assert isinstance(w0, DTensor)
    assert w0.placements == (Shard(0),)
    assert isinstance(w1, DTensor)
    assert w1.placements == (Replicate(),)
    assert type(w2) is torch.Tensor
    assert torch.equal(w0.to_local(), a)
    assert torch.equal(w1.to_local(), b)
    assert torch.equal(w2, c)
    assert state["n"] == 3

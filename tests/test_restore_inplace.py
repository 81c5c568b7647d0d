"""Sharded restores read into the targets' own tensors, and a failed one keeps its promise.

One process, real files, FSDP2 on a one-rank gloo group (resharded restores on 3 ranks and
in one process without a group are in ``tests/multirank/test_dtensor.py``). What a failed
restore leaves is docs/guarantees.md's "What a failed restore leaves": no target tensor
ever holds a byte that failed its check; a fallback step overwrites what a failed one wrote,
or the restore names the tensors it could not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptstore import CheckpointManager
from ckptstore.errors import IntegrityError
from ckptstore.sharded import targets as targets_mod
from ckptstore.sharded.chunks import BLOCK
from tests._helpers import HashCounter, index_chunks, step_path

pytestmark = pytest.mark.timeout(120)

ROWS = 3 * BLOCK // (4 * 256)  # "big": 3 blocks of float32, 256 columns


class Net(nn.Module):
    def __init__(self, *, big: bool = True, rows: int = ROWS) -> None:
        super().__init__()
        self.small = nn.Linear(8, 8)
        if big:
            self.big = nn.Parameter(torch.zeros(rows, 256))


def _build(
    mesh: object, seed: int, *, big: bool = True, rows: int = ROWS
) -> tuple[Net, torch.optim.Optimizer]:
    """An FSDP2 Net whose parameters and AdamW moments all exist (one step taken)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net(big=big, rows=rows)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    fully_shard(model, mesh=mesh)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * (seed + 1)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _locals(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter's and moment's local tensor, by name."""
    out = {n: p.to_local() for n, p in model.named_parameters()}  # type: ignore[operator]
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{names[id(p)]}/{k}"] = st[k].to_local()
    return out


def _saved(mesh: object, root: Path, steps: dict[int, int], *, big_in: tuple[int, ...]) -> dict:
    """Save ``steps`` (step -> seed); the local values each step holds."""
    held: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(root) as mgr:
        for step, seed in steps.items():
            model, opt = _build(mesh, seed, big=step in big_in)
            mgr.save(step, {"model": model, "optimizer": opt})
            held[step] = {k: v.clone() for k, v in _locals(model, opt).items()}
    return held


def _corrupt_block(root: Path, step: int, tensor: str, block: int) -> None:
    """Flip a byte in ``block`` of ``tensor``'s chunk (one rank: one chunk)."""
    d = step_path(root, step)
    (chunk,) = index_chunks(d, tensor)
    path = d / chunk["file"]
    data = bytearray(path.read_bytes())
    data[chunk["start"] + block * BLOCK + 4096 + 1] ^= 0x40
    path.write_bytes(bytes(data))


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """Record, for every read, the address each leaf was read into."""
    seen: list[dict[str, int]] = []
    real = targets_mod.read_into

    def read_into(index: Any, flat: Any, *a: Any, **k: Any) -> int:
        seen.append({n: _local(t).data_ptr() for n, t in flat.items()})
        return real(index, flat, *a, **k)

    monkeypatch.setattr(targets_mod, "read_into", read_into)
    return seen


def test_restore_reads_every_parameter_and_moment_into_its_own_memory(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = _saved(mesh, tmp_path / "s", {1: 1}, big_in=(1,))
    model, opt = _build(mesh, 5)
    before = {k: v.data_ptr() for k, v in _locals(model, opt).items()}
    params = list(model.parameters())
    seen = _spy(monkeypatch)
    with CheckpointManager(tmp_path / "s") as mgr:
        assert mgr.restore({"model": model, "optimizer": opt}) == 1
    now = _locals(model, opt)
    assert {k: v.data_ptr() for k, v in now.items()} == before
    # The load is the identity (load_state_dict with assign: the same objects registered
    # again, not copied onto themselves): the optimizer still holds the model's parameters.
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params, strict=True))
    for k, v in held[1].items():
        assert torch.equal(now[k], v), k
    # Each leaf was read into the target's own memory, not into a fresh tensor copied later.
    (read,) = seen
    assert sorted(read.values()) == sorted(before.values())


@pytest.mark.parametrize("io", ["direct", "buffered"])  # by extent (extents.py), box by box
def test_a_corrupt_block_never_reaches_a_live_target(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io: str
) -> None:
    root = tmp_path / "s"
    held = _saved(mesh, root, {1: 1, 2: 2}, big_in=(1, 2))
    _corrupt_block(root, 2, "model/big", 1)  # the middle one of its 3 blocks
    model, opt = _build(mesh, 5)
    old = {k: v.clone() for k, v in _locals(model, opt).items()}
    seen = _spy(monkeypatch)
    with (
        CheckpointManager(root, storage_options={"io": io}) as mgr,
        pytest.raises(IntegrityError, match="tensor 'model/big': block 1 ") as ei,
    ):
        mgr.restore({"model": model, "optimizer": opt}, step=2)
    assert "_shards.rank00000" in str(ei.value)
    big = _locals(model, opt)["big"]
    assert seen[0]["model/big"] == big.data_ptr()  # it was read in place
    # Every element holds its old value or step 2's, never a byte of the failed block; the
    # blocks read before the bad one were copied.
    new, was = held[2]["big"], old["big"]
    assert bool(((big == new) | (big == was)).all())
    rows = BLOCK // (4 * 256)
    assert torch.equal(big[:rows], new[:rows])
    assert torch.equal(big[rows:], was[rows:])
    # Restored without a step, step 1 verifies and overwrites everything step 2 wrote.
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"model": model, "optimizer": opt}) == 1
    now = _locals(model, opt)
    for k, v in held[1].items():
        assert torch.equal(now[k], v), k


def test_a_fallback_that_cannot_overwrite_a_live_target_says_so(
    mesh: object, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    _saved(mesh, root, {1: 1, 2: 2}, big_in=(2,))  # step 1 has no "big"
    _corrupt_block(root, 2, "model/big", 2)  # its first blocks were copied
    model, _ = _build(mesh, 5)
    with (
        CheckpointManager(root) as mgr,
        pytest.raises(IntegrityError, match="partly written by a newer step") as ei,
    ):
        mgr.restore({"model": model}, strict=False)
    assert "model/big" in str(ei.value)


def test_in_place_false_reads_nothing_into_the_targets(mesh: object, tmp_path: Path) -> None:
    root = tmp_path / "s"
    _saved(mesh, root, {2: 2}, big_in=(2,))
    _corrupt_block(root, 2, "model/big", 2)
    model, opt = _build(mesh, 5)
    old = {k: v.clone() for k, v in _locals(model, opt).items()}
    with CheckpointManager(root) as mgr, pytest.raises(IntegrityError, match="block 2 "):
        mgr.restore({"model": model, "optimizer": opt}, step=2, in_place=False)
    now = _locals(model, opt)
    for k, v in old.items():
        assert torch.equal(now[k], v), k


def test_tied_targets_are_read_into_fresh_tensors(mesh: object) -> None:
    from torch.distributed.tensor import DTensor, Shard

    def dt(t: torch.Tensor) -> Any:
        return DTensor.from_local(t, mesh, [Shard(0)])  # type: ignore[arg-type]

    base = torch.zeros(8, 4)
    leaves = {n: (("m", n), _entry((8, 4))) for n in ("a", "b", "c", "d")}
    templates = {
        "a": dt(base),
        "b": dt(torch.zeros(8, 4)),
        "c": dt(base.view(8, 4)),  # the same memory as "a": a tied weight under two names
        "d": dt(torch.zeros(8, 4)),
    }
    live = targets_mod.live_targets(leaves, templates, set(leaves))
    assert sorted(live) == ["b", "d"]
    # Not contiguous, or not the stored shape: fresh too.
    odd = {"a": dt(torch.zeros(4, 8).t()), "b": dt(torch.zeros(8, 5))}
    assert targets_mod.live_targets(leaves, odd, {"a", "b"}) == {}


@pytest.mark.parametrize("store", ["s3", "memory"])
def test_a_sharded_save_to_an_object_store_hashes_each_byte_once(
    mesh: object, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    # Through the S3 writer, in 5 MiB parts: the file's CRC32C (the manifest), each part's
    # (checked by the store) and the chunks' block CRCs (the index) from one pass per byte.
    # Through any other fsspec store (the CRCWriter around its file): the file's and the
    # chunks'. Before, the parts and the chunks each took a pass of their own.
    import uuid

    import fsspec

    from ckptstore import integrity

    counter = HashCounter()

    model, opt = _build(mesh, 5, rows=8 * ROWS)  # 3 x 6 MiB: each tensor in 2 parts
    want = {k: v.clone() for k, v in _locals(model, opt).items()}
    if store == "s3":
        s3 = request.getfixturevalue("s3")
        prefix = s3.unique_prefix()
        url, root, fs = s3.url(prefix), f"{s3.bucket}/{prefix}", s3.client
        opts = dict(s3.storage_options, default_block_size=5 << 20)
    else:
        name = f"ckptstore-ri-{uuid.uuid4().hex}"
        url, root, fs, opts = f"memory://{name}", f"/{name}", fsspec.filesystem("memory"), {}
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, {"model": nn.Linear(2, 2).state_dict()})  # the store probed, untimed
        monkeypatch.setattr(integrity, "_crc32c", counter)
        mgr.save(2, {"model": model, "optimizer": opt})
        monkeypatch.undo()
        sizes = {
            p.rsplit("/", 1)[1]: int(info["size"])
            for p, info in fs.find(root, detail=True).items()
            if "step-000000000002" in p
        }
        shards = sum(n for name, n in sizes.items() if name.startswith("_shards."))
        written = sum(sizes.values())
        assert shards > 3 * (5 << 20)  # more than one part (S3)
        assert shards <= counter.hashed <= written + (written - shards), (counter.hashed, sizes)
        assert mgr.verify(2).ok  # the files' and every chunk block's CRCs are the bytes'
        fresh, fresh_opt = _build(mesh, 6, rows=8 * ROWS)
        mgr.restore({"model": fresh, "optimizer": fresh_opt}, step=2)
    got = _locals(fresh, fresh_opt)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_full_disk_under_a_sharded_save_leaves_the_previous_step(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ENOSPC from the write system calls themselves, in the I/O thread, in the middle of the
    # requests that gather several tensors (pwritev): the save fails with one clear error,
    # leaves nothing, and the step before restores bit for bit.
    import errno
    import os

    from ckptstore.errors import CommitError
    from ckptstore.storage import directio

    model, opt = _build(mesh, 7, rows=8 * ROWS)
    want = {k: v.clone() for k, v in _locals(model, opt).items()}
    sent = [0]
    real_v, real_1 = os.pwritev, os.pwrite

    def full(real: Any) -> Any:
        def call(fd: int, data: Any, offset: int) -> int:
            sent[0] += 1
            if sent[0] > 2:  # the first requests of the save go through
                raise OSError(errno.ENOSPC, "No space left on device")
            return int(real(fd, data, offset))

        return call

    with CheckpointManager(tmp_path, barrier_timeout=60) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        monkeypatch.setattr(directio.os, "pwritev", full(real_v))
        monkeypatch.setattr(directio.os, "pwrite", full(real_1))
        with pytest.raises(CommitError) as ei:
            mgr.save(2, {"model": model, "optimizer": opt})
        monkeypatch.undo()
        assert sent[0] > 2
        msg = str(ei.value)
        assert "rank(s) 0 failed to write their shard (rank 0: the disk is full" in msg, msg
        assert "step 1 is still the newest checkpoint" in msg
        assert mgr.steps() == [1]
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")) == []
        fresh, fresh_opt = _build(mesh, 8, rows=8 * ROWS)
        assert mgr.restore({"model": fresh, "optimizer": fresh_opt}) == 1
    got = _locals(fresh, fresh_opt)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _entry(shape: tuple[int, ...]) -> Any:
    from ckptstore.sharded.chunks import TensorEntry

    return TensorEntry(dtype="float32", shape=shape, chunks=())


def test_a_sharded_save_reads_each_byte_once_for_all_its_crcs(
    mesh: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The chunks' block CRCs (the index) and the file's own (the manifest) come from one
    # pass over each byte; before, a second thread computed the chunk CRCs over them again.
    import crc32c as real

    from ckptstore import integrity

    counter = HashCounter()
    monkeypatch.setattr(integrity, "_crc32c", counter)
    model, opt = _build(mesh, 3)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
        written = sum(p.stat().st_size for p in step_path(tmp_path, 1).iterdir())
        shards = sum(p.stat().st_size for p in step_path(tmp_path, 1).glob("_shards.*"))
        assert shards > 3 * BLOCK
        # every byte once (the small files are also read back when committed, checked)
        assert shards <= counter.hashed <= written + (written - shards), (counter.hashed, written)
        monkeypatch.undo()
        assert mgr.verify().ok  # the files' CRCs, from the pieces, are the bytes' CRCs
    d = step_path(tmp_path, 1)
    for chunk in index_chunks(d, "model/big") + index_chunks(d, "optimizer/state/big/exp_avg"):
        data = (d / chunk["file"]).read_bytes()[chunk["start"] : chunk["start"] + chunk["bytes"]]
        want = [f"{real.crc32c(data[i : i + BLOCK]):08x}" for i in range(0, len(data), BLOCK)]
        assert chunk["crc32c"] == want


def test_plain_data_gets_the_saved_dtype_back_not_its_targets(mesh: object, tmp_path: Path) -> None:
    # A dict's values are replaced by what was saved, DTensors as plain tensors: a target
    # of another dtype is no reason to round the stored bytes (a float32 DTensor read into a
    # bfloat16 target came back bfloat16, where a plain step gave float32 back).
    from torch.distributed.tensor import Shard, distribute_tensor

    saved = torch.randn(6, 5, dtype=torch.float64).to(torch.float32) * 1e-3
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"w": {"a": distribute_tensor(saved, mesh, [Shard(0)]), "p": saved + 1}})
    target = torch.zeros(6, 5, dtype=torch.bfloat16)
    state: dict[str, Any] = {
        "w": {"a": distribute_tensor(target, mesh, [Shard(1)]), "p": target.clone()}
    }
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.restore(state)
    a, p = state["w"]["a"], state["w"]["p"]
    assert (a.dtype, p.dtype) == (torch.float32, torch.float32)
    assert a.placements == (Shard(1),)  # laid out as its target
    assert torch.equal(a.full_tensor(), saved)
    assert torch.equal(p, saved + 1)

"""ckptstore.restore.partial and load(keys=...): only what is asked for is read, and it is checked.

Bytes read are counted by the kernel: ``rchar`` of ``/proc/self/io`` is every byte that
read(2)/pread(2) calls of this process returned (buffered or O_DIRECT, any thread), so
nothing the storage layer does escapes the count.
"""

from __future__ import annotations

import collections.abc
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import assert_same, flip_byte, step_dir

from ckptstore import (
    CheckpointManager,
    IntegrityError,
    StateMismatchError,
    StepProtectedError,
)
from ckptstore.integrity import BLOCK
from ckptstore.restore.partial import tensor_refs
from ckptstore.storage import wait_for_deletions

MiB = 1 << 20
#: What a load reads besides payloads: manifest.json and state.json (a few KB here).
SMALL_FILES = 64 << 10


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def counted(call: collections.abc.Callable[[], Any]) -> tuple[Any, int]:
    before = rchar()
    out = call()
    return out, rchar() - before


def filled(nbytes: int, seed: int) -> torch.Tensor:
    return torch.arange(nbytes // 4, dtype=torch.int32) * (2 * seed + 1)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Step 1 of a store whose "alias" entry shares tensor "b" with "model".

    Tensor data starts 4096 bytes into a file; "a" ends 4 KiB short of a block so that "b"
    starts on a block boundary and its 12 MiB are exactly three blocks.
    """
    root = tmp_path_factory.mktemp("partial") / "store"
    model = {"a": filled(BLOCK - 4096, 1), "b": filled(12 * MiB, 2), "c": filled(6 * MiB, 3)}
    state = {
        "model": model,
        "optimizer": {"m": filled(12 * MiB, 4)},
        "alias": {"b": model["b"]},  # stored once, in model's file
        "step": 1,
    }
    with CheckpointManager(root) as mgr:
        mgr.save(1, state)
        manifest = mgr.manifest(1)
    assert set(manifest.files) == {"state.json", "model.safetensors", "optimizer.safetensors"}
    assert manifest.files["model.safetensors"].blocks is not None
    return root, state


def warm(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.load(1)  # imports and first-use costs outside the counted calls


def test_tensor_refs_lists_views_and_shared_tensors() -> None:
    tree = {
        "t": "dict",
        "keys": ["x", "y"],
        "vals": [
            {"t": "tensor", "file": "model", "key": "w"},
            [{"t": "view", "file": "model", "key": "v", "offset": 3}, {"t": "int", "v": 1}],
        ],
    }
    assert tensor_refs(tree) == {"model": {"w", "v"}}
    assert tensor_refs({"t": "tensor", "file": 3, "key": "w"}) == {}  # malformed: skipped


def test_load_keys_reads_only_the_files_of_those_entries(
    store: tuple[Path, dict[str, Any]],
) -> None:
    root, state = store
    warm(root)
    with CheckpointManager(root) as mgr:
        got, nread = counted(lambda: mgr.load(1, keys=["model"]))
    assert list(got) == ["model"]
    assert_same(got["model"], state["model"])
    needed = sum(t.numel() * t.element_size() for t in state["model"].values())
    # The model file whole (its header is 4 KiB), never the optimizer's.
    assert nread <= 1.05 * needed + SMALL_FILES, (nread, needed)
    assert nread >= needed


def test_load_keys_reads_only_the_byte_ranges_of_a_shared_tensor(
    store: tuple[Path, dict[str, Any]],
) -> None:
    root, state = store
    warm(root)
    with CheckpointManager(root) as mgr:
        got, nread = counted(lambda: mgr.load(1, keys=["alias", "step"]))
    assert_same(got, {"alias": state["alias"], "step": 1})
    needed = 12 * MiB
    # "b"'s three blocks, plus the block that holds the header (checked before it is used).
    assert nread <= 1.05 * needed + BLOCK + SMALL_FILES, (nread, needed)
    assert nread < (BLOCK - 4096 + 12 * MiB + 6 * MiB)  # less than the model file


def test_restore_of_only_the_model_reads_only_its_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048)  # 8 MiB of weights
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()  # 16 MiB of optimizer state
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt, "step": 1})
    warm(root)
    fresh = torch.nn.Linear(1024, 2048)
    with CheckpointManager(root) as mgr:
        step, nread = counted(lambda: mgr.restore({"model": fresh}, strict=False))
    assert step == 1
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh.bias, model.bias)
    needed = (1024 * 2048 + 2048) * 4
    assert nread <= 1.05 * needed + SMALL_FILES, (nread, needed)


def _flip(root: Path, name: str, offset: int) -> None:
    path = root / step_dir(1) / name
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))


def test_a_corrupt_block_is_found_before_its_bytes_are_used_and_others_go_unread(
    tmp_path: Path,
) -> None:
    model = {"a": filled(BLOCK - 4096, 1), "b": filled(12 * MiB, 2), "c": filled(6 * MiB, 3)}
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "alias": {"b": model["b"]}})
    _flip(root, "model.safetensors", 17 * MiB)  # inside "c", which "alias" does not need
    with CheckpointManager(root) as mgr:
        got = mgr.load(1, keys=["alias"])
        assert torch.equal(got["alias"]["b"], model["b"])
        with pytest.raises(IntegrityError, match="block 4 "):
            mgr.load(1)  # everything: "c" is read, and its block fails
    _flip(root, "model.safetensors", 17 * MiB)  # repaired
    _flip(root, "model.safetensors", 9 * MiB)  # inside "b"
    where = f"{root}/{step_dir(1)}/model.safetensors"
    with CheckpointManager(root) as mgr, pytest.raises(IntegrityError) as ei:
        mgr.load(1, keys=["alias"])
    assert str(ei.value).startswith(f"{where}: block 2 (bytes {2 * BLOCK}..{3 * BLOCK}) crc32c")


def test_load_of_an_entry_that_is_not_there_says_what_is(
    store: tuple[Path, dict[str, Any]],
) -> None:
    root, _ = store
    with CheckpointManager(root) as mgr, pytest.raises(StateMismatchError) as ei:
        mgr.load(1, keys=["model", "nope"])
    assert "holds no entries ['nope']" in str(ei.value)
    assert "'optimizer'" in str(ei.value)


def test_keys_as_a_string_is_refused_with_the_fix(store: tuple[Path, dict[str, Any]]) -> None:
    root, _ = store
    with CheckpointManager(root) as mgr, pytest.raises(TypeError) as ei:
        mgr.load(1, keys="model")
    assert str(ei.value) == (
        "keys= takes a list of top-level entries, e.g. keys=['model'], not a string"
    )


def _bad_optimizer_at_2(root: Path) -> None:
    """Steps 1 and 2; step 2's optimizer file corrupt, its model file sound."""
    for step in (1, 2):
        with CheckpointManager(root) as mgr:
            mgr.save(step, {"model": {"w": filled(MiB, step)}, "optimizer": {"m": filled(MiB, 9)}})
    path = root / step_dir(2) / "optimizer.safetensors"
    path.write_bytes(flip_byte(path.read_bytes(), -1))


@pytest.mark.parametrize("how", ["load-keys", "restore-some"])
def test_a_read_of_some_entries_does_not_vouch_for_the_step(tmp_path: Path, how: str) -> None:
    """Reading the model of a step whose optimizer file is corrupt says nothing of the step:
    retention must not take it for the newest good one and delete the step before it (it
    did: prune then deleted step 1, the only step that verifies, and resume found none)."""
    root = tmp_path / "store"
    _bad_optimizer_at_2(root)
    with CheckpointManager(root, keep=1) as mgr:
        if how == "load-keys":
            got = mgr.load(keys=["model"])  # an evaluation job's read of the newest step
            assert_same(got["model"], {"w": filled(MiB, 2)})
        else:
            target = {"model": {"w": torch.zeros(MiB // 4, dtype=torch.int32)}}
            assert mgr.restore(target) == 2  # every entry of the state is in step 2
        assert mgr.prune() == []  # step 2 does not verify: step 1 is the newest good one
    wait_for_deletions()
    assert sorted(p.name for p in root.glob("step-*")) == [step_dir(1), step_dir(2)]
    with CheckpointManager(root) as mgr:
        assert mgr.resume({"model": {}, "optimizer": {}}) == 2


def test_delete_still_protects_the_only_good_step_after_a_partial_restore(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    _bad_optimizer_at_2(root)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": {"w": torch.zeros(MiB // 4, dtype=torch.int32)}}, strict=False)
        with pytest.raises(StepProtectedError, match=r"only checkpoint .* that verifies"):
            mgr.delete(1)
        assert mgr.steps() == [1, 2]
        # A read of every entry that passed does vouch for the step (nothing read again).
        assert mgr.load(1)["optimizer"]["m"].equal(filled(MiB, 9))
        assert 1 in mgr._session.known_good

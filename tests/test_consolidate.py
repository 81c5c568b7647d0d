"""ckptstore.sharded.consolidate: full tensors one at a time, and the streaming HF export."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import flip_byte, index_chunks, step_dir, subprocess_env
from safetensors.torch import load_file
from torch import nn

from ckptstore import EMA, CheckpointManager, CkptStoreError, IntegrityError
from ckptstore.sharded.consolidate import (
    HF_INDEX,
    HF_SINGLE,
    StepTensors,
    export_hf,
    iter_tensors,
    parse_size,
    plan_shards,
)


def sha(t: torch.Tensor) -> str:
    from tests.multirank.dtensor_scenarios import _sha

    return _sha(t)


def shard_data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file, from its header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())


def check_hf_dir(out_dir: Path, expected: dict[str, torch.Tensor], limit: int) -> list[str]:
    """The export in ``out_dir`` holds exactly ``expected``, in shards within ``limit``."""
    names = sorted(p.name for p in out_dir.iterdir())
    loaded: dict[str, torch.Tensor] = {}
    if names == [HF_SINGLE]:
        loaded = load_file(str(out_dir / HF_SINGLE))
    else:
        index = json.loads((out_dir / HF_INDEX).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert names == sorted([*shards, HF_INDEX])
        n = len(shards)
        assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for t in expected.values()
        )
        for shard in shards:
            part = load_file(str(out_dir / shard))
            assert {k for k, f in index["weight_map"].items() if f == shard} == set(part)
            size = shard_data_bytes(out_dir / shard)
            assert size <= limit or len(part) == 1, (shard, size, limit)
            loaded.update(part)
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype, k
        assert torch.equal(loaded[k], v), k
    return names


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5kB") == 1500
    assert parse_size("123") == 123
    assert parse_size(" 7 b ") == 7
    assert parse_size(4096) == 4096
    for bad in ("", "GB", "5XB", "-1GB", "0", "1e9"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_plan_shards() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 10), ("d", 1), ("e", 2), ("f", 3)]
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d", "e", "f"]]
    assert plan_shards(sizes, 1) == [[n] for n, _ in sizes]
    assert plan_shards([], 5) == [[]]


# ---- DTensor checkpoints (the mixed store of conftest.py) -----------------------------------


def test_iter_tensors_consolidates_any_world_size(mixed_store) -> None:
    root, digests = mixed_store
    with CheckpointManager(root) as mgr:
        for step in (3, 4, 5):
            got = {f"model/{k}": sha(v) for k, v in iter_tensors(mgr.storage, step)}
            assert got == {k: v for k, v in digests.items() if k.startswith("model/")}, step
            (name, emb), *_ = iter_tensors(mgr.storage, step, "table")
            assert (name, sha(emb)) == ("emb", digests["table/emb"])
        full = mgr.load(3)
        with StepTensors(mgr.storage, 3) as src:
            leaves = dict(src.leaves("optimizer"))
            ref = leaves[("optimizer", "state", "inp.weight", "exp_avg")]
            assert ref.sharded
            assert torch.equal(src.load(ref), full["optimizer"]["state"]["inp.weight"]["exp_avg"])
            # the RNG state of a multi-rank save is rank 0's, as load() gives it
            rng = dict(src.leaves("rng"))
            assert torch.equal(src.load(rng[("rng", "torch")]), full["rng"]["torch"])


def test_load_of_a_rank_the_step_holds_no_rng_stream_for_is_refused(mixed_store) -> None:
    # load(3, rank=2) of a step saved by 2 ranks gave rank 0's RNG stream, without a word,
    # where a per-rank step refuses such a rank.
    from ckptstore import StateMismatchError

    root, _ = mixed_store
    with CheckpointManager(root) as mgr:
        streams = [mgr.load(3, rank=r, keys=["rng"])["rng"] for r in (0, 1)]
        assert repr(streams[0]) != repr(streams[1])  # each rank's own
        assert repr(mgr.load(3, keys=["rng"])["rng"]) == repr(streams[0])  # this process: 0
        with pytest.raises(
            StateMismatchError, match=r"'rng' holds the RNG streams of ranks 0\.\.1"
        ):
            mgr.load(3, rank=2)


def test_per_rank_state_is_refused(mixed_store) -> None:
    root, _ = mixed_store
    with CheckpointManager(root) as mgr, pytest.raises(CkptStoreError, match="per-rank state"):
        StepTensors(mgr.storage, 6)


def test_export_hf_dtensor_sharded(mixed_store, tmp_path: Path) -> None:
    root, digests = mixed_store
    with CheckpointManager(root) as mgr:
        expected = mgr.load(3)["model"]
        for step in (3, 4):
            out = tmp_path / f"hf{step}"
            res = export_hf(mgr.storage, step, out, max_shard_size=200)
            names = check_hf_dir(out, expected, 200)
            assert len(names) > 2
            assert res.files == sorted(names, key=lambda n: n == HF_INDEX)
            assert (res.tensors, res.sharding, res.key) == (7, "dtensor", "model")
            assert res.total_size == sum(t.numel() * 4 for t in expected.values())
        # a large tensor alone over the limit gets its own shard
        res = export_hf(mgr.storage, 3, tmp_path / "table", key="table", max_shard_size="1MB")
    assert res.files == [HF_SINGLE]
    assert sha(load_file(str(tmp_path / "table" / HF_SINGLE))["emb"]) == digests["table/emb"]


def test_export_hf_refuses_what_is_not_a_state_dict(mixed_store, tmp_path: Path) -> None:
    root, _ = mixed_store
    with CheckpointManager(root) as mgr:
        for key, match in (("optimizer", "not a tensor"), ("step", "not a state dict")):
            with pytest.raises(CkptStoreError, match=match):
                export_hf(mgr.storage, 3, tmp_path / key, key=key)
        with pytest.raises(CkptStoreError, match="no entry 'nope'"):
            export_hf(mgr.storage, 3, tmp_path / "x", key="nope")
    assert list(tmp_path.iterdir()) == [root]


def test_export_hf_corrupt_chunk_leaves_nothing(mixed_store, tmp_path: Path) -> None:
    root, _ = mixed_store
    chunk = index_chunks(root / step_dir(3), "model/out.weight")[0]
    path = root / step_dir(3) / chunk["file"]
    path.write_bytes(flip_byte(path.read_bytes(), chunk["start"] + 3))
    with CheckpointManager(root) as mgr, pytest.raises(IntegrityError, match="does not match"):
        export_hf(mgr.storage, 3, tmp_path / "hf", max_shard_size=100)
    assert list(tmp_path.iterdir()) == [root]


# ---- replicated checkpoints ------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 50)
        self.proj.weight = self.emb.weight  # tied
        self.norm = nn.LayerNorm(16).to(torch.bfloat16)
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("empty", torch.zeros(0, 3))


def test_export_hf_replicated_every_codec(tmp_path: Path, codec: dict[str, Any]) -> None:
    model = Net()
    ema = EMA(Net(), source=model)
    with torch.no_grad():
        for p in ema.module.parameters():
            p.add_(1.0)
    with CheckpointManager(tmp_path / "s", **codec) as mgr:
        mgr.save(1, {"model": model, "ema": ema, "step": 1})
        expected = {k: v.detach() for k, v in model.state_dict().items()}
        res = export_hf(mgr.storage, 1, tmp_path / "one")
        assert res.sharding == "replicated"
        assert check_hf_dir(tmp_path / "one", expected, 5 * 10**9) == [HF_SINGLE]
        res = export_hf(mgr.storage, 1, tmp_path / "many", max_shard_size="2kB")
        check_hf_dir(tmp_path / "many", expected, 2000)
        assert len(res.files) > 2
        export_hf(mgr.storage, 1, tmp_path / "ema", key="ema")  # an EMA gives its weights
        ema_sd = {k: v.detach() for k, v in ema.module.state_dict().items()}
        check_hf_dir(tmp_path / "ema", ema_sd, 5 * 10**9)
        assert not torch.equal(ema_sd["emb.weight"], expected["emb.weight"])


def test_export_hf_out_dir_rules(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": nn.Linear(3, 2)})
        (tmp_path / "empty").mkdir()
        export_hf(mgr.storage, 1, tmp_path / "empty")  # an empty directory is replaced
        assert (tmp_path / "empty" / HF_SINGLE).is_file()
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "keep.txt").write_text("mine")
        with pytest.raises(FileExistsError, match="not empty"):
            export_hf(mgr.storage, 1, tmp_path / "full")
        assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
        (tmp_path / "file").write_text("x")
        with pytest.raises(FileExistsError, match="not a directory"):
            export_hf(mgr.storage, 1, tmp_path / "file")
        with pytest.raises(FileNotFoundError):
            export_hf(mgr.storage, 1, tmp_path / "no" / "such" / "dir")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_export_hf_failure_midway_leaves_no_out_dir(tmp_path: Path, monkeypatch) -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model})
        calls = []
        real_load = StepTensors.load

        def failing_load(self: StepTensors, ref: Any) -> Any:
            calls.append(ref.path)
            if len(calls) == 5:
                raise OSError(28, "No space left on device (injected)")
            return real_load(self, ref)

        monkeypatch.setattr(StepTensors, "load", failing_load)
        with pytest.raises(OSError, match="injected"):
            export_hf(mgr.storage, 1, tmp_path / "hf", max_shard_size=300)
    assert len(calls) == 5  # shards were already written when it failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_transformers_reads_the_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model})
        for limit in ("20kB", "5GB"):
            out = tmp_path / f"hf-{limit}"
            res = export_hf(mgr.storage, 1, out, max_shard_size=limit)
            assert (len(res.files) > 2) == (limit == "20kB")
            config.save_pretrained(out)
            back = transformers.GPT2LMHeadModel.from_pretrained(out)
            want = model.state_dict()
            got = back.state_dict()
            assert want.keys() == got.keys()
            for k in want:
                assert torch.equal(want[k], got[k]), k


# ---- peak memory -----------------------------------------------------------------------------

#: Four tensors of 48 MiB: a whole-state load holds 192 MiB or more.
ROWS, LAYERS = 12288, 4
LARGEST = ROWS * 1024 * 4

_MEASURE = textwrap.dedent(
    """
    import ctypes, gc, json, sys
    from ckptstore import CheckpointManager
    from ckptstore.sharded.consolidate import StepTensors, export_hf

    root, out = sys.argv[1:3]

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    with CheckpointManager(root) as mgr:
        with StepTensors(mgr.storage, 1) as src:  # warm up: every import, one small tensor
            refs = dict(src.state_dict("model"))
            src.load(refs["bias"])
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
        base = status("VmRSS")
        res = export_hf(mgr.storage, 1, out, max_shard_size="120MB")
        print(json.dumps({"base": base, "peak": status("VmHWM"), "files": res.files}))
    """
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["dtensor", "replicated"])
def test_export_hf_peak_memory_is_bounded_by_the_largest_tensor(
    tmp_path: Path, layout: str
) -> None:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS")
    work = tmp_path / "w"
    if layout == "dtensor":
        from tests.multirank.launch import describe, launch

        results = launch(
            "export_scenarios:big_save", 2, work, timeout=400, args={"rows": ROWS, "n": LAYERS}
        )
        assert all(r.ok for r in results), describe(results)
        digests = results[0].value["digests"]
    else:
        weights = {}
        digests = {}
        for i in range(LAYERS):
            weights[f"layer{i}.weight"] = torch.rand(
                ROWS, 1024, generator=torch.Generator().manual_seed(i)
            )
            digests[f"layer{i}.weight"] = sha(weights[f"layer{i}.weight"])
        weights["bias"] = torch.arange(7, dtype=torch.float32)
        digests["bias"] = sha(weights["bias"])
        with CheckpointManager(work / "store") as mgr:
            mgr.save(1, {"model": weights})
        del weights
    out = tmp_path / "hf"
    # A fixed mmap threshold: large buffers go back to the system when freed, so the peak
    # RSS measures what was alive at once, not what the allocator kept.
    env = {**subprocess_env(), "MALLOC_MMAP_THRESHOLD_": "1048576"}
    cmd = [sys.executable, "-c", _MEASURE, str(work / "store"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    extra = got["peak"] - got["base"]
    print(f"{layout}: peak {extra / 2**20:.0f} MiB over the baseline")  # shown with -s
    assert extra < 3 * LARGEST, f"peak {extra / 2**20:.0f} MiB over the baseline"
    assert len(got["files"]) == 3  # 2 x 2 layers of 48 MiB under 120 MB, + index
    index = json.loads((out / HF_INDEX).read_text())
    assert index["metadata"]["total_size"] == LAYERS * LARGEST + 28
    for shard in sorted(set(index["weight_map"].values())):
        for k, v in load_file(str(out / shard)).items():
            assert sha(v) == digests[k], k

"""DCP reads ckptstore steps: ``export --dcp`` directories and ``CkptStoreReader`` (issue 23)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers import flip_byte, index_chunks, run_cli, step_dir
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from ckptstore import CheckpointManager, CkptStoreError, IntegrityError
from ckptstore.errors import PathExistsError
from ckptstore.ops.export_dcp import DCP_DATA, export_dcp
from ckptstore.storage import open_storage


def sha(t: torch.Tensor) -> str:
    from tests.multirank.dtensor_scenarios import _sha

    return _sha(t)


def dcp_load(out: Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` filled by DCP's own reader and planner, in this process."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(state, storage_reader=FileSystemReader(str(out)), no_dist=True)
    return state


def test_a_dtensor_step_keeps_its_chunks_and_dcp_loads_it_in_one_process(
    mixed_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, digests = mixed_store
    storage = open_storage(root)
    full = CheckpointManager(root).load(3)
    for step in (3, 4, 5):  # FSDP2 on 2 ranks, on 1 rank, and the same values replicated
        out = tmp_path / f"dcp{step}"
        res = export_dcp(storage, step, out)
        assert sorted(p.name for p in out.iterdir()) == [".metadata", DCP_DATA]
        md = FileSystemReader(str(out)).read_metadata()
        chunks = md.state_dict_metadata["model.out.weight"].chunks
        if step == 3:  # the chunks the 2 ranks saved, one DCP item each
            saved = index_chunks(root / step_dir(3), "model/out.weight")
            assert [list(c.offsets) for c in chunks] == [c["offsets"] for c in saved]
            assert [list(c.sizes) for c in chunks] == [c["sizes"] for c in saved]
            assert (res.sharding, res.world_size) == ("dtensor", 2)
        else:
            assert len(chunks) == 1  # one rank, or replicated: one chunk
        assert md.planner_data["model.out.weight"] == ("model", "out.weight")
        # DCP's own reader assembles the full tensors from the chunks.
        model = {k: torch.zeros_like(v) for k, v in full["model"].items()}
        emb = torch.zeros_like(full["table"]["emb"])
        state = dcp_load(out, {"model": model, "table": {"emb": emb}})
        assert {f"model/{k}": sha(v) for k, v in model.items()} == {
            k: v for k, v in digests.items() if k.startswith("model/")
        }, step
        assert sha(state["table"]["emb"]) == digests["table/emb"]
    # The optimizer's moments (stored by parameter name) and the plain values of step 3.
    exp_avg = full["optimizer"]["state"]["inp.weight"]["exp_avg"]
    state = dcp_load(
        tmp_path / "dcp3",
        {"optimizer": {"state": {"inp.weight": {"exp_avg": torch.zeros_like(exp_avg)}}}, "step": 0},
    )
    assert torch.equal(state["optimizer"]["state"]["inp.weight"]["exp_avg"], exp_avg)
    assert state["step"] == 3


@pytest.mark.timeout(180)
def test_fsdp2_on_3_ranks_loads_a_2_rank_step_by_export_and_by_the_storage_reader(
    mixed_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    # The chunks of 2 ranks, read by DCP's own planner on 3 (each rank reads its overlaps):
    # from the export --dcp directory, and straight from the store through CkptStoreReader.
    from tests.multirank.launch import describe, launch

    root, digests = mixed_store
    out = tmp_path / "dcp"
    export_dcp(open_storage(root), 3, out)
    args = {"dcp_dir": str(out), "store": str(root), "step": 3}
    res = launch("export_scenarios:dcp_load_fsdp", 3, tmp_path, timeout=150, args=args)
    assert all(r.ok for r in res), describe(res)
    want = {k: v for k, v in digests.items() if k.startswith("model/")}
    for r in res:
        assert r.value == {"export": want, "store": want}, describe(res)


def test_a_replicated_model_and_optimizer_load_back_through_dcp(
    tmp_path: Path, capsys: Any
) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.float64)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        m(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        return m, opt

    torch.manual_seed(0)
    model, opt = build()
    cfg = {"lr": 0.1, "names": ["a", "b"], "warmup": None}
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt, "step": 7, "cfg": cfg})
    rc, out, _ = run_cli(capsys, "export", tmp_path / "s", "--step", 1, "--dcp", tmp_path / "d")
    assert rc == 0
    assert "exported step 1 (16 tensors in 32 DCP items) to " in out  # 4 + 3 x 4 in AdamW
    torch.manual_seed(1)
    fresh, fopt = build()  # other values; its optimizer state exists, as DCP needs
    blank = {"lr": 0.0, "names": [], "warmup": 1}
    sd = {"model": fresh.state_dict(), "optimizer": fopt.state_dict(), "step": 0, "cfg": blank}
    dcp_load(tmp_path / "d", sd)
    fresh.load_state_dict(sd["model"])
    fopt.load_state_dict(sd["optimizer"])
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    want, got = opt.state_dict(), fopt.state_dict()
    for k, s in want["state"].items():
        assert torch.equal(s["exp_avg_sq"], got["state"][k]["exp_avg_sq"])
    assert got["param_groups"][0]["lr"] == 0.1
    assert (sd["step"], sd["cfg"]) == (7, cfg)


def test_a_corrupt_chunk_leaves_no_directory(
    mixed_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, _ = mixed_store
    chunk = index_chunks(root / step_dir(3), "model/out.weight")[-1]
    path = root / step_dir(3) / chunk["file"]
    path.write_bytes(flip_byte(path.read_bytes(), chunk["start"] + 5))
    out = tmp_path / "dcp"
    with pytest.raises(IntegrityError, match="does not match its crc32c"):
        export_dcp(open_storage(root), 3, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [root.name]  # no tmp, no out


def test_refusals(mixed_store: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any) -> None:
    root, _ = mixed_store
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(PathExistsError, match="exists and is not empty"):
        export_dcp(open_storage(root), 4, busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    rc, _, err = run_cli(capsys, "export", root, "--step", 6, "--dcp", tmp_path / "x")
    assert rc != 0
    assert "per-rank state saved with sharded=True by 2 ranks" in err
    for extra in (["--hf"], ["--force"], ["--key", "model"]):
        rc, _, err = run_cli(capsys, "export", root, "--step", 4, "--dcp", tmp_path / "y", *extra)
        assert rc == 2, extra
        assert "--dcp" in err
    assert not (tmp_path / "x").exists()
    assert not (tmp_path / "y").exists()
    # An empty directory is taken; --json reports what was written.
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, _ = run_cli(capsys, "export", root, "--step", 4, "--dcp", empty, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert (doc["step"], doc["sharding"], doc["world_size"]) == (4, "dtensor", 1)
    assert doc["items"] > doc["tensors"] > 0


def test_colliding_dcp_names_are_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"a": {"b.c": torch.ones(2), "b": {"c": torch.zeros(2)}}})
    with pytest.raises(CkptStoreError, match=r"have the same DCP name 'a\.b\.c'"):
        export_dcp(open_storage(tmp_path / "s"), 1, tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_dcp_names_and_leaves_are_the_ones_dcp_save_gives(tmp_path: Path) -> None:
    # DCP's flattening names a dict key by its str (ints in a path are list indices only),
    # takes a tuple whole, and a list whole unless it holds a tensor, a dict or such a list.
    # Int keys went into planner_data as ints: every reader that rebuilds the state from it
    # (dcp_to_torch_save, `ckptstore import`, DCP's load-everything path) made {3: "c"} a
    # list and an optimizer's state a list. Tuples, lists of lists and RNGState (tuples of
    # Python's and numpy's RNG) were cut into x.0, x.1: dcp.load found no "x".
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from ckptstore import RNGState
    from ckptstore.dcp import CkptStoreReader
    from ckptstore.ops.importers import import_file

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    extra = {
        "vocab": {3: "c", 1: "a"},
        "pair": (torch.arange(2.0), 7),
        "grid": [[1, 2], [3, 4]],
        "mixed": [torch.ones(2), {"k": 1}],
        "empty": {},
    }
    root = tmp_path / "s"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "optim": opt, "extra": extra, "rng": RNGState()})
    out = tmp_path / "d"
    export_dcp(open_storage(root), 1, out)
    # What dcp.save writes for the same state, side by side: the same names and paths.
    native = tmp_path / "native"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra},
            storage_writer=dcp.FileSystemWriter(str(native)),
            no_dist=True,
        )
    ours = FileSystemReader(str(out)).read_metadata().planner_data
    theirs = FileSystemReader(str(native)).read_metadata().planner_data
    assert {k: tuple(v) for k, v in ours.items() if not k.startswith("rng.")} == {
        k: tuple(v) for k, v in theirs.items()
    }
    assert ours["extra.vocab.3"] == ("extra", "vocab", "3")
    assert ours["extra.mixed.1.k"] == ("extra", "mixed", 1, "k")
    # dcp.load of each leaf DCP names, through the export and through the reader.
    for reader in (FileSystemReader(str(out)), CkptStoreReader(root, step=1)):
        state: dict[str, Any] = {
            "extra": {"pair": (torch.zeros(2), 0), "grid": [], "vocab": {"3": "", "1": ""}},
            "rng": RNGState(),
        }
        quiet_load(state, reader)
        assert torch.equal(state["extra"]["pair"][0], torch.arange(2.0))
        assert state["extra"]["pair"][1] == 7
        assert state["extra"]["grid"] == [[1, 2], [3, 4]]
        assert state["extra"]["vocab"] == {"3": "c", "1": "a"}
    # Rebuilt from planner_data: dicts stay dicts, the optimizer loads.
    whole = _load_state_dict_from_keys(storage_reader=CkptStoreReader(root, step=1))
    assert whole["extra"]["vocab"] == {"3": "c", "1": "a"}
    assert isinstance(whole["optim"]["state"], dict)
    dcp_to_torch_save(str(out), str(tmp_path / "via-torch.pt"))
    via = torch.load(tmp_path / "via-torch.pt", weights_only=False)  # the RNG's numpy arrays
    assert isinstance(via["optim"]["state"], dict)
    import_file(str(out), tmp_path / "imported", 1)
    fresh = nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "imported") as mgr:
        mgr.restore({"model": fresh, "optim": fresh_opt}, strict=False)
    assert torch.equal(fresh.weight, model.weight)
    got = fresh_opt.state_dict()["state"]
    assert torch.equal(got[0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # Both imports read the RNG's numpy arrays (DCP bytes items), as they read a .pt's.
    from ckptstore.ops.import_dcp import import_dcp_sharded

    import_dcp_sharded(str(out), tmp_path / "sharded", 1)
    for where in ("imported", "sharded"):
        with CheckpointManager(tmp_path / where) as mgr:
            loaded = mgr.load(1)
            assert mgr.verify(1).ok, where
        assert loaded["extra"]["vocab"] == {"3": "c", "1": "a"}, where
        # The tuple's tensor: a DCP bytes item, kept in a payload file by --sharded.
        assert torch.equal(loaded["extra"]["pair"][0], torch.arange(2.0)), where
        assert loaded["extra"]["grid"] == [[1, 2], [3, 4]], where
        assert str(loaded["rng"]["numpy"][1].dtype) == "uint32", where


def test_an_int_key_and_its_str_are_one_dcp_name_and_refused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"m": {1: torch.ones(2), "1": torch.zeros(2)}})
    with pytest.raises(CkptStoreError, match=r"have the same DCP name 'm\.1'"):
        export_dcp(open_storage(tmp_path / "s"), 1, tmp_path / "d")


# ---- CkptStoreReader: dcp.load straight from a store ------------------------------------------


def quiet_load(state: dict[str, Any], reader: Any) -> None:
    """``dcp.load`` in this process, without its "single process" warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)


def test_dcp_loads_a_step_through_the_storage_reader_in_one_process(
    mixed_store: tuple[Path, dict[str, Any]],
) -> None:
    from ckptstore.dcp import CkptStoreReader

    root, digests = mixed_store
    full = CheckpointManager(root).load(3)
    want = {k: v for k, v in digests.items() if k.startswith("model/")}
    for step in (3, 4, 5):  # DTensor of 2 ranks, of 1 rank, replicated
        model = {k: torch.zeros_like(v) for k, v in full["model"].items()}
        exp_avg = torch.zeros_like(full["optimizer"]["state"]["inp.weight"]["exp_avg"])
        state = {
            "model": model,
            "table": {"emb": torch.zeros_like(full["table"]["emb"])},
            "step": 0,
        }
        if step != 5:  # the replicated optimizer is keyed by index, as its state_dict() is
            state["optimizer"] = {"state": {"inp.weight": {"exp_avg": exp_avg}}}
        quiet_load(state, CkptStoreReader(root, step=step))
        assert {f"model/{k}": sha(v) for k, v in model.items()} == want, step
        assert sha(state["table"]["emb"]) == digests["table/emb"]
        assert state["step"] == 3
        if step != 5:
            assert torch.equal(exp_avg, full["optimizer"]["state"]["inp.weight"]["exp_avg"])


def test_a_flipped_byte_fails_the_dcp_load_naming_the_chunk(
    mixed_store: tuple[Path, dict[str, Any]],
) -> None:
    from ckptstore.dcp import CkptStoreReader

    root, _ = mixed_store
    chunk = index_chunks(root / step_dir(3), "table/emb")[0]
    path = root / step_dir(3) / chunk["file"]
    path.write_bytes(flip_byte(path.read_bytes(), chunk["start"] + 4096 * 1024 + 9))
    with pytest.raises(CheckpointException) as info:
        quiet_load({"table": {"emb": torch.zeros(2560, 1024)}}, CkptStoreReader(root, step=3))
    assert "IntegrityError" in str(info.value)
    assert "does not match its crc32c; the file is corrupt" in str(info.value)
    # The store's other steps still load.
    emb4 = torch.zeros(2560, 1024)
    quiet_load({"table": {"emb": emb4}}, CkptStoreReader(root, step=4))
    assert emb4.abs().sum() > 0


def test_checkpoint_id_names_the_store_and_the_newest_step_is_read(tmp_path: Path) -> None:
    from ckptstore.dcp import CkptStoreReader

    with CheckpointManager(tmp_path / "s") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((3,), float(step)), "step": step})
    assert CkptStoreReader.validate_checkpoint_id(tmp_path / "s")
    assert not CkptStoreReader.validate_checkpoint_id(tmp_path / "nothing")
    state = {"w": torch.zeros(3), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            state, checkpoint_id=tmp_path / "s", storage_reader=CkptStoreReader(), no_dist=True
        )
    assert torch.equal(state["w"], torch.full((3,), 2.0))
    assert state["step"] == 2


def test_the_storage_reader_reads_a_step_on_s3(s3: Any) -> None:
    # An fsspec root: the chunks are ranged GETs, each checked like a local read.
    from ckptstore.dcp import CkptStoreReader

    url = s3.url(s3.unique_prefix())
    with CheckpointManager(url, storage_options=s3.storage_options) as mgr:
        mgr.save(4, {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "epoch": 2})
    state = {"model": {"w": torch.zeros(3, 4)}, "epoch": 0}
    quiet_load(state, CkptStoreReader(url, storage_options=s3.storage_options))
    assert torch.equal(state["model"]["w"], torch.arange(12.0).reshape(3, 4))
    assert state["epoch"] == 2

"""CUDA paths of a save and a restore, checked and timed on a machine with a GPU.

    python tools/gpu_check.py [--gb 1.0] [--json OUT]

Not part of ``make test`` (CI has no GPU). On one GPU, with a model and AdamW state on it:

1. ``torch.save`` of the model's state dict (+ fsync) as the baseline, then ckptstore's
   synchronous save of model and optimizer, and an async save: how long ``save()`` blocks
   (copying the GPU tensors out) and how long until the step is committed;
2. restore into a fresh model and optimizer on the GPU: every tensor bit-exact, on its own
   device;
3. an FSDP2 save on a one-rank NCCL process group (DTensors on the GPU), restored in the same
   process into a plain GPU model: the resharded read path with CUDA targets;
4. an FSDP2 model + AdamW saved from the GPU and restored into FSDP2 on the GPU, the old way
   (box by box into fresh GPU tensors) beside reads by runs into the targets' own memory
   (``fsdp_into_fsdp``), each restore from a dropped page cache, ``cat`` of the files as
   the disk's figure; then the model alone through DCP's ``load`` with ``CkptStoreReader``,
   both ways;
5. synchronous saves of that FSDP2 model + AdamW from the GPU, copied out with ``.cpu()``
   per box (before) and through the pinned staging buffers, beside DCP's ``save`` and
   ``dd`` (``fsdp_save_ab``); async saves of it: how long ``save()`` blocks, and until
   committed (``fsdp_async``).

``--only fsdp`` runs 4 and 5 alone.

Prints one JSON document (also written to ``--json``); exits 1 if a value differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]


def build(gb: float, seed: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    width = 4096
    layers = max(1, int(gb * (1 << 30) / (width * width * 4)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=True) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width, device="cuda")).sum().backward()
    opt.step()
    return model, opt


def same(a: Any, b: Any) -> list[str]:
    import torch

    bad = [
        k
        for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True)
        if not (torch.equal(x, y) and x.device == y.device)
    ]
    return bad


def opt_same(a: Any, b: Any) -> bool:
    import torch

    for (_, sa), (_, sb) in zip(a.state.items(), b.state.items(), strict=True):
        for k in sa:
            if isinstance(sa[k], torch.Tensor) and not torch.equal(sa[k].cpu(), sb[k].cpu()):
                return False
    return True


def build_fsdp(gb: float, seed: int, mesh: Any) -> tuple[Any, Any]:
    """An FSDP2 model of ``min(gb, 0.5)`` GiB on ``mesh`` and an AdamW that took a step."""
    import torch
    from torch.distributed.fsdp import fully_shard

    model, _ = build(min(gb, 0.5), seed)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 4096, device="cuda")).sum().backward()
    opt.step()
    return model, opt


def fsdp_save_ab(out: dict[str, Any], base: Path, gb: float, mesh: Any) -> bool:
    """Synchronous saves of an FSDP2 model + AdamW from the GPU, side by side, alternating.

    ``old``: each box copied out with ``.cpu()`` into fresh pageable memory (the save before
    session 23: ``save.plan._on_gpu`` made to say no); ``new``: through the manager's reused
    pinned staging buffers; ``dcp``: ``torch.distributed.checkpoint.save`` of the model's
    and optimizer's state dicts; ``raw``: ``dd`` of as many bytes with ``O_DIRECT`` and an
    fsync. A first round warms each (the staging buffers pinned: ``new_first_s``), three
    are timed. The last ``new`` and ``old`` steps are restored and checked bit-exact.
    """
    import shutil
    import subprocess

    import torch
    from torch.distributed.checkpoint.state_dict_saver import save as save_dcp

    from ckptstore import CheckpointManager
    from ckptstore.save import plan as save_plan

    model, opt = build_fsdp(gb, 6, mesh)
    state = {"model": model, "optimizer": opt}
    real = save_plan._on_gpu
    ways = ("old", "new", "dcp", "raw")
    roots = {way: base / f"save-{way}" for way in ways}
    for r in roots.values():
        r.mkdir(parents=True, exist_ok=True)
    mgrs = {w: CheckpointManager(roots[w], keep=None) for w in ("old", "new")}
    times: dict[str, list[float]] = {w: [] for w in ways}
    count = 0
    try:
        for rnd in range(4):
            for way in ways:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if way in mgrs:
                    never = lambda boxes, groups: False  # noqa: E731 - the save before
                    save_plan._on_gpu = real if way == "new" else never
                    try:
                        mgrs[way].save(rnd + 1, state)
                    finally:
                        save_plan._on_gpu = real
                elif way == "dcp":
                    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
                    save_dcp(sd, checkpoint_id=str(roots["dcp"] / f"r{rnd}"))
                else:
                    argv = ["dd", "if=/dev/zero", f"of={roots['raw'] / f'r{rnd}'}", "bs=8M"]
                    argv += [f"count={count}", "oflag=direct", "conv=fsync", "status=none"]
                    subprocess.run(argv, check=True)
                took = time.perf_counter() - t0
                if rnd:
                    times[way].append(took)
                elif way == "new":
                    out["fsdp_opt_save_new_first_s"] = took
                    files = [f for f in roots["new"].rglob("*") if f.is_file()]
                    count = -(-sum(f.stat().st_size for f in files) // (8 << 20))
            for way in ("dcp", "raw"):  # their files go: what is written stays on the disk
                for f in roots[way].iterdir():
                    shutil.rmtree(f) if f.is_dir() else f.unlink()
        out["fsdp_opt_save_s"] = times
        out["fsdp_opt_save_raw_bytes"] = count << 23
        want = [t.to_local().clone() for t in model.state_dict().values()]
        bad = []
        for way, mgr in mgrs.items():
            into, iopt = build_fsdp(gb, 7, mesh)
            mgr.restore({"model": into, "optimizer": iopt}, step=4)
            got = [t.to_local() for t in into.state_dict().values()]
            if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                bad.append(way)
        out["fsdp_opt_save_mismatches"] = bad
    finally:
        for mgr in mgrs.values():
            mgr.close()
        for r in roots.values():
            shutil.rmtree(r, ignore_errors=True)
    return not bad


def fsdp_async(out: dict[str, Any], base: Path, gb: float, mesh: Any) -> bool:
    """Async saves of the FSDP2 model + AdamW from the GPU: how long ``save()`` blocks (the
    device-to-host copies into the pinned staging buffers) and how long until committed,
    after one warm save; the last step restored bit-exact.

    Written in session 23 after that session's last GPU run: not yet run on a GPU.
    """
    import shutil

    import torch

    from ckptstore import CheckpointManager

    model, opt = build_fsdp(gb, 8, mesh)
    root = base / "async-fsdp"
    blocks: list[float] = []
    commits: list[float] = []
    with CheckpointManager(root, keep=2, async_save=True) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
        mgr.wait()
        for step in (2, 3, 4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mgr.save(step, {"model": model, "optimizer": opt})
            blocks.append(time.perf_counter() - t0)
            mgr.wait()
            commits.append(time.perf_counter() - t0)
    out["fsdp_async_blocking_s"] = blocks
    out["fsdp_async_commit_s"] = commits
    want = [t.to_local().clone() for t in model.state_dict().values()]
    into, iopt = build_fsdp(gb, 9, mesh)
    with CheckpointManager(root) as mgr:
        mgr.restore({"model": into, "optimizer": iopt})
    got = [t.to_local() for t in into.state_dict().values()]
    ok = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    out["fsdp_async_ok"] = ok
    shutil.rmtree(root, ignore_errors=True)
    return ok


def fsdp_into_fsdp(out: dict[str, Any], base: Path, gb: float, mesh: Any) -> bool:
    """FSDP2 model + AdamW saved from the GPU, restored into a fresh FSDP2 model + AdamW
    on the GPU (DTensor targets on CUDA), the page cache dropped before each restore.

    Side by side, alternating: ``old`` (GPU targets read box by box into fresh GPU tensors,
    then copied: ``extents.DEVICES`` empty), and by runs with ``io="direct"`` and
    ``io="buffered"`` (into the targets' own memory); ``raw``: ``cat`` of the step's files
    at the same cache state. Every restore is checked bit-exact."""
    import subprocess

    import torch
    from benchkit.disk import drop_cache

    from ckptstore import CheckpointManager
    from ckptstore.sharded import extents

    model, opt = build_fsdp(gb, 4, mesh)
    root = base / "fsdp-opt"
    with CheckpointManager(root, keep=None) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
    want = [t.to_local().clone() for t in model.state_dict().values()]
    want += [v.to_local().clone() for st in opt.state.values() for v in st.values() if v.dim() > 0]
    files = sorted(str(f) for f in root.rglob("*") if f.is_file())
    out["fsdp_opt_bytes"] = sum(Path(f).stat().st_size for f in files)
    times: dict[str, list[float]] = {"old": [], "direct": [], "buffered": [], "raw": []}
    bad: list[str] = []
    devices = extents.DEVICES
    into, iopt = build_fsdp(gb, 5, mesh)
    for _ in range(3):
        for way, took in times.items():
            drop_cache(root)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if way == "raw":
                subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
            else:
                extents.DEVICES = frozenset() if way == "old" else devices
                io = "buffered" if way == "old" else way
                with CheckpointManager(root, storage_options={"io": io}) as mgr:
                    mgr.restore({"model": into, "optimizer": iopt})
                torch.cuda.synchronize()
            took.append(time.perf_counter() - t0)
            extents.DEVICES = devices
            if way != "raw":
                got = [t.to_local() for t in into.state_dict().values()]
                got += [v.to_local() for st in iopt.state.values() for v in st.values() if v.dim()]
                if len(got) != len(want) or not all(
                    torch.equal(a, b) and a.device.type == "cuda"
                    for a, b in zip(got, want, strict=True)
                ):
                    bad.append(way)
                with torch.no_grad():
                    for t in got:  # the next restore must write every byte again
                        t.fill_(-1.0)
    out["fsdp_opt_restore_s"] = times
    out["fsdp_opt_restore_mismatches"] = bad
    # The model alone through DCP's own load (torchtitan's way): CkptStoreReader.
    from torch.distributed.checkpoint.state_dict_loader import load as load_dcp

    from ckptstore.dcp import CkptStoreReader

    n = len(into.state_dict())
    dtimes: dict[str, list[float]] = {"old": [], "direct": [], "buffered": []}
    for _ in range(3):
        for way, took in dtimes.items():
            drop_cache(root)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            extents.DEVICES = frozenset() if way == "old" else devices
            try:
                reader = CkptStoreReader(
                    root, step=1, storage_options={"io": "buffered" if way == "old" else way}
                )
                load_dcp({"model": into.state_dict()}, storage_reader=reader)
                torch.cuda.synchronize()
            finally:
                extents.DEVICES = devices
            took.append(time.perf_counter() - t0)
            got = [t.to_local() for t in into.state_dict().values()]
            if not all(torch.equal(a, b) for a, b in zip(got, want[:n], strict=True)):
                bad.append(f"dcp-{way}")
            with torch.no_grad():
                for t in got:
                    t.fill_(-1.0)
    out["fsdp_model_dcp_load_s"] = dtimes
    out["fsdp_opt_restore_mismatches"] = bad
    return not bad


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="parameter bytes (AdamW adds twice)")
    p.add_argument("--json", metavar="OUT")
    p.add_argument(
        "--only",
        choices=["all", "fsdp"],
        default="all",
        help="fsdp: only the FSDP2 comparisons (fsdp_save_ab, fsdp_async, fsdp_into_fsdp)",
    )
    args = p.parse_args()
    if args.only == "fsdp":
        return fsdp_only(args.gb, args.json)
    from ckptstore import CheckpointManager

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    base = Path(tempfile.mkdtemp(prefix="ckpt-gpu-", dir=os.environ.get("TMPDIR", "/tmp")))
    model, opt = build(args.gb, 0)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    out["param_bytes"] = nbytes

    def timed(fn: Any) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def torch_save() -> None:
        path = base / "torch.pt"
        torch.save(model.state_dict(), path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    out["torch_save_model_s"] = timed(torch_save)
    # The synchronous save before it staged GPU tensors in reused pinned buffers: .cpu()
    # per tensor, into fresh pageable memory (measured here side by side, same run).
    from unittest import mock

    from ckptstore.save import pipeline
    from ckptstore.save.encode import encode as real_encode

    def cpu_copies(*a: Any, **kw: Any) -> Any:
        return real_encode(*a, **dict(kw, device_staging=None))

    with mock.patch.object(pipeline, "encode", cpu_copies):
        mgr = CheckpointManager(base / "sync-cpu", keep=1)
        for i in (1, 2):
            out[f"ckpt_save_model_opt_cpu_copies_{i}_s"] = timed(
                lambda i=i: mgr.save(i, {"model": model, "optimizer": opt})
            )
        mgr.close()
    # The first save pins its staging buffers; the next ones of the same layout reuse them.
    mgr = CheckpointManager(base / "sync", keep=None)
    out["ckpt_save_model_opt_s"] = timed(lambda: mgr.save(1, {"model": model, "optimizer": opt}))
    out["ckpt_save_model_opt_again_s"] = timed(
        lambda: mgr.save(2, {"model": model, "optimizer": opt})
    )
    out["ckpt_save_model_only_s"] = timed(lambda: mgr.save(3, {"model": model}))
    mgr.close()
    amgr = CheckpointManager(base / "async", keep=2, async_save=True)
    amgr.save(1, {"model": model, "optimizer": opt})  # warm: the staging buffers
    amgr.wait()
    out["ckpt_async_blocking_s"] = timed(lambda: amgr.save(2, {"model": model, "optimizer": opt}))
    out["ckpt_async_commit_s"] = out["ckpt_async_blocking_s"] + timed(amgr.wait)
    amgr.close()

    fresh, fopt = build(args.gb, 1)

    def torch_load() -> None:
        fresh.load_state_dict(torch.load(base / "torch.pt", map_location="cuda"))

    out["torch_load_model_s"] = timed(torch_load)
    with CheckpointManager(base / "sync") as rmgr:
        out["ckpt_restore_model_only_s"] = timed(lambda: rmgr.restore({"model": fresh}))
        out["ckpt_restore_s"] = timed(
            lambda: rmgr.restore({"model": fresh, "optimizer": fopt}, step=2)
        )
    out["restore_mismatches"] = same(model, fresh)
    out["optimizer_equal"] = opt_same(opt, fopt)
    ok = not out["restore_mismatches"] and out["optimizer_equal"]

    # FSDP2 on a one-rank NCCL group: DTensors on the GPU, restored into a plain GPU model.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    sharded, _ = build(min(args.gb, 0.5), 2)
    mesh = init_device_mesh("cuda", (1,))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    dmgr = CheckpointManager(base / "fsdp", keep=None)
    out["fsdp_save_s"] = timed(lambda: dmgr.save(1, {"model": sharded}))
    dmgr.close()
    want = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    ok = fsdp_parts(out, base, args.gb, mesh) and ok
    dist.destroy_process_group()
    plain, _ = build(min(args.gb, 0.5), 3)
    with CheckpointManager(base / "fsdp") as fmgr:
        out["fsdp_restore_plain_s"] = timed(lambda: fmgr.restore({"model": plain}))
    got = plain.state_dict()
    out["fsdp_mismatches"] = [
        k for k in want if not (torch.equal(want[k], got[k]) and got[k].device.type == "cuda")
    ]
    ok = ok and not out["fsdp_mismatches"]
    out["ok"] = ok
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if ok else 1


def fsdp_parts(out: dict[str, Any], base: Path, gb: float, mesh: Any) -> bool:
    """Parts 4 and 5, each on its own: one that fails is reported (``<part>_error``) and
    the others still run."""
    ok = True
    for part in (fsdp_save_ab, fsdp_async, fsdp_into_fsdp):
        try:
            ok = part(out, base, gb, mesh) and ok
        except Exception as e:
            out[f"{part.__name__}_error"] = repr(e)
            ok = False
    return ok


def fsdp_only(gb: float, json_out: str | None) -> int:
    """The FSDP2 comparisons alone, on a one-rank NCCL group (``--only fsdp``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    base = Path(tempfile.mkdtemp(prefix="ckpt-gpu-", dir=os.environ.get("TMPDIR", "/tmp")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        ok = fsdp_parts(out, base, gb, mesh)
    finally:
        dist.destroy_process_group()
    out["ok"] = ok
    text = json.dumps(out, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

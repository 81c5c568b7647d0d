"""The sharded part of tools/bench.py: FSDP2 saves on 2 and 4 ranks, restores 2->1, 2->3, 4->2.

Each save job's first round of checkpoints is kept and restored on other world sizes: the
2-rank save on 1 process and on 3 ranks, the 4-rank save (one round: 4 ranks on this
machine's cores are slow, and its save figures are a side product) on 2 ranks.

Three contenders, side by side, interleaved round-robin inside each job:

- ``ckpt``: ``CheckpointManager.save(1, {"model": fsdp_model, "optimizer": opt})`` on every
  rank; restore with ``CheckpointManager(root).restore(state)`` (on 1 process without a
  process group, into a plain model and a fresh AdamW; on 3 ranks into a fresh FSDP2 model
  and a fresh AdamW).
- ``dcp``: ``get_state_dict(model, opt)`` then ``dcp.save`` with
  ``FileSystemWriter(sync_files=True)`` (plus an fsync of ``.metadata`` and the directory);
  restore with ``get_state_dict``, ``dcp.load`` in place and ``set_state_dict``, into the
  same fresh targets.
- ``dcp-ckpt``: DCP's API over ckptstore: ``get_state_dict`` then ``dcp.save`` with
  ``ckptstore.dcp.CkptStoreWriter`` (``mgr.save`` inside DCP's planning; ckptstore's group
  for DCP's collectives), first save of a fresh manager; restore with ``get_state_dict``,
  ``dcp.load`` with ``CkptStoreReader`` and ``set_state_dict``, into the same fresh targets.
- ``ckpt-again`` (save only): the second save of one manager (the first, untimed, planned
  the layout): what a training job sees from its second checkpoint on. ``ckpt`` is the
  first save of a fresh manager, planning included; both are reported.
- ``raw``: every rank writes its own local bytes of the state (the same byte count as its
  shards) with O_DIRECT from one aligned buffer, split over as many files as ckptstore
  writes (``sharding.split_parts``: up to 4 a rank), written concurrently, each fsynced,
  then the directory; restore reads the same bytes with O_DIRECT, split over the
  restoring ranks as evenly as the files allow (1 process reads everything, each of 3
  ranks a third).

A job is a set of processes, one a rank, forked by a server (``tools/rankserver.py``)
that imported torch, FSDP2, DCP, ckptstore and this module once for the whole run, as a
fresh interpreter imports them before any timed operation (2 to 7 s of CPU a process);
each has RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in its environment (no torchrun).
Timings start after a barrier and stop after the barrier that follows the operation, so
each is the time until the slowest rank is done; building the model and optimizer,
constructing managers and dropping the page cache are untimed. Every process runs one
intra-op thread (``OMP_NUM_THREADS=1``, as torchrun sets it). Before every restore, every
file of the checkpoint is fsynced and evicted with ``posix_fadvise(DONTNEED)`` (checked
with ``mincore``), as the rest of the bench does. Before the first timed restore, the
ranks restore the ``ckpt`` state twice, untimed: ``io="auto"`` tries each read mode once
(``storage/iomode.py``), and a machine's cache holds both figures once it has restored
before; timed, those trials put one round of the slower mode among the medians. After
every restore, float64 sums of
the model parameters and of both AdamW moments are compared with those of the saved state
(the restore really loaded every byte, or the bench fails). Each ckptstore save's and
restore's phases (``last_save_phases``, ``last_restore_phases``: wall and CPU seconds per
phase on each rank) are printed under the table, medians per rank.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import shutil
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rankserver import RankServer
from rendezvous import reserved_port  # tools/: a port held for the job
from torch import nn

from benchkit import harness
from benchkit.disk import drop_cache, du, fsync_dir, fsync_tree, huge_share
from benchkit.harness import log
from benchkit.sharded_raw import Raw, raw_spans
from benchkit.sharded_targets import targets
from benchkit.sharded_trace import decided, phase_medians, print_phases, record, record_restore
from benchkit.state import N_LAYER, GPT2Like, Shape
from benchkit.units import GB, fmt, human
from ckptstore.storage import iomode

TOOLS = Path(__file__).resolve().parent.parent
REPO = TOOLS.parent

CONTENDERS = ("raw", "dcp", "ckpt", "dcp-ckpt")
#: Save-only rows, timed in the ``ckpt`` turn of each round (see ``save_job``).
SAVE_ONLY = ("ckpt-again",)
#: Restore-only contenders, interleaved with the others in each restore round, reading files
#: of their own (the raw save's bytes, written again untimed): the virtual disk's own cache
#: serves a read of bytes just read sooner, so no two contenders share files.
RESTORE_ONLY = ("raw-fresh", "raw-checked", "raw-checked-buffered")
#: Restore-only contenders of ckptstore, read from files of their own (the ckpt save's
#: state written again untimed), interleaved with the others where ``ckpt`` runs.
CKPT_RESTORE_ONLY = ("ckpt-live",)
SAVE_WORLD = 2
RESTORE_WORLDS = (1, 3)
#: A second save, on 4 ranks, restored on these world sizes (one round of saves).
SAVE_WORLD_4 = 4
RESTORE_WORLDS_4 = (2,)
OPS = ("save-2", "save-4", "restore-2to1", "restore-2to3", "restore-4to2")
DESCRIPTIONS = {
    "raw": "each rank O_DIRECT-writes its local state bytes from one aligned buffer (on huge "
    "pages where the kernel gives them: the disk's best) into as many files as ckptstore "
    "writes (concurrently) + fsync each + fsync dir; restore O_DIRECT-reads the same bytes "
    "split over the restoring ranks, into such buffers",
    "dcp": "get_state_dict + dcp.save(FileSystemWriter(sync_files=True)) + fsync of "
    ".metadata and directory; restore get_state_dict + dcp.load in place + set_state_dict",
    "ckpt": "CheckpointManager.save on every rank (FSDP2 DTensor state), first save of a "
    "fresh manager; restore CheckpointManager.restore (1 process: no process group, plain "
    "model)",
    "dcp-ckpt": "get_state_dict + dcp.save(storage_writer=ckptstore.dcp.CkptStoreWriter) on "
    "every rank (a fresh manager's first save); restore get_state_dict + "
    "dcp.load(CkptStoreReader) + set_state_dict",
    "raw-fresh": "the raw restore's O_DIRECT reads, each into new untouched memory (the "
    "floor of a restore into new tensors: the kernel faults in every page); a restore "
    "contender of its own, interleaved with the others",
    "raw-checked": "the raw restore's O_DIRECT reads into reused aligned buffers, each "
    "CRC32C-checked there and copied into touched memory PyTorch allocated (64 bytes past a "
    "page: O_DIRECT cannot read into it): the least work of a checked restore into live "
    "tensors, ckpt-live's floor; a restore contender of its own, interleaved",
    "raw-checked-buffered": "the same bytes read without O_DIRECT (readahead, one kernel copy) "
    "straight into touched PyTorch memory and CRC32C-checked there: the other way to that "
    "floor; a restore contender of its own, interleaved",
    "ckpt-live": "CheckpointManager.restore into a model that is already initialized and an "
    "optimizer that has taken a step (every target exists and is touched: the resume of a "
    "job that built its model first), from files of its own (the same state saved again, "
    "untimed)",
    "ckpt-again": "the second CheckpointManager.save of one manager (same layout: the save "
    "plan is reused), the first one untimed",
}


# ---- the state ---------------------------------------------------------------------------------


def build(
    param_bytes: int, world: int, *, init: bool, n_layer: int = N_LAYER
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The bench's GPT-2-like model (``benchkit.state``), FSDP2-sharded when ``world > 1``,
    and a fresh AdamW.

    With ``init`` the weights are random and the optimizer has taken one real step (the
    state that is saved); without, the tensors are allocated but untouched (restore targets).
    """
    shape = Shape.for_bytes(param_bytes, n_layer)
    with torch.device("meta"):
        model = GPT2Like(shape)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if init:
        gen = torch.Generator().manual_seed(1 + rank_of())
        with torch.no_grad():
            for p in model.parameters():
                local(p).normal_(0.0, 0.02, generator=gen)
        for p in model.parameters():
            p.grad = p.detach().clone().mul_(1e-3)
        opt.step()
        for p in model.parameters():
            p.grad = None
    return model, opt


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [local(p.detach()) for p in model.parameters()]
    for st in opt.state.values():
        out += [local(v) for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def sums(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    """float64 sums of this rank's parameters, exp_avg and exp_avg_sq, summed over ranks."""
    acc = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            acc[0] += local(p.detach()).double().sum()
            st = opt.state.get(p, {})
            if "exp_avg" in st:
                acc[1] += local(st["exp_avg"]).double().sum()
                acc[2] += local(st["exp_avg_sq"]).double().sum()
    if dist_on():
        import torch.distributed as dist

        dist.all_reduce(acc)
    return [float(x) for x in acc]


# ---- process group helpers ---------------------------------------------------------------------


def dist_on() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_of() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist_on() else 0


def world_of() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist_on() else 1


def barrier() -> None:
    if dist_on():
        import torch.distributed as dist

        dist.barrier()


def settle_all() -> None:
    harness.settle()
    barrier()


def timed(fn: Any) -> float:
    """Barrier, run ``fn`` on every rank, barrier: the time until the slowest rank is done."""
    settle_all()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


# ---- the jobs (one process per rank) -----------------------------------------------------------


def nothing() -> None:
    """No clean-up."""


def save_op(
    c: str, d: Path, model: nn.Module, opt: torch.optim.Optimizer, *, raw: Raw | None, nbytes: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The timed part of contender ``c``'s save into ``d`` (run on every rank), and its
    untimed clean-up."""
    rank = rank_of()
    if c == "ckpt":
        from ckptstore import CheckpointManager

        mgr = CheckpointManager(d, keep=None, barrier_timeout=3600)  # collective, untimed

        def ckpt() -> None:
            mgr.save(1, {"model": model, "optimizer": opt})

        def again() -> None:
            mgr.save(2, {"model": model, "optimizer": opt})

        def done() -> None:
            if rank == 0:  # untimed: the store holds one checkpoint, as the others do
                mgr.delete(1)
            mgr.close()

        ckpt.again = again  # type: ignore[attr-defined]
        ckpt.manager = mgr  # type: ignore[attr-defined]
        return ckpt, done
    if c == "dcp-ckpt":
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save as save_dcp

        from ckptstore import CheckpointManager
        from ckptstore.dcp import CkptStoreWriter

        mgr = CheckpointManager(d, keep=None, barrier_timeout=3600)  # collective, untimed
        writer = CkptStoreWriter(mgr, step=1)

        def dcp_ckpt_save() -> None:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            save_dcp(state, storage_writer=writer, process_group=writer.process_group)

        return dcp_ckpt_save, mgr.close
    if c == "dcp":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save as save_dcp

        def dcp_save() -> None:
            msd, osd = get_state_dict(model, opt)
            writer = FileSystemWriter(str(d), sync_files=True)
            save_dcp({"model": msd, "optim": osd}, storage_writer=writer)
            barrier()
            if rank == 0:
                fsync_tree(d)  # .metadata and the directory: durable

        return dcp_save, nothing
    assert raw is not None

    def raw_save() -> None:
        raw.write_parts(d, rank, nbytes)
        barrier()
        if rank == 0:
            fsync_dir(d)

    return raw_save, nothing


def restore_op(
    c: str,
    d: Path,
    model: nn.Module | None,
    opt: torch.optim.Optimizer | None,
    *,
    raw: Raw | None,
    raw_bytes: list[int],
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The timed part of contender ``c``'s restore from ``d`` (run on every rank), and its
    untimed clean-up."""
    if c in ("ckpt", "ckpt-live"):
        from ckptstore import CheckpointManager

        mgr = CheckpointManager(d, keep=None, barrier_timeout=3600)  # collective, untimed

        def ckpt() -> None:
            mgr.restore({"model": model, "optimizer": opt})

        ckpt.manager = mgr  # type: ignore[attr-defined]
        return ckpt, mgr.close
    if c in ("dcp", "dcp-ckpt"):
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as load_dcp

        from ckptstore.dcp import CkptStoreReader

        assert model is not None
        assert opt is not None

        def dcp_load() -> None:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            reader = FileSystemReader(str(d)) if c == "dcp" else CkptStoreReader(d, step=1)
            load_dcp(sd, storage_reader=reader)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

        return dcp_load, nothing
    assert raw is not None
    spans = raw_spans(d, rank_of(), world_of())

    def raw_load() -> None:
        raw_bytes.append(raw.read(spans))

    def fresh_load() -> None:
        raw.read(spans, fresh=True)

    if c == "raw-fresh":
        return fresh_load, raw.release
    if c in ("raw-checked", "raw-checked-buffered"):
        how = "copy" if c == "raw-checked" else "buffered"
        raw.prepare_target(sum(length for _, _, length in spans))  # untimed

        def checked_load() -> None:
            raw.read(spans, checked=how)

        return checked_load, nothing
    return raw_load, nothing


def save_job(job: dict[str, Any]) -> dict[str, Any]:
    rank, world = rank_of(), job["world"]
    t0 = time.perf_counter()
    model, opt = build(job["param_bytes"], world, init=True, n_layer=job["n_layer"])
    tensors = local_tensors(model, opt)
    my_bytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, "times": {}}
    out["local_bytes"] = my_bytes
    out["sums"] = sums(model, opt)
    raw = Raw(tensors) if job["odirect"] else None
    out["raw_huge_share"] = huge_share(raw.buf) if raw is not None else None
    base = Path(job["dir"])
    contenders = [c for c in job["contenders"] if c != "raw" or raw is not None]
    for r in range(job["repeats"]):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            d = base / f"{c}-{r}"
            if rank == 0:
                d.mkdir(parents=True)
            barrier()
            op, done = save_op(c, d, model, opt, raw=raw, nbytes=my_bytes)
            seen = decided()
            seconds = timed(op)
            record(out, c, op, seen)
            if c == "ckpt":  # the same manager again: its second save (see SAVE_ONLY)
                seen = decided()
                again = timed(op.again)  # type: ignore[attr-defined]
                record(out, "ckpt-again", op, seen)
                out["times"].setdefault("ckpt-again", []).append(again)
                if rank == 0:
                    log(f"  sharded ckpt-again save-{world}     {again:8.3f} s")
            done()
            if c == "ckpt" and r == 0:
                # Untimed: the same state again, in files of their own, for ckpt-live.
                live = base / "ckpt-live-0"
                if rank == 0:
                    live.mkdir(parents=True)
                barrier()
                live_op, _ = save_op(c, live, model, opt, raw=raw, nbytes=my_bytes)
                live_op()
                live_op.manager.close()  # type: ignore[attr-defined]
            if c == "raw" and r == 0:
                # Untimed: the same bytes again, in files of their own, for the raw-only
                # restores' reads (each contender reads its own files; the virtual disk's
                # cache serves a read of bytes just read sooner, posix_fadvise or not).
                for other in RESTORE_ONLY:
                    own = base / f"{other}-0"
                    if rank == 0:
                        own.mkdir(parents=True)
                    barrier()
                    save_op(c, own, model, opt, raw=raw, nbytes=my_bytes)[0]()
            out["times"].setdefault(c, []).append(seconds)
            if rank == 0:
                log(f"  sharded {c:<5} save-{world}         {seconds:8.3f} s")
                if r > 0:  # the first round's checkpoints are kept for the restores
                    shutil.rmtree(d, ignore_errors=True)
                    os.sync()
            barrier()
    if raw is not None:
        raw.close()
    return out


def restore_job(job: dict[str, Any]) -> dict[str, Any]:
    rank, world = rank_of(), job["world"]
    dirs = {c: Path(p) for c, p in job["dirs"].items()}
    raw = Raw(None) if "raw" in dirs else None
    if raw is not None:  # the raw-only restores, of files of their own
        for other in RESTORE_ONLY:
            dirs[other] = dirs["raw"].parent / f"{other}-0"
    out: dict[str, Any] = {"times": {}, "cpu": {}, "resident": [], "checks": [], "raw_bytes": []}
    if "ckpt" in dirs:  # into live targets, from files of its own
        dirs["ckpt-live"] = dirs["ckpt"].parent / "ckpt-live-0"
    contenders = [c for c in job["contenders"] if c in dirs]
    if raw is not None:  # never next to raw in the rotation (the same bytes, just read)
        for i, other in enumerate(RESTORE_ONLY):
            contenders.insert(min(contenders.index("raw") + 2 + 2 * i, len(contenders)), other)
    if "ckpt" in contenders:
        contenders.append("ckpt-live")
    want = job["sums"]
    if job.get("warm") and "ckpt" in dirs:
        # Untimed: a restore in each I/O mode first, so that io="auto" (storage/iomode.py)
        # has measured both in this run's cache before a restore is timed, as on a machine
        # whose cache holds them. Else the first two ckptstore restores of the run are its
        # trials of each mode, one of them in the slower, among the timed rounds.
        for _ in range(2):
            warm = build(job["param_bytes"], world, init=False, n_layer=job["n_layer"])
            trial, end = restore_op("ckpt", dirs["ckpt"], *warm, raw=raw, raw_bytes=[])
            barrier()
            trial()
            end()
            del warm, trial, end
            gc.collect()
        barrier()
    for r in range(job["repeats"]):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            model: nn.Module | None = None
            opt: torch.optim.Optimizer | None = None
            if not c.startswith("raw"):  # fresh targets each time (ckpt-live: live), untimed
                model, opt = build(
                    job["param_bytes"], world, init=c == "ckpt-live", n_layer=job["n_layer"]
                )
            op, done = restore_op(c, dirs[c], model, opt, raw=raw, raw_bytes=out["raw_bytes"])
            if rank == 0:
                out["resident"].append(drop_cache(dirs[c]))
            barrier()
            cpu0 = time.process_time()  # this process, all its threads, user + system
            seconds = timed(op)
            cpu = time.process_time() - cpu0
            record_restore(out, c, op)
            done()
            out["times"].setdefault(c, []).append(seconds)
            out["cpu"].setdefault(c, []).append(cpu)
            if model is not None and opt is not None:
                got = sums(model, opt)
                ok = all(
                    abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, want, strict=True)
                )
                out["checks"].append({"contender": c, "ok": ok, "sums": got})
                if not ok:
                    msg = (
                        f"{c} restore of the {job['saved']}-rank save on {world} rank(s) "
                        f"loaded other values: {got} != {want}"
                    )
                    raise RuntimeError(msg)
            if rank == 0:
                log(f"  sharded {c:<5} restore-{job['saved']}to{world}   {seconds:8.3f} s")
            model = opt = op = done = None  # type: ignore[assignment]
            gc.collect()
            barrier()
    if raw is not None:
        raw.close()
    return out


def worker(jobdir_name: str) -> None:
    """One rank of the job in ``jobdir_name`` (forked by the run's ``RankServer``)."""
    jobdir = Path(jobdir_name)
    job = json.loads((jobdir / "job.json").read_text())
    torch.set_num_threads(1)  # as torchrun sets it (see start_server)
    import warnings

    warnings.filterwarnings("ignore")  # DCP warns when it runs without a process group
    if job["world"] > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3600))
    rank = rank_of()
    out = save_job(job) if job["kind"] == "save" else restore_job(job)
    import ckptstore

    # The ckptstore this rank ran: the repository's, whatever the parent imported (the
    # server puts it first on the ranks' path; see start_server).
    out["ckptstore_path"] = str(Path(ckptstore.__file__).resolve().parent)
    (jobdir / f"result.rank{rank}.json").write_text(json.dumps(out))
    if dist_on():
        import torch.distributed as dist

        dist.destroy_process_group()


# ---- the parent ------------------------------------------------------------------------------


def launch(
    server: RankServer, jobdir: Path, job: dict[str, Any], timeout: float
) -> list[dict[str, Any]]:
    """Run ``job`` on ``job['world']`` processes forked by ``server``; their results, by rank."""
    jobdir.mkdir(parents=True, exist_ok=True)
    (jobdir / "job.json").write_text(json.dumps(job))
    world = job["world"]
    with reserved_port() as port:
        codes = server.run("benchkit.sharded:worker", [str(jobdir)], world, port, timeout)
    # A rank that failed first, rather than one the server killed after it (SIGKILL: -9).
    bad = sorted(codes.items(), key=lambda kv: (kv[1] == -signal.SIGKILL, kv[0]))
    failed = [(rank, rc) for rank, rc in bad if rc != 0]
    if failed:
        rank, rc = failed[0]
        raise RuntimeError(f"rank {rank} of the {job['kind']} job on {world} rank(s): exit {rc}")
    return [json.loads((jobdir / f"result.rank{r}.json").read_text()) for r in range(world)]


def start_server() -> RankServer:
    """The fork server of a run's jobs: it imports what a rank imports outside its timed
    operations (torch, FSDP2, torch._dynamo, DCP, ckptstore, this module), once.

    Every process runs one intra-op thread (``OMP_NUM_THREADS=1``, as torchrun sets it) for
    every contender and world size alike: on a loaded machine OpenMP threads spinning at
    their barriers made plain tensor copies ~10x slower in the 1-process restore.
    """
    env = dict(os.environ)
    # The checkout's ckptstore, tools/ (benchkit, demo) importable: as the parent has them.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TOOLS), env.get("PYTHONPATH", "")])
    preload = [
        "benchkit.sharded",
        "torch.distributed.device_mesh",
        "torch.distributed.fsdp",
        "torch._dynamo",  # FSDP2's first DTensor imports it (1.6 s of CPU)
        "torch.distributed.checkpoint",
        "torch.distributed.checkpoint.state_dict",
        "ckptstore.dcp",
    ]
    return RankServer(preload, env)


def run(
    param_bytes: int,
    work: Path,
    repeats: int,
    *,
    odirect: bool,
    n_layer: int = N_LAYER,
    timeout: float = 3600,
) -> dict[str, Any]:
    """Save on 2 ranks, restore on 1 and on 3; save on 4, restore on 2; every contender
    interleaved in each job (``n_layer``: the blocks of the model, ``benchkit.state``)."""
    contenders = [c for c in CONTENDERS if c != "raw" or odirect]
    base = work / "sharded"
    load = [os.getloadavg()[0]]
    log(
        f"sharded: FSDP2 save on {SAVE_WORLD} ranks, restore on "
        f"{' and '.join(map(str, RESTORE_WORLDS))}; save on {SAVE_WORLD_4}, restore on "
        f"{' and '.join(map(str, RESTORE_WORLDS_4))}: {', '.join(contenders)}"
    )
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    disk: dict[str, int] = {}
    resident: list[float | None] = []
    raw_bytes: dict[str, int] = {}
    per_save: dict[int, list[dict[str, Any]]] = {}
    restore_phases: dict[str, Any] = {}
    with start_server() as server:
        for saving, worlds, rounds in (
            (SAVE_WORLD, RESTORE_WORLDS, repeats),
            (SAVE_WORLD_4, RESTORE_WORLDS_4, 1),
        ):
            saved = per_save[saving] = launch(
                server,
                base / f"job-save-{saving}",
                {
                    "kind": "save",
                    "world": saving,
                    "param_bytes": param_bytes,
                    "n_layer": n_layer,
                    "repeats": rounds,
                    "contenders": contenders,
                    "dir": str(base / f"ckpts-{saving}"),
                    "odirect": odirect,
                },
                timeout,
            )
            for c, ts in saved[0]["times"].items():
                times[(c, f"save-{saving}")] = ts
            dirs = {c: str(base / f"ckpts-{saving}" / f"{c}-0") for c in contenders}
            if saving == SAVE_WORLD:
                disk = {c: du(Path(p)) for c, p in dirs.items()}
            for world in worlds:
                op = f"restore-{saving}to{world}"
                res = launch(
                    server,
                    base / f"job-{op}",
                    {
                        "kind": "restore",
                        "saved": saving,
                        "world": world,
                        "param_bytes": param_bytes,
                        "n_layer": n_layer,
                        "repeats": repeats,
                        "contenders": contenders,
                        "dirs": dirs,
                        "sums": saved[0]["sums"],
                        # The run's first restores measure both read modes, untimed (a
                        # read phase under MEASURED_BYTES is no measurement: smoke runs).
                        "warm": not restore_phases
                        and sum(r["local_bytes"] for r in saved) >= iomode.MEASURED_BYTES,
                    },
                    timeout,
                )
                load.append(os.getloadavg()[0])
                for c, ts in res[0]["times"].items():
                    times[(c, op)] = ts
                    # CPU seconds of each restore, all ranks together (barrier waits included).
                    per_rank = [r["cpu"][c] for r in res]
                    cpu[(c, op)] = [sum(x) for x in zip(*per_rank, strict=True)]
                resident += res[0]["resident"]
                restore_phases[op] = phase_medians(res, "restore_phases")
                raw_bytes[op] = sum(r["raw_bytes"][0] for r in res) if res[0]["raw_bytes"] else 0
            shutil.rmtree(base / f"ckpts-{saving}", ignore_errors=True)
    saved = per_save[SAVE_WORLD]
    shutil.rmtree(base, ignore_errors=True)
    load.append(os.getloadavg()[0])
    state_bytes = sum(r["local_bytes"] for r in saved)
    # The 4-rank save holds the same model and optimizer, and AdamW's "step" scalar of
    # every parameter on each rank: a few bytes more. Each op's GB/s uses its own save's.
    bytes_of = {w: sum(r["local_bytes"] for r in per_save[w]) for w in (SAVE_WORLD, SAVE_WORLD_4)}
    phases = phase_medians(saved, "phases")
    rows = []
    med = {k: statistics.median(v) for k, v in times.items()}
    for (c, op), ts in times.items():
        m = med[(c, op)]
        nbytes = bytes_of[int(op.removeprefix("save-").removeprefix("restore-").split("to")[0])]
        rows.append(
            {
                "contender": c,
                "op": op,
                "n": len(ts),
                "times_s": ts,
                "median_s": m,
                "min_s": min(ts),
                "max_s": max(ts),
                "gb_s": nbytes / m / GB,
                "spread": max(ts) / min(ts),
                "vs_raw": med[("raw", op)] / m if ("raw", op) in med else None,
                "vs_dcp": med[("dcp", op)] / m if ("dcp", op) in med else None,
                "vs_raw_fresh": med[("raw-fresh", op)] / m if ("raw-fresh", op) in med else None,
                "cpu_s": cpu.get((c, op)),
                "cpu_ns_per_byte": (
                    statistics.median(cpu[(c, op)]) / nbytes * 1e9 if (c, op) in cpu else None
                ),
            }
        )
    ran = sorted({r["ckptstore_path"] for w in per_save.values() for r in w})
    return {
        # Where the ranks' ckptstore came from (machine.ckptstore_path is the parent's).
        "ranks_ckptstore_path": ran,
        "state_bytes": state_bytes,
        "state_bytes_4": bytes_of[SAVE_WORLD_4],
        "per_rank_bytes_4": [r["local_bytes"] for r in per_save[SAVE_WORLD_4]],
        "per_rank_bytes": [r["local_bytes"] for r in saved],
        "build_s": saved[0]["build_s"],
        "disk_bytes": disk,
        "raw_restore_bytes": raw_bytes,
        # The share of each saving rank's raw buffer on huge pages (benchkit.disk.dma_buffer).
        "raw_huge_share": [r.get("raw_huge_share") for r in saved],
        # Per saving rank, per contender, per round: the write modes its saves measured.
        "write_modes": {w: [r.get("write_modes") for r in per_save[w]] for w in per_save},
        "resident_after_drop": resident,
        "loadavg_1min_seen": load,
        "threads_per_process": 1,
        "rows": rows,
        "phases": phases,
        "restore_phases": restore_phases,
        "targets": targets(rows),
        "descriptions": {
            c: DESCRIPTIONS[c]
            for c in [
                *contenders,
                *SAVE_ONLY,
                *(RESTORE_ONLY if "raw" in contenders else ()),
                *(CKPT_RESTORE_ONLY if "ckpt" in contenders else ()),
            ]
        },
    }


def print_report(res: dict[str, Any]) -> None:
    print()
    print(
        f"sharded (FSDP2): {human(res['state_bytes'])} of state (params + AdamW) saved by "
        f"2 ranks ({' + '.join(human(b) for b in res['per_rank_bytes'])}), restored "
        "on 1 process (no process group) and on 3 ranks; saved by 4 ranks, restored on 2; "
        "GB/s = state bytes / s"
    )
    head = (
        f"{'contender':<11} {'op':<13} {'median s':>9} {'GB/s':>6} {'x raw':>6} {'x dcp':>6} "
        f"{'x fresh':>7} {'n':>3} {'max/min':>7} {'cpu ns/B':>8}"
    )
    print(head)
    print("-" * len(head))
    order = {c: i for i, c in enumerate(CONTENDERS + SAVE_ONLY + RESTORE_ONLY + CKPT_RESTORE_ONLY)}
    for r in sorted(res["rows"], key=lambda r: (OPS.index(r["op"]), order[r["contender"]])):
        print(
            f"{r['contender']:<11} {r['op']:<13} {r['median_s']:>9.3f} {r['gb_s']:>6.2f} "
            f"{fmt(r['vs_raw'], '.2f'):>6} {fmt(r['vs_dcp'], '.2f'):>6} "
            f"{fmt(r.get('vs_raw_fresh'), '.2f'):>7} {r['n']:>3} {r['spread']:>7.2f} "
            f"{fmt(r.get('cpu_ns_per_byte'), '.2f'):>8}"
        )
    known = [x for x in res["resident_after_drop"] if x is not None]
    if known:
        print(
            f"cold cache: max {max(known):.1%} of a checkpoint still resident after "
            "posix_fadvise(DONTNEED)"
        )
    cpus = os.cpu_count() or 1
    if max(res["loadavg_1min_seen"]) > cpus:
        print(
            f"warning: load average reached {max(res['loadavg_1min_seen']):.1f} on {cpus} CPUs: "
            "other work shared the CPUs and the disk, so medians are noisy (see max/min)"
        )
    print_phases(res)
    print("sharded targets:")
    for t in res["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        val = fmt(t["value"], ".3f")
        best = "" if t["value_min"] is None else f"; best-of-runs {t['value_min']:.3f}"
        print(f"  {verdict}  {t['target']:<44} {val:>7}  ({t['threshold']}; {t['detail']}{best})")

"""Sharded-save coordination at 64 to 16,384 ranks, simulated in one process a rank (issue 21).

Runs ckptstore's real save code for one rank of an N-rank FSDP2-like job: 600 DTensors a
rank (200 parameters of uneven row counts, ``Shard(0)`` on a 1-D mesh of N ranks, and their
AdamW ``exp_avg``/``exp_avg_sq``), built on torch.distributed's fake process group
(``torch.testing._internal.distributed.fake_pg``), which gives every DTensor and device mesh
of an N-rank job without N processes. What is real and what is played:

- real: the encoding, the local plan, who writes which box, the shard files, the index and
  manifest rank 0 builds and commits, every check, every byte that would be sent;
- played: the other N-1 ranks. ``Coordinator`` is replaced by ``Sim``: a collective returns
  what the peers would send. Rank 0 gets each peer's object derived from its own (file
  names and ranks renamed; chunk offsets, sizes and volumes computed for that peer's shard by
  DTensor's own layout arithmetic). A non-zero rank gets what the rank-0 run of the same N
  broadcast, replayed in order.

Each rank runs twice per N (rank 0, then rank 1 replaying rank 0), in its own process. The
bytes a rank sends and receives are counted as ``ckptstore.dist.CollectiveStats`` counts them;
for a baseline (``--baseline REV``: the ckptstore of that commit, extracted with git) from
before ckptstore's own collectives (no ``CollectiveStats``), torch's
object collectives are modelled as torch runs them: ``all_gather_object`` brings every rank
N padded copies and N sizes, ``gather_object`` first all-gathers the sizes,
``monitored_barrier`` has rank 0 answer every rank in turn.

``--layout fsdp-tp`` lays the same 200 parameters out as FSDP2 over tensor parallelism
(torchtitan's 2-D layout) on an ``(N / TP, TP)`` mesh (``--tp``, 8 by default): even ones
column-wise, ``(_StridedShard(0, TP), Shard(0))``, odd ones row-wise, ``(Shard(0),
Shard(1))``.

It also computes the index bytes a restoring rank reads to restore rank 1's shard on N/2
and 2N ranks (the same layout; for ``fsdp-tp`` the same TP size): the whole
``dtensors.json`` in format 2; from format 3 on, the layout plus the parts of the ranks
whose boxes rank 1's targets overlap, over every tensor (found by ckptstore's own
``split_index.Layout.boxes`` on the committed layout; the parts are this run's sizes); and
what it reads of the manifest ("r-manifest"): the whole of it before format 4, the manifest
and the rank table's lines of those writers since.

    .venv/bin/python tools/scale_sim.py --worlds 64 256 1024 4096 16384 --baseline 2f0f77c
    .venv/bin/python tools/scale_sim.py --layout fsdp-tp --baseline 75d5986
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baseline import extract
from benchkit.units import binary as _b

if TYPE_CHECKING:
    from ckptstore.dist import Coordinator

ROOT = Path(__file__).resolve().parents[1]
PARAMS = 200  # x3 with AdamW's two moments: 600 DTensors a rank
COLS = 16
SLOT = 512  # ckptstore.dist.SLOT
#: ``--layout``: ``fsdp`` (``Shard(0)`` on a 1-D mesh of N ranks) or ``fsdp-tp`` (FSDP2
#: over tensor parallelism on an ``(N / TP, TP)`` mesh, torchtitan's 2-D layout: even
#: parameters column-wise ``(_StridedShard(0, TP), Shard(0))``, odd ones row-wise
#: ``(Shard(0), Shard(1))``), and the TP size.
LAYOUT: dict[str, Any] = {"kind": "fsdp", "tp": 8}


# ---- one simulated rank ------------------------------------------------------------------


def rows_of(i: int, world: int) -> int:
    """Parameter ``i``'s rows: about 2 a rank, uneven, so some ranks hold fewer."""
    return 2 * world + (i % 5)


def mesh_shape(world: int) -> tuple[int, ...]:
    """The job's device mesh: ``(N,)``, or ``(N / TP, TP)`` for ``fsdp-tp``."""
    if LAYOUT["kind"] == "fsdp":
        return (world,)
    tp = int(LAYOUT["tp"])
    if world % tp or world < tp:
        raise SystemExit(f"scale_sim: {world} ranks do not split into TP groups of {tp}")
    return (world // tp, tp)


def coordinate(rank: int, mshape: tuple[int, ...]) -> list[int]:
    """``rank``'s coordinate on a row-major mesh of ``mshape`` (as ``init_device_mesh``)."""
    out = []
    for n in reversed(mshape):
        out.append(rank % n)
        rank //= n
    return out[::-1]


def param_layout(i: int, mshape: tuple[int, ...]) -> tuple[tuple[int, int], list[Any]]:
    """Parameter ``i``'s global shape and placements on the job's mesh."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if len(mshape) == 1:
        return (rows_of(i, mshape[0]), COLS), [Shard(0)]
    dp, tp = mshape
    if i % 2 == 0:  # column-wise: TP splits the rows, FSDP2 each TP piece
        return (tp * rows_of(i, dp), COLS), [_StridedShard(0, split_factor=tp), Shard(0)]
    return (rows_of(i, dp), COLS), [Shard(0), Shard(1)]  # row-wise: TP splits the columns


def build(world: int, rank: int) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """This rank's FSDP2-like state, and every DTensor's global shape by name."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mshape = mesh_shape(world)
    names = ("dp", "tp") if len(mshape) == 2 else None
    mesh = init_device_mesh("cpu", mshape, mesh_dim_names=names)
    coord = coordinate(rank, mshape)
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(PARAMS):
        shape, placements = param_layout(i, mshape)
        sizes, _ = _compute_local_shape_and_global_offset(shape, mshape, coord, placements)
        for kind, into in (("w", model), ("exp_avg", state), ("exp_avg_sq", state)):
            local = torch.randn(*sizes) if 0 not in sizes else torch.empty(*sizes)
            t = DTensor.from_local(
                local,
                mesh,
                placements,
                shape=torch.Size(shape),
                stride=(shape[1], 1),
                run_check=False,
            )
            key = f"layers.{i}.weight" if kind == "w" else f"layers.{i}.weight/{kind}"
            into[key] = t
    for name, t in model.items():
        shapes[f"model/{name}"] = tuple(t.shape)
    for name, t in state.items():
        shapes[f"optim/{name}"] = tuple(t.shape)
    return {"model": model, "optim": state, "step": 1}, shapes


def _param(name: str) -> int:
    """The parameter index of a flat name (``model/layers.7.weight``, its moments)."""
    return int(name.split("layers.")[1].split(".", maxsplit=1)[0])


class Peers:
    """Derives what peer ``r`` sends from what this rank sends (see the module docstring)."""

    def __init__(self, world: int, me: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self.world, self.me, self.shapes = world, me, shapes
        self.names = sorted(shapes)
        self._boxes: dict[Any, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def box(self, name: str, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Peer ``r``'s box of ``name``: DTensor's own arithmetic, once per shape and rank
        (a model's 600 tensors have 10 shapes; torch's strided arithmetic makes tensors)."""
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        mshape = mesh_shape(self.world)
        i = _param(name)
        key = (self.shapes[name], i % 2, r)
        found = self._boxes.get(key)
        if found is None:
            shape = self.shapes[name]
            coord = coordinate(r, mshape)
            if len(mshape) == 2 and i % 2 == 0:
                # Column-wise FSDP2 over TP, in closed form: torch's strided arithmetic
                # lists every row (a 32k-row list a call at 16,384 ranks, for each of the
                # N peers). TP piece j of rows // TP rows, then part i of it over "dp";
                # checked against torch's on small meshes. An empty box sits at the end of
                # the dim, as torch places it.
                piece = shape[0] // mshape[1]
                size = -(-piece // mshape[0])
                start = min(coord[0] * size, piece)
                rows = max(0, min(piece, start + size) - start)
                at = coord[1] * piece + start if rows else shape[0]
                found = ((at, 0), (rows, shape[1]))
                if self.world <= 256 and r < 64:
                    _, placements = param_layout(i, mshape)
                    sizes, offs = _compute_local_shape_and_global_offset(
                        shape, mshape, coord, placements
                    )
                    if found != (tuple(offs), tuple(sizes)):
                        raise AssertionError((name, r, found, offs, sizes))
            else:
                _, placements = param_layout(i, mshape)
                sizes, offs = _compute_local_shape_and_global_offset(
                    shape, mshape, coord, placements
                )
                found = (tuple(offs), tuple(sizes))
            self._boxes[key] = found
        return found

    def of(self, obj: Any, r: int) -> Any:
        mine, theirs = f"rank{self.me:05d}", f"rank{r:05d}"
        if isinstance(obj, str):
            return obj.replace(mine, theirs)
        if isinstance(obj, bytes):
            return self._bytes(obj, r)
        if isinstance(obj, dict):
            if "volumes" in obj and isinstance(obj["volumes"], bytes):
                out = {self.of(k, r): self.of(v, r) for k, v in obj.items() if k != "volumes"}
                out["volumes"] = self._volumes(r)
                return out
            return {self.of(k, r): self.of(v, r) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.of(x, r) for x in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.of(x, r) for x in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            # matched by name: a baseline's classes are those of its own checkout
            dc: Any = obj
            kind = type(dc).__name__
            if kind == "FileEntry":
                return dataclasses.replace(dc, rank=r if dc.rank == self.me else dc.rank)
            if kind == "SavePlan":
                return dataclasses.replace(dc, items=[self._item(it, r) for it in dc.items])
        return obj

    def _volumes(self, r: int) -> bytes:
        import numpy as np

        return np.array(
            [math.prod(self.box(n, r)[1]) for n in self.names], dtype=np.int64
        ).tobytes()

    def _bytes(self, data: bytes, r: int) -> bytes:
        if not data.startswith(b'{"chunks"'):
            return data
        doc = json.loads(data)  # format 2's packed chunk table (ckptstore.sharded.plan)
        for row in doc["chunks"]:
            name = row[0]
            offs, sizes = self.box(name, r)
            row[1] = list(offs)
            c = row[2]
            c.update(offsets=list(offs), sizes=list(sizes), bytes=math.prod(sizes) * 4)
            c["file"] = c["file"].replace(f"rank{self.me:05d}", f"rank{r:05d}")
            c["crc32c"] = (c["crc32c"] or ["00000000"])[:1] * -(-c["bytes"] // (4 << 20))
        return json.dumps(doc, separators=(",", ":")).encode()

    def _item(self, item: Any, r: int) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        offs, sizes = self.box(item.index.fqn, r)
        td = item.tensor_data
        chunk = ChunkStorageMetadata(offsets=_size(offs), sizes=_size(sizes))
        return dataclasses.replace(
            item,
            index=MetadataIndex(item.index.fqn, _size(offs), item.index.index),
            tensor_data=dataclasses.replace(td, chunk=chunk),
        )


def _size(x: tuple[int, ...]) -> Any:
    import torch

    return torch.Size(x)


def _pickled(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return 0


def make_sim(  # noqa: PLR0917 - the simulated rank's whole setting
    real: type[Coordinator], world: int, rank: int, peers: Peers, tape: Path, root: Path
) -> type[Coordinator]:
    """A Coordinator subclass that plays the other ranks (see the module docstring)."""
    replay: list[Any] = json.loads(tape.read_text()) if rank and tape.exists() else []
    recorded: list[Any] = []
    log: list[dict[str, Any]] = []

    class Sim(real):  # type: ignore[misc, valid-type]
        def __init__(self, timeout: float, *, enabled: bool = True) -> None:
            self.timeout = float(timeout)
            self.enabled = enabled
            self.rank = rank if enabled else 0
            self.world_size = world if enabled else 1
            self.group = None
            self._uid = 0
            self._seq = 0
            self._broken = None
            if hasattr(real, "__init__") and "stats" in real.__init__.__code__.co_names:
                from ckptstore.dist import CollectiveStats

                self.stats = CollectiveStats()

        # what this rank exchanged
        def _log(self, phase: str, op: str, sent: int, received: int, serial: int = 0) -> None:
            log.append(
                {"phase": phase, "op": op, "sent": sent, "received": received, "serial": serial}
            )

        def _answer(self, value: Any) -> Any:
            """Rank 0: record what it sends; others: what rank 0 sent, in the same order."""
            if self.rank == 0:
                recorded.append(pickle.dumps(value).hex())
                return value
            got = pickle.loads(bytes.fromhex(replay[len(recorded)]))
            recorded.append(None)
            # Rank 0's pending directory, which this rank writes into: made here, since
            # rank 0 made it in its own store.
            inner = got[1] if isinstance(got, tuple) and len(got) == 2 else got
            name = inner.get("dirname") if isinstance(inner, dict) else inner
            if isinstance(name, str) and name.startswith(".tmp-step-"):
                (root / name).mkdir(parents=True, exist_ok=True)
            return got

        def barrier(self, phase: str, step: int | None = None) -> None:
            if not self.enabled:
                return
            self._seq += 1
            if BASELINE:  # monitored_barrier: rank 0 answers every rank in turn
                n = world - 1
                self._log(phase, "barrier", 0, 0, serial=2 * n if self.rank == 0 else 2)
            else:  # dissemination: log2(N) rounds of one empty message
                self._log(phase, "barrier", 0, 0, serial=math.ceil(math.log2(world)))

        def broadcast(self, obj: Any, phase: str, step: int | None = None, src: int = 0) -> Any:
            if not self.enabled:
                return obj
            self.barrier(phase, step)
            out = self._answer(obj if self.rank == src else None)
            size = _pickled(out) + 8
            self._log(
                phase, "broadcast", size if self.rank == src else 0, 0 if self.rank == src else size
            )
            return out

        def gather(self, obj: Any, phase: str, step: int | None = None, dst: int = 0) -> Any:
            if not self.enabled:
                return [obj]
            self.barrier(phase, step)
            size = _pickled(obj)
            if self.rank != dst:
                if BASELINE:  # gather_object: all-gather of sizes, then padded tensors
                    self._log(phase, "gather", size + 8, 8 * (world - 1))
                else:
                    self._log(phase, "gather", SLOT + (size if size > SLOT - 8 else 0), 0)
                return None
            c0 = time.process_time()
            got = [obj if r == self.rank else peers.of(obj, r) for r in range(world)]
            sizes = [_pickled(x) for x in got]
            PLAYING[0] += time.process_time() - c0
            if BASELINE:
                received = (world - 1) * max(sizes) + 8 * (world - 1)
            else:
                received = sum(SLOT + (s if s > SLOT - 8 else 0) for s in sizes[1:])
            self._log(phase, "gather", 0, received)
            return got

        def all_gather(self, obj: Any, phase: str, step: int | None = None) -> Any:
            if not self.enabled:
                return [obj]
            self.barrier(phase, step)
            c0 = time.process_time()
            got = [obj if r == self.rank else peers.of(obj, r) for r in range(world)]
            biggest = max(_pickled(x) for x in got)
            PLAYING[0] += time.process_time() - c0
            self._log(phase, "all_gather", _pickled(obj), (world - 1) * (biggest + 8))
            return got

        def reduce(self, obj: Any, fn: Any, phase: str, step: int | None = None) -> Any:
            if not self.enabled:
                return fn([obj])
            self.barrier(phase, step)
            size = _pickled(obj)
            if self.rank == 0:
                c0 = time.process_time()
                every = [obj] + [peers.of(obj, r) for r in range(1, world)]
                sizes = [_pickled(x) for x in every[1:]]
                PLAYING[0] += time.process_time() - c0
                try:
                    result: Any = ("ok", fn(every))
                except BaseException as e:
                    result = ("raise", e)
                received = sum(SLOT + (n if n > SLOT - 8 else 0) for n in sizes)
                out = self._answer(result)
                self._log(phase, "reduce", _pickled(out), received)
            else:
                out = self._answer(None)
                self._log(phase, "reduce", SLOT + (size if size > SLOT - 8 else 0), _pickled(out))
            status, value = out
            if status == "raise":
                raise value
            return value

        def broadcast_bytes(self, blobs: Any, phase: str, step: int | None = None) -> Any:
            raise NotImplementedError("a sharded save broadcasts no files")

        def close(self) -> None:
            pass

        def post(self, tag: str, value: str) -> None:  # pragma: no cover - node-local roots
            raise NotImplementedError

    Sim.log = log
    Sim.recorded = recorded
    return Sim


BASELINE = False
#: CPU seconds this process spent playing the other ranks (not ckptstore's work).
PLAYING = [0.0]


def one(world: int, rank: int, out: Path, tape: Path, baseline: bool) -> None:
    """Simulate ``rank`` of a ``world``-rank job; write its figures to ``out``."""
    global BASELINE
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import ckptstore.dist
    import ckptstore.manager
    from ckptstore import CheckpointManager

    # torch's object collectives are modelled for a baseline from before ckptstore's own
    # (no CollectiveStats); a later baseline's Coordinator is counted as the current one is.
    BASELINE = baseline and "stats" not in ckptstore.dist.Coordinator.__init__.__code__.co_names

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    t0 = time.process_time()
    state, shapes = build(world, rank)
    build_cpu = time.process_time() - t0
    root = out.parent / f"store-{world}-{rank}"
    shutil.rmtree(root, ignore_errors=True)
    sim = make_sim(ckptstore.dist.Coordinator, world, rank, Peers(world, rank, shapes), tape, root)
    ckptstore.manager.Coordinator = sim  # type: ignore[attr-defined]
    from ckptstore.save import pipeline

    pipeline.Coordinator = sim  # type: ignore[attr-defined]
    figures: dict[str, Any] = {"world": world, "rank": rank, "build_cpu": build_cpu}
    with CheckpointManager(root, keep=None, barrier_timeout=600) as mgr:
        PLAYING[0] = 0.0  # the manager's construction played the others too: not the save
        c0, w0 = time.process_time(), time.perf_counter()
        mgr.save(1, state)
        # ckptstore's CPU: the save's, less what playing the other ranks cost here.
        figures["save_cpu"] = time.process_time() - c0 - PLAYING[0]
        figures["playing_cpu"] = PLAYING[0]
        figures["save_wall"] = time.perf_counter() - w0
        figures["phases_cpu"] = dict(getattr(mgr, "last_save_cpu", {}) or {})
    figures["log"] = sim.log  # type: ignore[attr-defined]
    if rank == 0:
        tape.write_text(json.dumps(sim.recorded))  # type: ignore[attr-defined]
        step = next(root.glob("step-*"))
        figures["files"] = {p.name: p.stat().st_size for p in step.iterdir() if p.is_file()}
        figures["step_dir"] = str(step)
        figures["format_version"] = json.loads((step / "manifest.json").read_text())[
            "format_version"
        ]
    else:
        figures["files"] = {
            p.name: p.stat().st_size for p in root.glob(".tmp-step-*/*") if p.is_file()
        }
    out.write_text(json.dumps(figures))


# ---- the driver --------------------------------------------------------------------------


def preload() -> None:
    """``--fork``: import, once, what every simulated rank of this tree imports.

    Nothing runs a tensor op or starts a thread here: a fork of this process is as clean as
    the fresh interpreter ``--one`` is (whose imports cost 5 s of CPU, most of a small run).
    """
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch, as run_world gives its children
    sys.path.insert(0, str(ROOT))  # this tree's ckptstore, as PYTHONPATH gives them
    import torch._dynamo  # DTensor.from_local's first call imports it
    import torch.distributed.checkpoint
    import torch.distributed.tensor  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401

    import ckptstore.dist
    import ckptstore.manager
    import ckptstore.save.pipeline  # noqa: F401


def run_forked(world: int, rank: int, out: Path, tape: Path, timeout: float) -> int | None:
    """:func:`one` in a fork of this process (``--fork``); its exit status, None on timeout."""
    from forkchild import finish

    pid = os.fork()
    if pid == 0:
        finish(lambda: one(world, rank, out, tape, False))
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)


def run_world(
    world: int, work: Path, code: Path | None, timeout: float, fork: bool = False
) -> dict[str, Any] | None:
    """Rank 0 then rank 1 of a ``world``-rank job; None if it did not finish in time.

    ``fork``: this tree's ranks run as forks of this process (see :func:`preload`); a
    baseline's always in fresh interpreters, which import its own ckptstore.
    """
    # The ckptstore of this tree (or the baseline's), whatever the environment installed.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(code or ROOT))
    tape = work / f"tape-{world}.json"
    res = {}
    for rank in (0, 1):
        out = work / f"figures-{world}-{rank}.json"
        if fork and code is None:
            status = run_forked(world, rank, out, tape, timeout)
            if status is None:
                return None
            if status != 0:
                sys.exit(f"scale_sim: {world} ranks, rank {rank} failed (exit {status})")
            res[rank] = json.loads(out.read_text())
            continue
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--one",
            str(world),
            str(rank),
            "--out",
            str(out),
            "--tape",
            str(tape),
            "--layout",
            str(LAYOUT["kind"]),
            "--tp",
            str(LAYOUT["tp"]),
        ]
        if code is not None:
            cmd.append("--baseline-mode")
        try:
            proc = subprocess.run(
                cmd, env=env, timeout=timeout, capture_output=True, text=True, check=False
            )
        except subprocess.TimeoutExpired:
            return None
        if proc.returncode != 0:
            sys.exit(f"scale_sim: {world} ranks, rank {rank} failed:\n{proc.stderr[-3000:]}")
        res[rank] = json.loads(out.read_text())
    return _figures(world, res[0], res[1], code is not None)


def _figures(world: int, r0: dict[str, Any], r1: dict[str, Any], baseline: bool) -> dict[str, Any]:
    def totals(f: dict[str, Any]) -> dict[str, Any]:
        # The save's exchanges; the manager's construction (init:*) once a job, apart.
        init = [x for x in f["log"] if x["phase"].startswith("init")]
        log = [x for x in f["log"] if not x["phase"].startswith("init")]
        return {
            "collectives": sum(1 for x in log if x["op"] != "barrier"),
            "barriers": sum(1 for x in log if x["op"] == "barrier"),
            "sent": sum(x["sent"] for x in log),
            "received": sum(x["received"] for x in log),
            "serial_messages": sum(x["serial"] for x in log),
            "save_cpu": f["save_cpu"],
            "coord_cpu": sum(
                v
                for k, v in f["phases_cpu"].items()
                if k.startswith(("x:", "plan", "global", "index"))
            ),
            "phases_cpu": f["phases_cpu"],
            "by_phase": {
                x["phase"]: [x["op"], x["sent"], x["received"]] for x in log if x["op"] != "barrier"
            },
            "init_received": sum(x["received"] for x in init),
        }

    files0 = r0["files"]
    index = files0.get("dtensors.json", 0)
    parts = [v for k, v in files0.items() if k.startswith("_index.rank")]
    part = max([v for k, v in r1["files"].items() if k.startswith("_index.rank")] or [0])
    manifest = files0.get("manifest.json", 0)
    table = files0.get("_ranks.jsonl", 0)
    restore = {}
    restore_manifest = {}
    readers = {}
    for label, m in (("N/2", world // 2), ("2N", world * 2)):
        if parts or part:  # format 3 on: the layout plus the parts of the writers it overlaps
            writers = _writers(Path(r0["step_dir"]), world, m)
            restore[label] = index + writers * part
        else:  # format 2: the whole index
            writers = world
            restore[label] = index
        readers[label] = writers
        # Format 4: the manifest and the rank table's lines of those writers; before, the
        # whole manifest (a row per rank's file).
        restore_manifest[label] = manifest + (writers * table // world if table else 0)
    return {
        "world": world,
        "baseline": baseline,
        "rank0": totals(r0),
        "rank1": totals(r1),
        "index_bytes": index,
        "manifest_bytes": manifest,
        "rank_table_bytes": table,
        "restore_index_read": restore,
        "restore_manifest_read": restore_manifest,
        "restore_parts_read": readers,
        "format_version": r0.get("format_version"),
        "layout": dict(LAYOUT),
    }


def _writers(step: Path, saved: int, restored: int) -> int:
    """How many index parts rank 1 reads to restore on ``restored`` ranks: the writers of
    the boxes its target shards overlap, over every tensor, as ckptstore's own restore
    finds them (``split_index.Layout.boxes`` on the committed ``dtensors.json``).

    The restoring job has the same layout on ``restored`` ranks (for ``fsdp-tp`` the same
    TP size, the data-parallel dim resized); its rank 1's targets are DTensor's boxes.
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from ckptstore.manifest import Manifest
    from ckptstore.sharded import split_index

    manifest = Manifest.from_bytes((step / "manifest.json").read_bytes(), where=str(step))
    layout = split_index.Layout.from_bytes(
        (step / "dtensors.json").read_bytes(),
        str(step),
        strided=split_index.is_strided_format(manifest),
    )
    mshape = mesh_shape(restored)
    coord = coordinate(1, mshape)
    writers: set[int] = set()
    cache: dict[Any, Any] = {}
    for name, entry in layout.tensors.items():
        _, placements = param_layout(_param(name), mshape)
        sizes, offs = _compute_local_shape_and_global_offset(entry.shape, mshape, coord, placements)
        if 0 in sizes:
            continue
        hi = [o + n for o, n in zip(offs, sizes, strict=True)]
        writers.update(w for _, _, w in layout.boxes(name, list(offs), hi, cache))
    return len(writers)


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'':9}{'ranks':>6} | {'r0 recv':>9} {'r0 cpu':>7} {'r0 serial':>9} | "
        f"{'r1 sent':>8} {'r1 recv':>8} {'r1 coord cpu':>12} {'coll':>4} | "
        f"{'index':>9} {'manifest':>9} {'restore N/2':>11} {'2N':>9} {'r-manifest':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if r.get("skipped"):
            lines.append(f"{r['label']:9}{r['world']:>6} | not run ({r['skipped']})")
            continue
        a, b = r["rank0"], r["rank1"]
        lines.append(
            f"{r['label']:9}{r['world']:>6} | {_b(a['received']):>9} {a['save_cpu']:>7.2f} "
            f"{a['serial_messages']:>9} | {_b(b['sent']):>8} {_b(b['received']):>8} "
            f"{b['coord_cpu']:>12.3f} {b['collectives']:>4} | {_b(r['index_bytes']):>9} "
            f"{_b(r['manifest_bytes']):>9} {_b(r['restore_index_read']['N/2']):>11} "
            f"{_b(r['restore_index_read']['2N']):>9} "
            f"{_b(r.get('restore_manifest_read', {}).get('N/2', r['manifest_bytes'])):>10}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    p.add_argument("--baseline", metavar="REV", help="also run the ckptstore of this commit")
    p.add_argument("--baseline-max", type=int, default=4096, help="largest N for the baseline")
    p.add_argument("--timeout", type=float, default=900, help="seconds a simulated rank may take")
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--layout",
        choices=("fsdp", "fsdp-tp"),
        default="fsdp",
        help="FSDP2 on a 1-D mesh, or FSDP2 over tensor parallelism on (N / TP, TP)",
    )
    p.add_argument("--tp", type=int, default=8, help="the TP size of --layout fsdp-tp")
    p.add_argument(
        "--fork",
        action="store_true",
        help="fork this tree's simulated ranks from this process, which imports torch and "
        "ckptstore once, instead of a fresh interpreter each (the baseline's never)",
    )
    p.add_argument("--one", type=int, nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tape", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--baseline-mode", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    LAYOUT.update(kind=args.layout, tp=args.tp)
    if args.one:
        one(args.one[0], args.one[1], args.out, args.tape, args.baseline_mode)
        return
    results: list[dict[str, Any]] = []
    if args.fork:
        preload()
    with tempfile.TemporaryDirectory(prefix="ckpt-scale-sim-") as tmp:
        work = Path(tmp)
        code = None
        if args.baseline:
            code = extract(args.baseline, work / "baseline")
        for world in args.worlds:
            for label, tree in (("current", None), ("baseline", code)):
                if label == "baseline" and tree is None:
                    continue
                if label == "baseline" and world > args.baseline_max:
                    results.append({"label": label, "world": world, "skipped": "--baseline-max"})
                    continue
                got = run_world(world, work, tree, args.timeout, args.fork)
                if got is None:
                    results.append({"label": label, "world": world, "skipped": "timed out"})
                else:
                    results.append({"label": label, **got})
                print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

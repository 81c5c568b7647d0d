"""Randomized resharding: DTensors of random shapes, dtypes and placements, saved on one
world and mesh and restored on another (``tools/reshard_fuzz.py``, ``tests/test_reshard_fuzz.py``).

Run by ``tests/multirank/worker.py`` as ``fuzz_scenarios:<name>``. A trial's spec (made by
:func:`make_trial` from a seed, the same on every rank) names each tensor's shape, dtype
and seed, and its placements on the save mesh and on the restore mesh. Every rank builds
each full tensor from its seed, so what a rank restored is compared, bit for bit, with its
slice of the tensor that was saved.
"""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptstore import CheckpointManager
from ckptstore.sharded.plan import is_dtensor
from tests.multirank.scenarios import Ctx

#: dtype names a trial draws from: every safetensors dtype torch has (complex aside).
DTYPES = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "uint16",
    "uint32",
    "uint64",
)

#: The share of tensors saved, or restored, as plain tensors rather than DTensors.
PLAIN = 0.15

#: The share of saves, and of restores, made through DCP's API over ckptstore.
DCP = 0.25

#: Restore targets are filled with this byte first: a box nothing wrote shows as a mismatch.
SENTINEL = 0x5A


def full_tensor(shape: list[int], dtype: str, seed: int) -> torch.Tensor:
    """The tensor a spec names: the same bytes on every rank and in every process."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    if dt.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dt == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(dt)
    return torch.randint(-100, 100, shape, generator=g).to(dt)


def _meshes(world: int, rnd: random.Random) -> list[int]:
    """A mesh shape for ``world`` ranks: 1-D, or 2-D where ``world`` factors."""
    two = [[a, world // a] for a in range(2, world) if world % a == 0]
    if two and rnd.random() < 0.5:
        return rnd.choice(two)
    return [world]


def _placements(ndim: int, mesh_dims: int, rnd: random.Random) -> list[str]:
    """One of "R" or "S<dim>" per mesh dimension (a 0-d tensor can only be replicated)."""
    out = []
    for _ in range(mesh_dims):
        if ndim == 0 or rnd.random() < 0.25:
            out.append("R")
        else:
            out.append(f"S{rnd.randrange(ndim)}")
    return out


#: The share of tensors on a 2-D mesh laid out as FSDP2 over TP does, ``(_StridedShard(d,
#: sf=mesh[1]), Shard(d))`` (spelled ``X<d>:<sf>`` then ``S<d>``), where that is a box.
STRIDED = 0.25


class _Coord:
    """A mesh of ``shape`` seen from ``coord``: what ``shard_is_box`` asks of one."""

    def __init__(self, shape: list[int], coord: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self._coord = list(coord)

    def get_coordinate(self) -> list[int]:
        return self._coord

    def size(self, mdim: int) -> int:
        return self.shape[mdim]


def _strided(shape: list[int], mesh: list[int], rnd: random.Random) -> list[str] | None:
    """FSDP2 over TP's placements for a tensor on a 2-D ``mesh``, if every rank's part is a
    box (``shard_is_box``: a save refuses any other). Its rows may not divide by the TP
    size: such a step keeps format 2's full chunk list, divisible ones format 5."""
    import itertools

    from ckptstore.state.redistribute import shard_is_box

    if len(mesh) != 2 or not shape:
        return None
    d = rnd.randrange(len(shape))
    names = [f"X{d}:{mesh[1]}", f"S{d}"]
    objs = _placement_objects(names)
    coords = itertools.product(range(mesh[0]), range(mesh[1]))
    if not all(shard_is_box(shape, _Coord(mesh, c), objs) for c in coords):
        return None
    return names


def _shape(rnd: random.Random) -> list[int]:
    """Small and uneven mostly (dims under the mesh size included), now and then over a
    chunk block (256 KiB), so runs span blocks and start mid-block."""
    ndim = rnd.choice([0, 1, 1, 2, 2, 2, 3])
    if ndim and rnd.random() < 0.2:
        rows = rnd.randrange(1, 9)
        cols = rnd.randrange(40_000, 200_000)
        return [rows, cols] if ndim >= 2 else [rows * cols]
    return [
        rnd.choice([0, 1, 2, 3, 5, 7, 8, 13]) if rnd.random() < 0.6 else rnd.randrange(1, 40)
        for _ in range(ndim)
    ]


def make_trial(seed: int, save_world: int, restore_world: int, n: int = 8) -> dict[str, Any]:
    """A trial's spec: ``n`` tensors, a save mesh and a restore mesh, placements on each."""
    rnd = random.Random(seed)
    save_mesh = _meshes(save_world, rnd)
    restore_mesh = _meshes(restore_world, rnd)
    tensors = []
    for i in range(n):
        shape = _shape(rnd)
        tensors.append(
            {
                "name": f"t{i}",
                "shape": shape,
                "dtype": rnd.choice(DTYPES),
                "seed": rnd.randrange(1 << 30),
                "save": _placements(len(shape), len(save_mesh), rnd),
                "restore": _placements(len(shape), len(restore_mesh), rnd),
                # A plain tensor (every rank the whole of it) now and then, on either side.
                "save_plain": rnd.random() < PLAIN,
                "restore_plain": rnd.random() < PLAIN,
            }
        )
    # Drawn apart, so the trials of earlier campaigns keep their other draws.
    srnd = random.Random(seed * 7919 + 17)
    for t in tensors:
        for side, mesh in (("save", save_mesh), ("restore", restore_mesh)):
            if srnd.random() < STRIDED:
                t[side] = _strided(t["shape"], mesh, srnd) or t[side]
    io = ("direct", "buffered", "auto")
    save_kw = {"async_save": rnd.random() < 0.3, "storage_options": {"io": rnd.choice(io)}}
    restore_kw = {"storage_options": {"io": rnd.choice(io)}}
    return {
        "seed": seed,
        "save_kw": save_kw,
        "restore_kw": restore_kw,
        # Through DCP's API over ckptstore (CkptStoreWriter, CkptStoreReader) now and then,
        # on either side, independently.
        "save_api": "dcp" if rnd.random() < DCP else "ckpt",
        "restore_api": "dcp" if rnd.random() < DCP else "ckpt",
        "save_world": save_world,
        "restore_world": restore_world,
        "save_mesh": save_mesh,
        "restore_mesh": restore_mesh,
        "tensors": tensors,
    }


def _placement_objects(names: list[str]) -> list[Any]:
    """``R``, ``S<d>`` and ``X<d>:<sf>`` (``_StridedShard(d, split_factor=sf)``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in names:
        if p.startswith("X"):
            d, sf = p[1:].split(":")
            out.append(_StridedShard(int(d), split_factor=int(sf)))
        else:
            out.append(Replicate() if p == "R" else Shard(int(p[1:])))
    return out


def saved_format(root: Path) -> int | None:
    """The format version of the first step in a store (what a trial saved), if any."""
    import json

    steps = sorted(root.glob("step-*/manifest.json"))
    return int(json.loads(steps[0].read_text())["format_version"]) if steps else None


def _mesh(shape: list[int]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("a", "b")[: len(shape)]
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


#: dtypes gloo's collectives refuse ("Invalid scalar type"), and the dtype of their size
#: that stands in for them while ``distribute_tensor`` scatters the bytes.
_GLOO_AS = {
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
    torch.int16: torch.float16,
    torch.uint16: torch.float16,
    torch.uint32: torch.int32,
    torch.uint64: torch.int64,
}


def _distribute(full: torch.Tensor, mesh: Any, placements: list[str]) -> Any:
    """``distribute_tensor`` (torch's own cut), for the dtypes gloo cannot send too."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    objs = _placement_objects(placements)
    # torch scatters a _StridedShard only where it splits evenly; every rank holds the same
    # full tensor here, so each cuts its own part instead.
    src: int | None = None if any(p.startswith("X") for p in placements) else 0
    stand_in = _GLOO_AS.get(full.dtype)
    if stand_in is None:
        return distribute_tensor(full, mesh, objs, src_data_rank=src)
    d = distribute_tensor(full.view(stand_in), mesh, objs, src_data_rank=src)
    return DTensor.from_local(
        d.to_local().view(full.dtype),
        mesh,
        d.placements,
        run_check=False,
        shape=d.shape,
        stride=d.stride(),
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN-safe: the bytes, not the values)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def step_state(trial: dict[str, Any], mesh: Any, step: int = 1) -> dict[str, Any]:
    """What the trial saves as ``step``: its tensors (seeds moved by the step), DTensors on
    ``mesh`` or plain, and a plain tensor beside them."""
    weights: dict[str, Any] = {}
    for t in trial["tensors"]:
        full = full_tensor(t["shape"], t["dtype"], t["seed"] + step - 1)
        weights[t["name"]] = full if t["save_plain"] else _distribute(full, mesh, t["save"])
    return {"weights": weights, "plain": torch.arange(5) + step - 1}


def fuzz_save(ctx: Ctx) -> dict[str, Any]:
    """Save the trial's tensors as DTensors on its save mesh (and a plain tensor beside):
    step 1, or each step of ``args["steps"]``."""
    trial = ctx.args["trial"]
    mesh = _mesh(trial["save_mesh"])
    with CheckpointManager(ctx.root, keep=None, barrier_timeout=60, **trial["save_kw"]) as m:
        for step in ctx.args.get("steps", [1]):
            state = step_state(trial, mesh, step)
            if trial.get("save_api") == "dcp":
                import torch.distributed.checkpoint as dcp

                from ckptstore.dcp import CkptStoreWriter

                writer = CkptStoreWriter(m, step=step)
                dcp.save(state, storage_writer=writer, process_group=writer.process_group)
            else:
                m.save(step, state)
    return {"rank": dist.get_rank()}


def fuzz_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore into the trial's restore placements; every rank's mismatches, by name,
    against the step it restored (``step_state``), and that step."""

    trial = ctx.args["trial"]
    mesh = _mesh(trial["restore_mesh"])
    weights: dict[str, Any] = {}
    for t in trial["tensors"]:
        blank = torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]))
        blank.reshape(-1).view(torch.uint8).fill_(SENTINEL)
        weights[t["name"]] = blank if t["restore_plain"] else _distribute(blank, mesh, t["restore"])
    if trial.get("restore_api") == "dcp":
        import torch.distributed.checkpoint as dcp

        from ckptstore.dcp import CkptStoreReader

        # DCP loads into the caller's tensors: the plain one too.
        state: dict[str, Any] = {"weights": weights, "plain": torch.zeros(5, dtype=torch.int64)}
        dcp.load(state, storage_reader=CkptStoreReader(ctx.root, step=1, **trial["restore_kw"]))
        step = 1
    else:
        state = {"weights": weights, "plain": None}
        with CheckpointManager(ctx.root, keep=None, barrier_timeout=60, **trial["restore_kw"]) as m:
            step = m.restore(state)
    wrong = []
    # A forged state.json (tools/meta_fuzz.py) may hand back another structure: what is
    # not where it was saved counts as wrong.
    out = state["weights"] if isinstance(state.get("weights"), dict) else {}
    for t in trial["tensors"]:
        got = out.get(t["name"])
        if not isinstance(got, torch.Tensor):
            wrong.append(t["name"])
            continue
        # What step_state saved as this step (step 1 in a store of one step).
        full = full_tensor(t["shape"], t["dtype"], t["seed"] + step - 1)
        if t["restore_plain"]:
            if not isinstance(got, torch.Tensor) or is_dtensor(got) or not _same(got, full):
                wrong.append(t["name"])
            continue
        want = _distribute(full, mesh, t["restore"])
        if not is_dtensor(got):
            wrong.append(t["name"])
            continue
        if [str(p) for p in got.placements] != [str(p) for p in want.placements] or not _same(
            got.to_local(), want.to_local()
        ):
            wrong.append(t["name"])
    plain = state.get("plain")
    plain = (plain - (step - 1)).tolist() if isinstance(plain, torch.Tensor) else repr(plain)
    return {"wrong": wrong, "plain": plain, "step": step}


def trial_of(seed: int) -> dict[str, Any]:
    """The trial of ``seed``: its worlds (1-4 ranks each) drawn first, then the rest."""
    rnd = random.Random(seed)
    return make_trial(seed, rnd.choice([1, 2, 3, 4]), rnd.choice([1, 2, 3, 4]))


def run_trial(
    seed: int, workdir: Path, *, timeout: float = 120.0
) -> tuple[list[str], dict[str, Any]]:
    """One trial: save on a random world (1-4 ranks) and restore on another, then in this
    process (``load`` and ``restore`` into plain tensors) and ``ckptstore verify``.

    Returns what went wrong (nothing: an empty list) and the trial's spec. ``workdir`` is
    removed when nothing went wrong, and kept for a look when something did.
    """
    import shutil

    from ckptstore.cli.main import main as cli
    from tests.multirank.launch import describe, launch

    trial = trial_of(seed)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    problems: list[str] = []
    for scenario, world in (
        ("fuzz_save", trial["save_world"]),
        ("fuzz_restore", trial["restore_world"]),
    ):
        res = launch(
            f"fuzz_scenarios:{scenario}", world, workdir, timeout=timeout, args={"trial": trial}
        )
        if not all(r.ok for r in res):
            return [f"{scenario} on {world} ranks failed: {describe(res)}"], trial
    for r, v in enumerate(r.value for r in res):
        if v["wrong"]:
            problems.append(
                f"restore on {trial['restore_world']} ranks: rank {r} wrong {v['wrong']}"
            )
        if v["plain"] != list(range(5)):
            problems.append(
                f"restore on {trial['restore_world']} ranks: rank {r} plain {v['plain']}"
            )
    root = workdir / "store"
    trial["format"] = saved_format(root)
    with CheckpointManager(root, keep=None, **trial["restore_kw"]) as m:
        got = m.load(1)
        into = {
            "weights": {
                t["name"]: torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"]))
                for t in trial["tensors"]
            },
            "plain": None,
        }
        m.restore(into)
    for t in trial["tensors"]:
        full = full_tensor(t["shape"], t["dtype"], t["seed"])
        if not _same(got["weights"][t["name"]], full):
            problems.append(f"load() in one process: {t['name']} wrong")
        if not _same(into["weights"][t["name"]], full):
            problems.append(f"restore() in one process: {t['name']} wrong")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = cli(["verify", str(root)])
    if status != 0:
        problems.append(f"ckptstore verify failed: {out.getvalue()}")
    if not problems:
        shutil.rmtree(workdir, ignore_errors=True)
    return problems, trial


# ---- modules: FSDP2, HSDP, TP and FSDP2 over TP, trained, saved and restored on other meshes


def make_module_trial(seed: int) -> dict[str, Any]:
    """A model of random Linear layers (uneven sizes, some over a chunk block), the
    parallelism it is saved under and the one it is restored into."""
    rnd = random.Random(seed)
    n = rnd.randrange(1, 6)
    dims = [rnd.choice([1, 2, 3, 5, 7, 9, 16, 33]) for _ in range(n + 1)]
    if rnd.random() < 0.3:  # one wide layer: shards over several chunk blocks
        dims[rnd.randrange(1, n + 1)] = rnd.choice([3000, 9000])
    # A column-wise layer's output (dims 1, 3, ...) splits evenly over 2, 3 and 4 ranks: torch's
    # tensor parallelism assumes it (RowwiseParallel rebuilds its input from even shards).
    for i in range(1, n, 2):
        dims[i] = -(-dims[i] // 12) * 12
    sides = []
    for _ in range(2):
        world = rnd.choice([1, 2, 3, 4])
        kinds = ["fsdp", "tp"] + (["hsdp", "fsdp_tp"] if world == 4 else [])
        sides.append({"world": world, "kind": rnd.choice(kinds)})
    trial = {
        "seed": seed,
        "kind": "module",
        "dims": dims,
        "bias": [rnd.random() < 0.7 for _ in range(n)],
        "save": sides[0],
        "restore": sides[1],
        "save_kw": {"async_save": rnd.random() < 0.3},
    }
    if rnd.random() < 0.2:  # a replicated save: one process, the model as it is (drawn last)
        trial["save"] = {"world": 1, "kind": "plain"}
    return trial


def build_module(trial: dict[str, Any], seed: int) -> nn.Sequential:
    """The trial's model (Linear, ReLU, Linear, ...), its weights from ``seed``."""
    torch.manual_seed(seed)
    dims, layers = trial["dims"], []
    for i, bias in enumerate(trial["bias"]):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(dims[i], dims[i + 1], bias=bias))
    return nn.Sequential(*layers)


def parallelize(model: nn.Sequential, side: dict[str, Any]) -> None:
    """``side["kind"]`` on ``side["world"]`` ranks: ``fsdp`` (FSDP2 on a 1-D mesh), ``hsdp``
    (2x2), ``tp`` (column- then row-wise pairs; a last odd layer replicated), ``fsdp_tp``
    (FSDP2 over TP on 2x2, torchtitan's 2-D layout) or ``plain`` (one process, nothing)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    kind, world = side["kind"], side["world"]
    if kind == "plain":  # not parallelized: whole tensors (a replicated step)
        return
    linears = [k for k, m in model.named_children() if isinstance(m, nn.Linear)]
    if kind in ("tp", "fsdp_tp"):
        mesh = init_device_mesh(
            "cpu", (2, 2) if kind == "fsdp_tp" else (1, world), mesh_dim_names=("dp", "tp")
        )
        plan: dict[str, Any] = {}
        for a, b in zip(linears[0::2], linears[1::2], strict=False):
            plan[a], plan[b] = ColwiseParallel(), RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        if len(linears) % 2:  # the last layer, alone: replicated over "tp"
            last = getattr(model, linears[-1])
            for name, p in list(last.named_parameters()):
                d = distribute_tensor(p.data, mesh["tp"], [Replicate()])
                setattr(last, name, nn.Parameter(d))
            last.register_forward_pre_hook(lambda _m, args: _as_replicated(args, mesh["tp"]))
            last.register_forward_hook(lambda _m, _a, out: out.to_local())
        if kind == "tp":
            return
        dp = mesh["dp"]
    elif kind == "hsdp":
        dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for k in linears:
        fully_shard(getattr(model, k), mesh=dp)
    fully_shard(model, mesh=dp)


def _as_replicated(args: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate

    x = args[0]
    return (x if is_dtensor(x) else DTensor.from_local(x, mesh, [Replicate()]),)


def train_module(model: nn.Module, trial: dict[str, Any], steps: int = 2) -> torch.optim.Optimizer:
    """AdamW, ``steps`` steps on the same inputs on every rank: moments to save."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(trial["seed"])
    for _ in range(steps):
        model(torch.randn(3, trial["dims"][0], generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


def module_digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """A digest of every full tensor of ``model`` and of its AdamW state (collective)."""
    from tests.multirank.dtensor_scenarios import digests

    return digests(model, opt)


def fuzz_module_save(ctx: Ctx) -> dict[str, Any]:
    """Build, parallelize and train the trial's model; save it; its digests."""
    trial = ctx.args["trial"]
    model = build_module(trial, trial["seed"])
    parallelize(model, trial["save"])
    opt = train_module(model, trial)
    with CheckpointManager(ctx.root, keep=None, barrier_timeout=60, **trial["save_kw"]) as m:
        m.save(1, {"model": model, "optim": opt})
    return {"digests": module_digests(model, opt)}


def fuzz_module_restore(ctx: Ctx) -> dict[str, Any]:
    """Restore into the trial's model under its restore parallelism (other weights, a
    fresh AdamW); its digests."""
    trial = ctx.args["trial"]
    model = build_module(trial, trial["seed"] + 1)
    parallelize(model, trial["restore"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(ctx.root, keep=None, barrier_timeout=60) as m:
        m.restore({"model": model, "optim": opt})
    return {"digests": module_digests(model, opt)}


def run_module_trial(
    seed: int, workdir: Path, *, timeout: float = 120.0
) -> tuple[list[str], dict[str, Any]]:
    """One module trial: save under one parallelism, restore under another and in one
    process (a plain model, a fresh AdamW); every full tensor's digest compared."""
    import shutil

    from tests.multirank.dtensor_scenarios import digests
    from tests.multirank.launch import describe, launch

    trial = make_module_trial(seed)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    vals = []
    for scenario, side in (("fuzz_module_save", "save"), ("fuzz_module_restore", "restore")):
        world = trial[side]["world"] if trial[side]["kind"] in ("fsdp", "tp", "plain") else 4
        res = launch(
            f"fuzz_scenarios:{scenario}", world, workdir, timeout=timeout, args={"trial": trial}
        )
        if not all(r.ok for r in res):
            return [f"{scenario} ({trial[side]}) failed: {describe(res)}"], trial
        vals.append([r.value for r in res])
    saved = vals[0][0]["digests"]
    trial["format"] = saved_format(workdir / "store")

    def differ(got: dict[str, str]) -> list[str]:
        return sorted(k for k in set(saved) | set(got) if got.get(k) != saved.get(k))

    problems = [
        f"restore under {trial['restore']}: rank {r}: {differ(v['digests'])}"
        for r, v in enumerate(vals[1])
        if v["digests"] != saved
    ]
    model = build_module(trial, trial["seed"] + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(workdir / "store", keep=None) as m:
        m.restore({"model": model, "optim": opt})
    one = digests(model, opt)
    if one != saved:
        problems.append(
            f"restore in one process: {sorted(k for k in saved if one.get(k) != saved[k])}"
        )
    if not problems:
        shutil.rmtree(workdir, ignore_errors=True)
    return problems, trial

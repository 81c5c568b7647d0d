"""Crash campaign for sharded saves: FSDP2 jobs killed in every phase, every invariant checked.

    python tools/crash_sharded.py [--trials N] [--seed S] [--json OUT] [--verbose]

Each trial runs a job of 2 or 3 ranks (gloo on loopback, forked from a server that imported
torch once) whose model is ``fully_shard``-ed per layer (uneven rows: 7 and 5 do not split
evenly over 2 or 3 ranks). The job saves step after step, synchronously or asynchronously, on
one shared root or on node-local roots (one root per rank, each a "node") with a filesystem
replica. Before each save every tensor of the state (parameters and AdamW moments) is set to
a value that is a function of the step alone, so any restored step can be checked bit for bit.

One of four faults is injected:

- ``kill-one``: SIGKILL of one rank, after a random delay or at a random one of its protocol
  waits (planning, gathering, preparing, publishing: the coordinator's collectives);
- ``kill-all``: SIGKILL of every rank at once, after a random delay (a power loss of the job);
- ``stop-one``: SIGSTOP of one rank at a random wait: it hangs with its sockets open, and only
  the timeout can tell.

After each trial, from this process:

1. every survivor raised ``BarrierTimeout`` or ``CommitError`` naming the dead rank, within
   ``barrier_timeout`` plus a margin of the death (never hung, never blamed a live rank);
2. the newest visible step is the last acknowledged one or the one in flight, never older
   (nothing acknowledged is lost) and never newer;
3. every visible step verifies deeply and restores bit-exact in one process (no process
   group), the node-local ones through the replica; every ``--wide-every``-th trial also
   restores the newest step on 3 ranks and checks each full tensor;
4. a new job on the same roots resumes the newest step and saves the next one (on node-local
   roots its uploads complete: the replica then holds the step whole).

Prints a summary; exits 1 on any violation (each listed), 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools")]
from forkchild import emit, finish, freeze  # noqa: E402
from linechild import LineChild  # noqa: E402
from rendezvous import init_group  # noqa: E402

#: barrier_timeout of the jobs, and the slack allowed on top of it for a survivor to report.
TIMEOUT = 3.0
SLACK = 6.0 * float(os.environ.get("CKPTSTORE_TEST_SLOWDOWN", "1"))
FAULTS = ("kill-one", "kill-all", "stop-one")


# ---- the job's state -------------------------------------------------------------------------


def make_net() -> Any:
    """The model: uneven layers, a buffer (replicated state beside the shards)."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 7)
            self.mid = nn.Linear(7, 5)
            self.out = nn.Linear(5, 3)
            self.register_buffer("scale", torch.tensor([0.5, 2.0, 1.5]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor = self.out(torch.relu(self.mid(torch.relu(self.inp(x))))) * self.scale
            return y

    torch.manual_seed(0)
    return Net()


def expected(step: int, name: str, shape: Any) -> Any:
    """The full value every tensor ``name`` holds at ``step``: distinct per element and step."""
    import torch

    salt = sum(name.encode()) % 97
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) * 0.001 + step * 10.0 + salt).reshape(shape)


def tensors_of(model: Any, opt: Any) -> dict[str, Any]:
    """Every tensor of the state by a stable name: parameters and AdamW moments."""
    out = {f"model/{n}": p for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                out[f"optim/{names[id(p)]}/{k}"] = st[k]
    return out


def set_values(model: Any, opt: Any, step: int) -> None:
    """Every tensor (sharded or not) set to ``expected(step, ...)``; collective-free."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, t in tensors_of(model, opt).items():
            full = expected(step, name, t.shape)
            if isinstance(t, DTensor):
                t.to_local().copy_(
                    distribute_tensor(
                        full, t.device_mesh, t.placements, src_data_rank=None
                    ).to_local()
                )
            else:
                t.copy_(full)
        for st in opt.state.values():
            st["step"] = torch.tensor(float(step))


def mismatches(model: Any, opt: Any, step: int) -> list[str]:
    """Names of the tensors whose full value is not ``expected(step)`` (collective on DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    bad = []
    for name, t in sorted(tensors_of(model, opt).items()):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if not torch.equal(full.detach().cpu(), expected(step, name, full.shape)):
            bad.append(name)
    return bad


def build(world: int) -> tuple[Any, Any]:
    """The FSDP2 model (or a plain one when ``world`` is 1) and AdamW with its state created."""
    import torch

    model = make_net()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model.inp, model.mid, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


# ---- ranks (forked by the server) ----------------------------------------------------------


def _manager(job: dict[str, Any], rank: int) -> Any:
    from ckptstore import CheckpointManager

    root = job["roots"][rank] if job["nodes"] else job["roots"][0]
    return CheckpointManager(
        root,
        keep=2,
        async_save=job["async"],
        replica=job.get("replica"),
        barrier_timeout=TIMEOUT,
    )


def _hook_waits(rank: int, job: dict[str, Any]) -> None:
    """Die (or freeze) at the victim's ``kill_at``-th coordinator wait, before or after it."""
    from ckptstore.dist import Coordinator

    if rank not in job["victims"] or not job["kill_at"]:
        return
    sig = signal.SIGSTOP if job["fault"] == "stop-one" else signal.SIGKILL
    calls = 0

    def wrap(real: Any) -> Any:
        def waiting(self: Any, *a: Any, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            phase = a[0] if a and isinstance(a[0], str) else kw.get("phase", "?")
            if calls == job["kill_at"] and job["kill_when"] == "before":
                emit(f"dying {rank} {time.time():.6f} before {phase}")
                os.kill(os.getpid(), sig)
            out = real(self, *a, **kw)
            if calls == job["kill_at"] and job["kill_when"] == "after":
                emit(f"dying {rank} {time.time():.6f} after {phase}")
                os.kill(os.getpid(), sig)
            return out

        return waiting

    # Every exchange goes through barrier or _collective (gather, all_gather, broadcast).
    Coordinator.barrier = wrap(Coordinator.barrier)  # type: ignore[method-assign]
    Coordinator._collective = wrap(Coordinator._collective)  # type: ignore[method-assign]


def run_rank(rank: int, job: dict[str, Any]) -> int:
    """A rank that resumes, then saves step after step until it dies or a peer does."""
    import faulthandler

    from ckptstore import BarrierTimeout, CommitError

    init_group(rank, job["world"], job["port_file"])
    faulthandler.dump_traceback_later(TIMEOUT + SLACK + 40, exit=True)
    model, opt = build(job["world"])
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    mgr = _manager(job, rank)
    start = mgr.resume(state)
    if start and job.get("check_resume"):
        bad = mismatches(model, opt, start - 1)
        emit(f"resumed {rank} {start - 1} {json.dumps(bad)}")
    emit(f"ready {rank} {os.getpid()}")
    _hook_waits(rank, job)
    try:
        for step in range(start, start + job["steps"]):
            set_values(model, opt, step)
            state["step"] = step
            emit(f"saving {rank} {step}")
            handle = mgr.save(step, state)
            if job["async"]:
                set_values(model, opt, step + 1000)  # training goes on: the save was staged
                handle.wait()
            emit(f"acked {rank} {step}")
        mgr.close()
        emit(f"done {rank}")
        return 0
    except (BarrierTimeout, CommitError) as e:
        out = {"rank": rank, "error": type(e).__name__, "at": time.time(), "message": str(e)}
        out["missing"] = list(getattr(e, "missing_ranks", None) or [])
        emit("outcome " + json.dumps(out))
        with contextlib.suppress(BaseException):
            mgr.close()
        return 2
    except BaseException as e:
        out = {"rank": rank, "error": type(e).__name__, "at": time.time(), "message": str(e)}
        emit("outcome " + json.dumps(out))
        emit("trace " + traceback.format_exc().replace("\n", " | "))
        return 1


def run_wide_restore(rank: int, job: dict[str, Any]) -> int:
    """A 3-rank restore of the newest step: every full tensor checked."""

    init_group(rank, job["world"], job["port_file"])
    model, opt = build(job["world"])
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": -1}
    mgr = _manager(job, rank)
    got = mgr.resume(state) - 1
    bad = mismatches(model, opt, got) if got >= 0 else ["nothing restored"]
    emit(f"wide {rank} {got} {json.dumps(bad)}")
    mgr.close()
    return 0


def _child(fn: Any, rank: int, job: dict[str, Any]) -> NoReturn:
    # A survivor of a dead peer exits without destroying the process group: its
    # collectives would wait for the dead rank (torch's, not ckptstore's).
    finish(lambda: fn(rank, job), lambda tb: emit("error " + tb.replace("\n", " | ")))


def serve() -> int:
    """Fork the ranks of each JSON job read from stdin; report how each ended."""
    import torch

    torch.set_num_threads(1)
    # What the ranks import lazily, imported once here instead of in every forked rank (40
    # in a short campaign): torch._dynamo (FSDP2's first DTensor, in fully_shard: 1.6 s of
    # CPU a rank), torch.distributed.checkpoint (a restore) and safetensors (a save).
    import safetensors.torch  # noqa: F401
    import torch._dynamo
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.distributed.tensor

    import ckptstore.manager  # noqa: F401

    freeze()  # what the server made, out of the children's collections
    emit("serving")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        fn = run_wide_restore if job["kind"] == "wide" else run_rank
        pids = []
        for rank in range(job["world"]):
            pid = os.fork()
            if pid == 0:
                _child(fn, rank, job)
            pids.append(pid)
        for _ in pids:
            pid, status = os.wait()
            how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "code"
            emit(f"exit {pid} {how} {os.WEXITSTATUS(status) if not os.WIFSIGNALED(status) else ''}")
        emit("jobdone")
    return 0


# ---- the campaign --------------------------------------------------------------------------


class Server(LineChild):
    """The fork server, seen from the campaign: submit a job, read its lines."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        super().__init__([sys.executable, __file__, "--serve"], env, merge_stderr=True)
        self.until("serving", 180)


#: Numbers the jobs of this campaign (their rendezvous files).
_JOBS = itertools.count()


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def run_job(
    server: Server, job: dict[str, Any], fault: str | None, rng: random.Random
) -> dict[str, Any]:
    """Submit ``job`` (its rendezvous file a new one), inject ``fault`` (delay-based kills from
    here), collect every line."""
    job = dict(job, port_file=os.path.join(job["base"], f"port-{next(_JOBS)}"))
    lines: list[tuple[float, str]] = []
    server.submit(job)
    pids: dict[int, int] = {}
    died_at = None
    stopped = False
    inject = True  # the delay-based kills below

    def dying(line: str) -> None:
        nonlocal died_at, stopped
        if line.startswith("dying "):
            died_at = float(line.split()[2])
            stopped = fault == "stop-one"

    while len(pids) < job["world"]:
        line = server.until("", 120, lines)
        # A victim may reach its fault before the last rank is ready (kill_at 1: its first
        # wait): a frozen one is killed below only if its "dying" line was seen.
        dying(line)
        if line.startswith("ready "):
            _, r, pid_s = line.split()
            pids[int(r)] = int(pid_s)
        if line == "jobdone":
            return {"lines": lines, "pids": pids, "died_at": None}
        if line.startswith("error "):
            # A rank failed before the fault: inject nothing, but read the job to its end.
            # Returning here left the other ranks' lines (their timeouts, "jobdone") to be
            # read as the next job's, which then failed in turn without a cause of its own.
            inject = False
            break
    if inject and fault == "kill-all":
        time.sleep(rng.uniform(0.0, 1.5))
        died_at = time.time()
        for pid in pids.values():
            _kill(pid, signal.SIGKILL)
    elif inject and fault == "kill-one" and not job["kill_at"]:
        time.sleep(rng.uniform(0.0, 1.5))
        died_at = time.time()
        _kill(pids[job["victims"][0]], signal.SIGKILL)
    deadline = time.monotonic() + TIMEOUT + SLACK + 60
    while True:
        try:
            t, line = server.next(max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            for pid in pids.values():
                _kill(pid, signal.SIGKILL)
            lines.append((time.time(), "campaign: the job hung; killed"))
            server.until("jobdone", 60, lines)
            break
        lines.append((t, line))
        dying(line)
        if line == "jobdone":
            break
        # A frozen rank is killed once every survivor has reported (or the deadline ends).
        if stopped and line.startswith("outcome "):
            n = sum(1 for _, x in lines if x.startswith("outcome "))
            if n >= job["world"] - 1:
                _kill(pids[job["victims"][0]], signal.SIGCONT)
                _kill(pids[job["victims"][0]], signal.SIGKILL)
    if stopped:
        _kill(pids[job["victims"][0]], signal.SIGKILL)
    return {"lines": lines, "pids": pids, "died_at": died_at}


def _restore_single(roots: list[str], nodes: bool, replica: str | None, step: int) -> list[str]:
    """Verify deeply and restore ``step`` into a plain model in this process; the problems."""
    from ckptstore import CheckpointManager

    problems = []
    model, opt = build(1)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": -1}
    # A node-local step is whole on the replica only: verify it there. One process restores
    # the newest step through the replica (its missing ranks' files fetched), and any step of
    # a shared root directly.
    root = replica if nodes and replica else roots[0]
    with CheckpointManager(root) as mgr:
        report = mgr.verify(step, deep=True)
        if not report.ok:
            problems.append(f"step {step} fails deep verify on {root}: {report}")
            return problems
    with CheckpointManager(roots[0], replica=replica if nodes else None) as mgr:
        got = mgr.restore(state) if nodes else mgr.restore(state, step=step)
        if nodes and got != step:
            return problems
    if got != step:
        problems.append(f"restore(step={step}) gave {got}")
    bad = mismatches(model, opt, step)
    if bad or state["step"] != step:
        problems.append(
            f"step {step} restored in one process differs: {bad[:4]}, step={state['step']}"
        )
    return problems


def visible_steps(job: dict[str, Any]) -> list[list[int]]:
    """The committed steps of each root of ``job`` (one root unless node-local)."""
    from ckptstore import CheckpointManager

    visible: list[list[int]] = []
    for root in job["roots"] if job["nodes"] else job["roots"][:1]:
        with CheckpointManager(root) as mgr:
            visible.append(mgr.steps())
    return visible


def _brief(line: str, width: int = 600) -> str:
    """A long line (a traceback) cut in its middle: its start, and its end, which names the
    exception."""
    if len(line) <= width:
        return line
    return line[:150] + " ... " + line[-(width - 150) :]


def check_trial(
    job: dict[str, Any], fault: str, out: dict[str, Any], visible: list[list[int]]
) -> list[str]:
    """The invariants after one trial (``visible``: :func:`visible_steps` after it); each
    violation as a line."""
    lines = [x for _, x in out["lines"]]
    problems = []
    if any(x.startswith("campaign: the job hung") for x in lines):
        problems.append("a rank hung past barrier_timeout + margin")
    if any(x.startswith(("error ", "trace ")) for x in lines):
        problems.append(
            "unexpected error: "
            + _brief(next(x for x in lines if x.startswith(("error ", "trace "))))
        )
    acked = [int(x.split()[2]) for x in lines if x.startswith("acked ")]
    saving = [int(x.split()[2]) for x in lines if x.startswith("saving ")]
    last_acked = max(acked, default=None)
    in_flight = max(saving, default=None)
    outcomes = [json.loads(x[len("outcome ") :]) for x in lines if x.startswith("outcome ")]
    victims = set(job["victims"])
    if fault in ("kill-one", "stop-one"):
        survivors = {o["rank"] for o in outcomes}
        for o in outcomes:
            if o["rank"] in victims:
                continue
            if o["error"] not in ("BarrierTimeout", "CommitError"):
                problems.append(f"rank {o['rank']} raised {o['error']}: {o['message'][:200]}")
            elif victims.isdisjoint(o.get("missing") or []) and not any(
                f"rank {v}" in o["message"] or f"rank(s) {v}" in o["message"] for v in victims
            ):
                problems.append(f"rank {o['rank']} blamed {o.get('missing')}: {o['message'][:200]}")
            if out["died_at"] is not None and o["at"] - out["died_at"] > TIMEOUT + SLACK:
                problems.append(
                    f"rank {o['rank']} reported {o['at'] - out['died_at']:.1f}s after the death"
                )
        # A rank killed after its job ended leaves nothing to report.
        victims_done = all(f"done {v}" in lines for v in victims)
        expected_survivors = set() if victims_done else set(range(job["world"])) - victims
        if out["died_at"] is not None and not expected_survivors <= survivors:
            missing = sorted(expected_survivors - survivors)
            problems.append(f"survivors {missing} never reported an error")
    roots = job["roots"] if job["nodes"] else job["roots"][:1]
    newest = [v[-1] if v else None for v in visible]
    for root, v in zip(roots, visible, strict=True):
        top = v[-1] if v else None
        if last_acked is not None and (top is None or top < last_acked):
            problems.append(f"{root}: newest step {top} but step {last_acked} was acknowledged")
        if top is not None and in_flight is not None and top > in_flight:
            problems.append(f"{root}: step {top} newer than any save ({in_flight})")
    # A node may keep the step in flight where others lack it (tiers/node_commit.py): its
    # rank was killed between its rename and the take-back, or it published and then found
    # a rank missing at the publish round's exchange, where the outcome is not known (rank 0
    # may have told others that every node published) and it keeps its copy. Such a step
    # was acknowledged by no rank, is never restored (the next job resumes the newest step
    # every node holds, checked bit for bit) and is replaced by the next save of it. So the
    # surviving nodes may differ by that one step, never by more, nor by an acknowledged one.
    if job["nodes"]:
        kept = {n for r, n in enumerate(newest) if r not in victims or fault == "kill-all"}
        steps = sorted(n for n in kept if n is not None)
        if (
            fault != "kill-all"
            and len(kept) > 1
            and (
                None in kept
                or len(kept) > 2
                or steps[-1] != in_flight
                or (last_acked is not None and steps[-1] <= last_acked)
            )
        ):
            problems.append(f"surviving node roots disagree on the newest step: {newest}")
        if any(n is not None and last_acked is not None and n < last_acked for n in newest):
            problems.append(f"a node lost the acknowledged step {last_acked}: {newest}")
    return problems


def newest_whole(visible: list[list[int]]) -> int | None:
    """The newest step that every root holds (``visible``: :func:`visible_steps`)."""
    held = set.intersection(*map(set, visible)) if visible else set()
    return max(held) if held else None


def _orphan(job: dict[str, Any], step: int) -> bool:
    """A node's orphan: ``step`` is on some node roots, not all, and not on the replica.

    What a kill of every rank between the nodes' renames of one publish round leaves
    (tiers/node_commit.py): the next job agrees on an older step, and the orphan, never
    whole anywhere, is not a checkpoint anyone can restore.
    """
    from ckptstore import CheckpointManager

    held = []
    for root in job["roots"]:
        with CheckpointManager(root) as mgr:
            held.append(step in mgr.steps())
    on_replica = False
    if job.get("replica"):
        with CheckpointManager(job["replica"]) as mgr:
            on_replica = step in mgr.steps()
    return not all(held) and not on_replica


def check_restores(job: dict[str, Any]) -> list[str]:
    """Every visible step verifies and restores bit-exact in one process (after the next job,
    whose uploads completed: a node-local step is read through the replica)."""
    from ckptstore import CheckpointManager

    with CheckpointManager(job["roots"][0]) as mgr:
        steps = mgr.steps()
    problems = []
    if job["nodes"]:
        steps = [s for s in steps if not _orphan(job, s)]
    for step in steps:
        try:
            problems += _restore_single(job["roots"], job["nodes"], job.get("replica"), step)
        except Exception as e:
            problems.append(f"step {step} does not restore in one process: {type(e).__name__}: {e}")
    return problems


def campaign(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(prefix="ckpt-crash-sharded-")
    server = Server()
    violations: list[str] = []
    counts: dict[str, int] = {}
    t0 = time.time()
    try:
        for i in range(args.trials):
            world = rng.choice((2, 3))
            nodes = rng.random() < args.node_share
            fault = rng.choice(args.faults)
            trial = os.path.join(base, f"t{i}")
            roots = [os.path.join(trial, f"node{r}") for r in range(world)]
            job: dict[str, Any] = {
                "kind": "train",
                "base": base,
                "world": world,
                "async": rng.random() < 0.5,
                "nodes": nodes,
                "roots": roots,
                "replica": os.path.join(trial, "replica") if nodes else None,
                "steps": 40,
                "fault": fault,
                "victims": list(range(world)) if fault == "kill-all" else [rng.randrange(world)],
                # Half the single-rank faults land at a protocol wait, half after a delay.
                "kill_at": rng.randint(1, 24) if fault == "stop-one" or rng.random() < 0.5 else 0,
                "kill_when": rng.choice(("before", "after")),
            }
            if fault == "kill-all":
                job["kill_at"] = 0
            # A first clean job commits two steps, so that the faulty one has something to lose.
            clean = dict(job, steps=2, victims=[], kill_at=0, fault=None)
            pre = run_job(server, clean, None, rng)
            pre_problems = [
                x for _, x in pre["lines"] if x.startswith(("error ", "trace ", "outcome "))
            ]
            out = run_job(server, job, fault, rng)
            problems = [f"clean run: {_brief(p)}" for p in pre_problems]
            visible = visible_steps(job)
            problems += check_trial(job, fault, out, visible)
            # The next job resumes the newest step every root holds (checked bit for bit),
            # and saves on.
            whole = newest_whole(visible)
            nxt = dict(job, steps=1, victims=[], kill_at=0, fault=None, check_resume=True)
            after = run_job(server, nxt, None, rng)
            for _, x in after["lines"]:
                if x.startswith("resumed "):
                    bad = json.loads(x.split(" ", 3)[3])
                    if bad:
                        problems.append(
                            f"the next job resumed step {x.split()[2]} with wrong values: {bad[:4]}"
                        )
                    if int(x.split()[2]) != whole:
                        problems.append(
                            f"the next job resumed step {x.split()[2]}, not {whole}, the newest "
                            "step whole on every root"
                        )
                if x.startswith(("error ", "trace ", "outcome ")):
                    problems.append(f"the next job failed: {_brief(x)}")
            if not problems:
                problems += check_restores(job)
            if args.wide_every and i % args.wide_every == 0 and not problems:
                wide = dict(job, kind="wide", world=3, victims=[], kill_at=0)
                if nodes:
                    wide["roots"] = roots + [os.path.join(trial, "node-extra")] * (3 - len(roots))
                res = run_job(server, wide, None, rng)
                for _, x in res["lines"]:
                    if x.startswith("wide ") and json.loads(x.split(" ", 3)[3]):
                        problems.append(f"3-rank restore: {_brief(x)}")
                    if x.startswith(("error ", "trace ")):
                        problems.append(f"3-rank restore failed: {_brief(x)}")
            where = "node-local+replica" if nodes else "shared"
            key = f"{world} ranks, {where}, {'async' if job['async'] else 'sync'}, {fault}"
            counts[key] = counts.get(key, 0) + 1
            if problems:
                violations += [
                    f"trial {i} ({key}, kill_at={job['kill_at']} {job['kill_when']}): {p}"
                    for p in problems
                ]
            if args.verbose:
                print(f"trial {i}: {key}: {problems if problems else 'OK'}", flush=True)
                if problems:  # what the ranks said, for the diagnosis
                    spec = {k: job[k] for k in ("victims", "kill_at", "kill_when", "async")}
                    print(f"  job {json.dumps(spec)}; died at {out['died_at']}", flush=True)
                    for t, x in out["lines"]:
                        print(f"  {t:.3f} {x[:400]}", flush=True)
            shutil.rmtree(trial, ignore_errors=True)
    finally:
        server.close()
        shutil.rmtree(base, ignore_errors=True)
    kills = sum(counts.values())
    print(
        f"{kills} sharded trials (seed {args.seed}) in {time.time() - t0:.0f}s, "
        f"{len(violations)} violations"
    )
    for k in sorted(counts):
        print(f"  {counts[k]:5d}  {k}")
    for v in violations:
        print("VIOLATION", v)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "seed": args.seed,
                    "faults": args.faults,
                    "node_share": args.node_share,
                    "elapsed_s": round(time.time() - t0),
                    "trials": counts,
                    "violations": violations,
                },
                indent=2,
            )
        )
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--node-share", type=float, default=0.4, help="share of node-local trials")
    p.add_argument("--wide-every", type=int, default=5, help="a 3-rank restore every N trials")
    p.add_argument(
        "--faults",
        type=lambda v: v.split(","),
        default=list(FAULTS),
        help=f"comma list of the faults drawn from (default: {','.join(FAULTS)})",
    )
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if set(args.faults) - set(FAULTS):
        p.error(f"--faults: unknown {sorted(set(args.faults) - set(FAULTS))}; known: {FAULTS}")
    if args.serve:
        return serve()
    return campaign(args)


if __name__ == "__main__":
    sys.exit(main())

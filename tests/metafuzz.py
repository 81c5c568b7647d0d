"""Mutated metadata of a sharded step, its manifest forged to match (``tools/meta_fuzz.py``,
``tests/test_meta_fuzz.py``).

A store of two DTensor steps is saved by a real job (``fuzz_scenarios.fuzz_save``). Each
mutation copies it, changes one value of one JSON file of step 2 (``state.json``, the chunk
index and its per-rank parts, ``_ranks.jsonl``, or the manifest itself), and forges what
checks it (the manifest entry's size and CRC32C, a rank line's CRC32C, the manifest's own
checksum), as a buggy tool or an attacker would: only what the values say can give it away.
Then, in this process:

- ``load(2)`` raises a ``CkptStoreError`` or returns step 2's tensors, every byte;
- ``restore()`` into whole tensors returns step 2 or step 1 (intact), every byte of it,
  never a ``CkptStoreError`` (step 1 is good) nor another exception;
- except that a forged ``state.json`` may say another structure (a key renamed, a value in
  place of a tensor), and a forged header of a plain payload other places for its tensors:
  those files *are* the structure, so what they say is what comes back,
  and only crashes, hangs and memory count for it (and ``restore()`` may refuse the step
  as not fitting the caller's state, ``StateMismatchError``, as it does a step saved from
  another structure);
- ``ckptstore verify --all`` and ``ckptstore inspect --step 2`` exit 0 or 1 and raise
  nothing;
- each takes under :data:`SECONDS`, and the process's peak RSS grows by under
  :data:`RSS_BUDGET`.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import random
import resource
import shutil
import signal
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ckptstore import CheckpointManager, CkptStoreError, StateMismatchError
from ckptstore.integrity import crc32c_of, format_crc
from tests.multirank.fuzz_scenarios import _same, full_tensor, trial_of

#: What one operation on a mutated step may take, in seconds, before it counts as a hang.
SECONDS = 30

#: How much one mutation may grow the process's peak RSS (a forged shape must not allocate).
RSS_BUDGET = 1 << 30

STEP2 = "step-000000000002"


def make_base(seed: int, workdir: Path, *, timeout: float = 120.0) -> tuple[Path, dict[str, Any]]:
    """A store of steps 1 and 2 of the tensor trial of ``seed``, saved by a real job."""
    from tests.multirank.launch import describe, launch

    trial = trial_of(seed)
    trial["save_kw"] = {"async_save": False}
    trial["save_api"] = "ckpt"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    res = launch(
        "fuzz_scenarios:fuzz_save",
        trial["save_world"],
        workdir,
        timeout=timeout,
        args={"trial": trial, "steps": [1, 2]},
    )
    if not all(r.ok for r in res):
        raise RuntimeError(f"the base store of seed {seed} was not saved: {describe(res)}")
    return workdir / "store", trial


def plain_state(trial: dict[str, Any], step: int) -> dict[str, Any]:
    """What a plain base saves as ``step``: the trial's tensors whole, and plain values."""
    return {
        "weights": {
            t["name"]: full_tensor(t["shape"], t["dtype"], t["seed"] + step - 1)
            for t in trial["tensors"]
        },
        "plain": torch.arange(5) + step - 1,
        "meta": {"lr": 0.5 * step, "names": ["a", "b", str(step)], "n": step},
    }


def make_plain_base(seed: int, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """A store of steps 1 and 2 of the trial of ``seed`` saved whole by this process (a
    replicated step, as a DDP job's rank 0 writes it), in safetensors or torch's format."""
    trial = trial_of(seed)
    trial["base"] = "plain"
    trial["format"] = "torch" if seed % 4 == 3 else "safetensors"
    shutil.rmtree(workdir, ignore_errors=True)
    root = workdir / "store"
    with CheckpointManager(root, keep=None, format=trial["format"], distributed=False) as m:
        for step in (1, 2):
            m.save(step, plain_state(trial, step))
    return root, trial


def truth(trial: dict[str, Any], step: int) -> dict[str, Any]:
    """Step ``step``'s values by path (``weights/t0``, ``plain``, ...), as saved.

    Made once for each trial and step (a seed of 32 mutations made the trial's tensors 36
    times: ~1.5-2 s of CPU); the callers only read what it returns.
    """
    return _truth(json.dumps(trial, sort_keys=True), step)


@functools.lru_cache(maxsize=8)
def _truth(trial_json: str, step: int) -> dict[str, Any]:
    trial = json.loads(trial_json)
    if trial.get("base") == "plain":
        return _flat(plain_state(trial, step))
    out: dict[str, Any] = {
        f"weights/{t['name']}": full_tensor(t["shape"], t["dtype"], t["seed"] + step - 1)
        for t in trial["tensors"]
    }
    out["plain"] = torch.arange(5) + step - 1
    return out


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}/"))
        return out
    return {prefix.rstrip("/"): value}


def _same_tensors(got: Any, want: dict[str, Any]) -> str | None:
    """None where ``got`` (a loaded or restored state) holds ``want`` bit for bit; else why."""
    flat = _flat(got)
    if set(flat) != set(want):
        return f"keys {sorted(flat)} != {sorted(want)}"
    for k, w in want.items():
        g = flat[k]
        if not isinstance(w, torch.Tensor):
            if type(g) is not type(w) or g != w:
                return f"{k}: {g!r} != {w!r}"
            continue
        if not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.shape != w.shape:
            return f"{k}: {type(g).__name__} {getattr(g, 'dtype', '')} {getattr(g, 'shape', '')}"
        if not _same(g, w):
            return f"{k}: other bytes"
    return None


# ---- mutations ---------------------------------------------------------------------------


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) of a JSON document, the root included."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, (*path, i))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def mutate(doc: Any, rnd: random.Random, *, finite: bool = False) -> tuple[Any, str]:
    """``doc`` with one value changed (in place where it can be); what was done.

    A number may become ``Infinity`` (JSON's non-finite literals, which ``json.loads``
    accepts), unless ``finite``: where the forged file is canonical JSON (the manifest and
    the rank table, whose CRCs are computed over JSON that has none).
    """
    nodes = list(_nodes(doc))
    path, v = rnd.choice(nodes)
    same_kind = [x for p, x in nodes if type(x) is type(v) and p != path]
    ops: list[tuple[str, Callable[[], Any]]] = []
    if same_kind:  # another value of the document, of the same type: a plausible mix-up
        ops.append(("swap", lambda: json.loads(json.dumps(rnd.choice(same_kind)))))
    if isinstance(v, bool):
        ops += [("not", lambda: not v), ("int", lambda: int(v)), ("str", lambda: str(v))]
    elif isinstance(v, int):
        for name, f in [
            ("0", lambda: 0), ("-1", lambda: -1), ("+1", lambda: v + 1), ("-1d", lambda: v - 1),
            ("x2", lambda: v * 2), ("/2", lambda: v // 2), ("2^31", lambda: 1 << 31),
            ("2^62", lambda: 1 << 62), ("-2^62", lambda: -(1 << 62)), ("str", lambda: str(v)),
            ("float", lambda: v + 0.5), ("null", lambda: None), ("bool", lambda: True),
        ]:  # fmt: skip
            ops.append((name, f))
        if not finite:
            ops.append(("inf", lambda: math.inf))
    elif isinstance(v, float):
        ops += [("0.0", lambda: 0.0), ("-1e308", lambda: -1e308), ("str", lambda: "x")]
        if not finite:
            ops += [("inf", lambda: math.inf), ("-inf", lambda: -math.inf)]
    elif isinstance(v, str):
        for name, f in [
            ("empty", lambda: ""), ("+x", lambda: v + "x"), ("chop", lambda: v[:-1]),
            ("dotdot", lambda: "../" + v), ("abs", lambda: "/" + v), ("long", lambda: "a" * 5000),
            ("int", lambda: 7), ("null", lambda: None), ("upper", v.upper),
        ]:  # fmt: skip
            ops.append((name, f))
    elif isinstance(v, list):
        ops += [("[]", lambda: []), ("nest", lambda: [v]), ("null", lambda: None)]
        if v:
            ops += [
                ("drop", lambda: v[:-1]),
                ("dup", lambda: [*v, v[-1]]),
                ("rev", lambda: v[::-1]),
                ("drop0", lambda: v[1:]),
            ]
    elif isinstance(v, dict):
        ops += [("{}", lambda: {}), ("list", lambda: list(v)), ("null", lambda: None)]
        if v:
            gone = rnd.choice(list(v))
            ops.append((f"del {gone}", lambda: {k: x for k, x in v.items() if k != gone}))
        ops.append(("+key", lambda: {**v, "zz": 1}))
    else:  # None
        ops += [("0", lambda: 0), ("str", lambda: "x"), ("{}", lambda: {})]
    name, f = rnd.choice(ops)
    return _set(doc, path, f()), f"{'/'.join(map(str, path)) or '(root)'}: {name}"


def _forge_manifest(step: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    from tests._helpers import forge_manifest

    mpath = step / "manifest.json"
    mpath.write_bytes(forge_manifest(mpath.read_bytes(), edit))


def mutate_step(step: Path, rnd: random.Random) -> str:
    """Change one value of one JSON file of ``step`` and forge what checks it; what was done."""
    from tests._helpers import edit_entry, write_rank_table

    names = sorted(
        p.name for p in step.iterdir() if p.suffix in (".json", ".jsonl", ".safetensors")
    )
    name = rnd.choice(names)
    path = step / name
    if name.endswith(".safetensors"):  # its JSON header; the tensors' bytes stay
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        new, what = mutate(json.loads(raw[8 : 8 + n]), rnd)
        head = json.dumps(new, separators=(",", ":")).encode()
        data = len(head).to_bytes(8, "little") + head + raw[8 + n :]
        path.write_bytes(data)
        edit_entry(
            step,
            name,
            lambda row: row.update(bytes=len(data), crc32c=format_crc(crc32c_of(data))),
        )
        return f"{name} header {what}"
    if name == "manifest.json":
        said: list[str] = []

        def edit(d: dict[str, Any]) -> None:
            new, what = mutate(d, rnd, finite=True)
            said.append(what)
            if new is not d:  # the root itself was replaced: keep its keys, change one
                d.clear()
                d.update(new if isinstance(new, dict) else {"replaced": new})

        _forge_manifest(step, edit)
        return f"{name} {said[0]}"
    if name == "_ranks.jsonl":
        lines = [json.loads(x) for x in path.read_bytes().splitlines() if x.strip()]
        new, what = mutate(lines, rnd, finite=True)
        write_rank_table(step, new if isinstance(new, list) and new else [new])
        return f"{name} {what}"
    doc = json.loads(path.read_bytes())
    new, what = mutate(doc, rnd)
    data = json.dumps(new, separators=(",", ":")).encode()
    path.write_bytes(data)
    edit_entry(
        step, name, lambda row: row.update(bytes=len(data), crc32c=format_crc(crc32c_of(data)))
    )
    return f"{name} {what}"


# ---- one mutation, checked -----------------------------------------------------------------


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def hang(*_: Any) -> None:
        raise TimeoutError(f"took over {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_mutation(
    base: Path, trial: dict[str, Any], work: Path, rnd: random.Random, *, wide: bool = False
) -> tuple[str, list[str]]:
    """Mutate a copy of ``base``'s step 2 and check what ckptstore makes of it (see the
    module docstring). ``wide``: also restore it on the trial's restore world, a real job
    (:func:`check_wide`). Returns what was mutated and the problems (none: an empty list)."""
    from ckptstore.cli.main import main as cli

    shutil.rmtree(work, ignore_errors=True)
    scratch = work / "store"
    shutil.copytree(base, scratch)
    what = mutate_step(scratch / STEP2, rnd)
    problems: list[str] = []
    rss0 = _peak_rss()

    def run(label: str, fn: Callable[[], Any], allowed: tuple[type[BaseException], ...]) -> Any:
        try:
            with _deadline(SECONDS):
                return fn()
        except allowed as e:
            return e
        except BaseException as e:  # each is a finding
            tb = "".join(traceback.format_exception(e)[-3:])
            problems.append(f"{label}: {type(e).__name__}: {e}\n{tb}")
            return e

    def load() -> Any:
        with CheckpointManager(scratch, keep=None, create=False) as m:
            return m.load(2)

    # state.json is the state's structure: what a forged one says (another key, a value
    # in place of a tensor, two references swapped) is what a load returns, and nothing
    # can tell it from the truth. Every other file's claims are checked against the bytes.
    structure = what.startswith("state.json") or (
        ".safetensors header" in what and not what.startswith("_shards")
    )
    got = run("load(2)", load, (CkptStoreError,))
    if not isinstance(got, BaseException):
        why = _same_tensors(got, truth(trial, 2))
        if why and not structure:
            problems.append(f"load(2) returned other data: {why}")

    def restore() -> tuple[int, Any]:
        into: dict[str, Any] = {
            "weights": {
                t["name"]: torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"]))
                for t in trial["tensors"]
            },
            "plain": None,
        }
        if trial.get("base") == "plain":
            into["meta"] = None
        with CheckpointManager(scratch, keep=None, create=False) as m:
            step = m.restore(into)
        return step, into

    # A forged state.json may also make the newest step not fit the caller's state (a key
    # gone): restore() then refuses it (StateMismatchError), as it refuses a step saved from
    # another structure, instead of falling back past an intact newer step.
    done = run("restore()", restore, (StateMismatchError,) if structure else ())
    if not isinstance(done, BaseException):
        step, into = done
        if step not in (1, 2):
            problems.append(f"restore() returned step {step}")
        else:
            why = _same_tensors(into, truth(trial, step))
            if why and not (structure and step == 2):
                problems.append(f"restore() of step {step}: {why}")

    def verify() -> int:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return cli(["verify", str(scratch), "--all"])

    status = run("verify", verify, ())
    if not isinstance(status, BaseException) and status not in (0, 1):
        problems.append(f"verify exited {status}")

    def inspect() -> int:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return cli(["inspect", str(scratch), "--step", "2"])

    status = run("inspect", inspect, ())
    if not isinstance(status, BaseException) and status not in (0, 1):
        problems.append(f"inspect exited {status}")
    if wide:
        problems += check_wide(trial, work, structure)
    grown = _peak_rss() - rss0
    if grown > RSS_BUDGET:
        problems.append(f"peak RSS grew by {grown >> 20} MiB")
    return what, problems


def check_wide(trial: dict[str, Any], work: Path, structure: bool) -> list[str]:
    """Restore the mutated store (``work/store``) on the trial's restore world, a real job:
    every rank restores the same step, step 2 or step 1, each its part byte for byte; or,
    where ``state.json`` was forged, every rank refuses it alike (``StateMismatchError``).
    A rank that read a bad part of the index falls back with the others, never alone."""
    from tests.multirank.launch import describe, launch

    job = dict(trial, restore_api="ckpt", restore_kw={})
    try:
        res = launch(
            "fuzz_scenarios:fuzz_restore", trial["restore_world"], work, args={"trial": job}
        )
    except AssertionError as e:  # hung past the launcher's deadline
        return [f"restore on {trial['restore_world']} ranks: {e}"]
    if not all(r.ok for r in res):
        if structure and all(r.error_type == "StateMismatchError" for r in res):
            return []
        return [f"restore on {trial['restore_world']} ranks: {describe(res)}"]
    steps = {r.value["step"] for r in res}
    problems = []
    if len(steps) != 1 or not steps <= {1, 2}:
        problems.append(f"restore on {trial['restore_world']} ranks: steps {sorted(steps)}")
    for r in res:
        if (r.value["wrong"] or r.value["plain"] != list(range(5))) and not (
            structure and r.value["step"] == 2
        ):
            problems.append(
                f"restore on {trial['restore_world']} ranks: rank {r.rank} step "
                f"{r.value['step']}: wrong {r.value['wrong']}, plain {r.value['plain']}"
            )
    return problems

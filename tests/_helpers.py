"""Shared helpers of the single-process tests: small states, byte-level comparison, a view
of a store's raw entries (local directory or fsspec memory filesystem) for corrupting it,
and running Python in a subprocess.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptstore.integrity import crc32c_of, format_crc
from ckptstore.sharded.chunks import Chunk, TensorEntry, block_crcs

REPO = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"


#: Files of the store itself, not of a checkpoint: the writer lock and the listing cache.
STORE_FILES = frozenset({".ckptstore.lock", ".ckptstore.index"})


def step_dir(step: int) -> str:
    """The directory name of a committed step (spelled out here, not taken from layout.py,
    so a change of the on-disk naming fails the tests)."""
    return f"step-{step:012d}"


def step_path(root: Path, step: int) -> Path:
    """The directory of a committed step in the local store at ``root``."""
    return root / step_dir(step)


def run_cli(capsys: Any, *argv: object) -> tuple[int, str, str]:
    """Run ``ckptstore`` with ``argv`` (made strings) in this process: exit code, stdout, stderr.

    ``capsys`` is pytest's fixture of the calling test.
    """
    from ckptstore.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_tool(name: str, *argv: object, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``tools/<name>`` with ``argv`` (made strings) in a fresh interpreter; its result.

    Fails the test, with the tail of both outputs, when it exits non-zero or outlives
    ``timeout`` seconds (less than the test's own timeout: the output is then kept).
    """
    cmd = [sys.executable, str(REPO / "tools" / name), *map(str, argv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def run_tool_forked(name: str, *argv: object, timeout: float) -> subprocess.CompletedProcess[str]:
    """:func:`run_tool`, the tool forked from the test fork server
    (``tests/multirank/launch.py``), which imported torch, torch.distributed and ckptstore
    once (a fresh interpreter's 4-6 s of CPU before a tool's own work), and runs it as
    ``__main__`` in its own process: its stdout and stderr together are the result's
    ``stdout``. A fresh interpreter where there is no fork server (``CKPTSTORE_TEST_FORK=0``,
    or the environment changed since it started)."""
    import tempfile

    from tests.multirank.launch import _Forked, script_server

    server = script_server()
    if server is None:
        return run_tool(name, *argv, timeout=timeout)
    cmd = [str(a) for a in argv]
    env = dict(os.environ)  # what run_tool's interpreter has
    with tempfile.TemporaryDirectory(prefix="ckptstore-tool-") as tmp:
        log = Path(tmp) / "out.log"
        pid = server.spawn_script(REPO / "tools" / name, env, log, Path.cwd(), args=cmd)
        if pid is None:
            return run_tool(name, *argv, timeout=timeout)
        proc = _Forked(server, pid)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            msg = f"{name} ran past {timeout}s:\n{log.read_text()[-5000:]}"
            raise AssertionError(msg) from None
        out = log.read_text()
    assert code == 0, out[-5000:]
    return subprocess.CompletedProcess([name, *cmd], code, out, "")


def fork_tool_servers(monkeypatch: Any) -> None:
    """The fork servers a tool run in this test starts (``tools/linechild.py``: the rank
    server, the crash campaigns' servers), forked from the test fork server instead of
    fresh interpreters (``launch.spawn_piped``): each imported torch and ckptstore, 4-6 s
    of CPU. Call it before the test changes the environment (it starts the test fork
    server where there is none yet); undone after the test."""
    import importlib

    from tests.multirank.launch import piped_spawner

    spawner = piped_spawner()
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    monkeypatch.setattr(importlib.import_module("linechild"), "SPAWN", spawner)


def _touch(path: str) -> None:
    Path(path).write_text("code ran")


class RunsCode:
    """Unpickling this creates a file: the proof that a pickle was (or was not) executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_touch, (self.path,))


class TinyNet(nn.Module):
    """Two linear layers, a buffer and dropout: parameters, buffers and RNG use."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, width)
        self.fc2 = nn.Linear(width, 3)
        self.drop = nn.Dropout(0.25)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, n: int = 1) -> None:
    for _ in range(n):
        opt.zero_grad()
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        opt.step()


def make_state(seed: int = 0, width: int = 8) -> dict[str, Any]:
    """A training state with a module, an optimizer that has state, a scheduler and data."""
    torch.manual_seed(seed)
    model = TinyNet(width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train_step(model, opt, 2)
    sched.step()
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "step": seed,
        "extra": {"lr": 0.5, "tags": ("a", 1, -0.0), 3: [None, True, b"\x00\xff"]},
    }


def fresh_like(state: Mapping[str, Any], seed: int = 123) -> dict[str, Any]:
    """Objects of the same shape as ``state`` but different values (a restarted process)."""
    new = make_state(seed, width=state["model"].fc1.out_features)
    new["step"] = -1
    new["extra"] = None
    return new


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Exact equality of nested data: types, dtypes, shapes and the bytes of tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert torch.equal(bits(a), bits(b)), f"{path}: tensor bytes differ"
        return
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if type(a).__module__ == "numpy":
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: array bytes differ"
    elif isinstance(a, Mapping):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        same = a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))
        assert same, f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def module_bytes(m: nn.Module) -> dict[str, torch.Tensor]:
    """A detached clone of a module's state dict (to compare after a failed load)."""
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def flip_byte(data: bytes, offset: int) -> bytes:
    b = bytearray(data)
    b[offset] ^= 0xFF
    return bytes(b)


def forge_manifest(data: bytes, edit: Any) -> bytes:
    """Apply ``edit(doc)`` to a manifest's JSON and recompute its self-checksum, as an
    attacker (or a newer writer) would."""
    doc = json.loads(data)
    doc.pop("checksum")
    edit(doc)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    doc["checksum"] = format_crc(crc32c_of(canonical.encode()))
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def edit_entry(step_path: Path, name: str, edit: Any) -> None:
    """Apply ``edit(row)`` to the file-table row of ``name`` wherever it is listed (the
    manifest, or in format 4 its rank's line of ``_ranks.jsonl``) and re-sign what holds it,
    as an attacker would."""
    mpath = step_path / MANIFEST
    doc = json.loads(mpath.read_bytes())
    if name in doc["files"] or "rank_table" not in doc:
        mpath.write_bytes(forge_manifest(mpath.read_bytes(), lambda d: edit(d["files"][name])))
        return
    lines = [json.loads(raw) for raw in (step_path / "_ranks.jsonl").read_bytes().splitlines()]
    for line in lines:
        if name in line["files"]:
            edit(line["files"][name])
    write_rank_table(step_path, lines)


def two_dtensor_steps(
    mesh: object, root: Path, seed: int, shape: tuple[int, int] = (64, 300)
) -> tuple[dict[int, torch.Tensor], Callable[[int], dict[str, Any]]]:
    """Steps 1 and 2 of ``model/w``, a one-rank ``Shard(0)`` DTensor of ``shape``, saved in
    ``root``: their values, and the state of a step (step 0: zeros, a target to restore
    into), ``{"model": {"w": w}, "step": step}``."""
    from torch.distributed.tensor import DTensor, Shard

    from ckptstore import CheckpointManager

    gen = torch.Generator().manual_seed(seed)
    values = {s: torch.randn(*shape, generator=gen) for s in (1, 2)}

    def state(step: int) -> dict[str, Any]:
        local = values[step].clone() if step else torch.zeros(*shape)
        w = DTensor.from_local(local, mesh, [Shard(0)])  # type: ignore[arg-type]
        return {"model": {"w": w}, "step": step}

    with CheckpointManager(root) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    return values, state


def write_rank_table(step_path: Path, lines: list[Any]) -> None:
    """Write ``_ranks.jsonl`` of a committed step from ``lines``, each line that is a dict
    with a ``crc32c`` re-signed over its other fields where they still serialize, and forge
    the manifest's entry and ``rank_table`` width to match, as an attacker would."""
    out = []
    for line in lines:
        if isinstance(line, dict) and "crc32c" in line:
            body = {k: x for k, x in line.items() if k != "crc32c"}
            try:
                canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                line = dict(body, crc32c=format_crc(crc32c_of(canon)))
            except (TypeError, ValueError):
                pass
        out.append(json.dumps(line, sort_keys=True, separators=(",", ":")).encode())
    width = max(len(x) for x in out) + 1
    data = b"".join(x.ljust(width - 1) + b"\n" for x in out)
    (step_path / "_ranks.jsonl").write_bytes(data)

    def fix(d: dict[str, Any]) -> None:
        d["files"]["_ranks.jsonl"].update(bytes=len(data), crc32c=format_crc(crc32c_of(data)))
        if isinstance(d.get("rank_table"), dict):
            d["rank_table"]["width"] = width

    mpath = step_path / MANIFEST
    mpath.write_bytes(forge_manifest(mpath.read_bytes(), fix))


def replace_payload(step_path: Path, name: str, data: bytes) -> None:
    """Replace a file of a committed step and forge its manifest entry (size, CRC32C) to
    match, as a buggy tool or an attacker would: only the content itself can tell."""
    (step_path / name).write_bytes(data)
    edit_entry(
        step_path,
        name,
        lambda row: row.update(bytes=len(data), crc32c=format_crc(crc32c_of(data))),
    )


@functools.cache
def zeros_frame(n: int = 1 << 30) -> bytes:
    """A standard zstd frame of ``n`` zero bytes from the real compressor: 1 GiB in ~32 KB."""
    import io

    import zstandard

    buf = io.BytesIO()
    with zstandard.ZstdCompressor(level=1, write_checksum=True).stream_writer(
        buf, closefd=False
    ) as w:
        block = bytes(64 << 20)
        for _ in range(n // len(block)):
            w.write(block)
        w.write(bytes(n % len(block)))
    return buf.getvalue()


def plant_zstd_bomb(root: Path, step: int, name: str) -> None:
    """Make the compressed payload ``name`` of ``step`` a decompression bomb: its own good
    content, then 1 GiB of zeros in a second frame; manifest entry and CRC forged to match."""
    import zstandard

    path = root / step_dir(step) / name
    good = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
    bomb = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(good)
    replace_payload(root / step_dir(step), name, bomb + zeros_frame())


def deflated(pt: bytes) -> bytes:
    """A ``torch.save`` zip with every member deflated (torch.save stores them all)."""
    import io
    import zipfile

    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(pt)) as src,
        zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as dst,
    ):
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


class StoreView:
    """Raw access to the entries of a store, below ckptstore (to inspect and corrupt it).

    Paths are relative to the store's root and ``/``-separated.
    """

    def __init__(self, kind: str, url: str, fs: Any = None, base: str = "") -> None:
        self.kind = kind
        self.url = url
        self.fs = fs
        self.base = base

    @property
    def local(self) -> bool:
        return self.fs is None

    def _p(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def names(self, rel: str = "") -> list[str]:
        """Names directly under ``rel`` (empty if it does not exist)."""
        p = self._p(rel)
        if self.local:
            return sorted(os.listdir(p)) if os.path.isdir(p) else []
        if not self.fs.exists(p):
            return []
        return sorted(os.path.basename(x.rstrip("/")) for x in self.fs.ls(p, detail=False))

    def exists(self, rel: str) -> bool:
        p = self._p(rel)
        return os.path.lexists(p) if self.local else bool(self.fs.exists(p))

    def read(self, rel: str) -> bytes:
        p = self._p(rel)
        if self.local:
            return Path(p).read_bytes()
        return bytes(self.fs.cat_file(p))

    def write(self, rel: str, data: bytes) -> None:
        p = self._p(rel)
        if self.local:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            Path(p).write_bytes(data)
        else:
            self.fs.pipe_file(p, data)

    def remove(self, rel: str) -> None:
        p = self._p(rel)
        if self.local:
            os.unlink(p)
        else:
            self.fs.rm_file(p)

    def files(self) -> dict[str, bytes]:
        """Every file under the root (except STORE_FILES), by relative path, with its bytes."""
        out: dict[str, bytes] = {}
        if self.local:
            for dirpath, _, names in os.walk(self.base):
                for n in names:
                    full = os.path.join(dirpath, n)
                    rel = os.path.relpath(full, self.base).replace(os.sep, "/")
                    if rel not in STORE_FILES:
                        out[rel] = Path(full).read_bytes()
        else:
            for p in self.fs.find(self.base):
                rel = p[len(self.base) :].lstrip("/")
                out[rel] = bytes(self.fs.cat_file(p))
        return out

    def payloads(self, step: int) -> list[str]:
        """The tensor payload files of a committed step, per its manifest."""
        doc = json.loads(self.read(f"{step_dir(step)}/{MANIFEST}"))
        return sorted(n for n, e in doc["files"].items() if e["codec"] != "json")

    def corrupt(self, step: int, name: str, offset: int = -1) -> None:
        """Flip one byte of a file in the tensor data (default: the last byte)."""
        rel = f"{step_dir(step)}/{name}"
        data = self.read(rel)
        self.write(rel, flip_byte(data, offset % len(data)))


def local_view(root: Path, kind: str = "local") -> StoreView:
    url = str(root) if kind == "local" else f"file://{root}"
    return StoreView(kind, url, None, str(root))


def memory_view() -> StoreView:
    import fsspec

    fs = fsspec.filesystem("memory")
    name = f"ckptstore-test-{uuid.uuid4().hex}"
    return StoreView("memory", f"memory://{name}", fs, f"/{name}")


def drop_memory(view: StoreView) -> None:
    from ckptstore.storage import wait_for_deletions

    wait_for_deletions()
    if view.fs is not None and view.fs.exists(view.base):
        view.fs.rm(view.base, recursive=True)


def iter_views(tmp_path: Path) -> Iterator[StoreView]:
    yield local_view(tmp_path / "local-store")
    yield local_view(tmp_path / "file-store", "file")
    yield memory_view()


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with the repository importable."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def popen_python(code: str, *args: str, stdin: bool = False) -> Any:
    """``python -c CODE ARGS...`` with the repository importable (:func:`subprocess_env`),
    its stdout (stderr merged) a text pipe, and its stdin one where ``stdin``: the
    :class:`subprocess.Popen` of a test's second process.

    Forked from the test fork server (``tests/multirank/launch.py``, ``spawn_piped``),
    which imported torch and ckptstore once, where this process runs one already: a fresh
    interpreter spent 3.5 s of CPU on those before the code ran (starting the server, 7 s,
    would cost more, and delay the child on a busy host). Still a process of its own, whose
    exit code is its own; for code whose subject is the interpreter itself (its exit, its
    imports, its memory) start a fresh one instead.
    """
    from tests.multirank.launch import spawn_piped

    cmd = [sys.executable, "-c", code, *args]
    proc = spawn_piped(cmd, subprocess_env(), True)
    if proc is None:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=subprocess_env(),
        )
    return proc


class LineReader:
    """Lines of a child process's stdout, read by a thread, waited for with a timeout."""

    def __init__(self, stream: Any) -> None:
        import queue
        import threading

        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._t = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._t.start()

    def _run(self, stream: Any) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def next(self, timeout: float = 30) -> str | None:
        """The next line; ``None`` at end of stream. Raises ``TimeoutError``."""
        import queue

        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output from the child in {timeout}s") from None
        if line is not None:
            self.lines.append(line)
        return line

    def until(self, prefix: str, timeout: float = 30) -> str:
        """Skip lines until one starts with ``prefix``; return it."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            line = self.next(max(0.01, deadline - time.monotonic()))
            if line is None:
                raise EOFError(f"child ended before {prefix!r}; it said: {self.lines[-20:]}")
            if line.startswith(prefix):
                return line


def visible_problems(mgr: Any, must: set[int], may: set[int]) -> tuple[list[int], list[str]]:
    """The steps ``mgr`` shows, and a line per violation: every step in ``must`` is visible,
    nothing outside ``must | may`` is, and every visible step verifies deeply."""
    problems: list[str] = []
    steps: list[int] = mgr.steps()
    if must - set(steps):
        problems.append(f"committed step(s) {sorted(must - set(steps))} lost; have {steps}")
    if set(steps) - must - may:
        problems.append(f"step(s) {sorted(set(steps) - must - may)} visible; have {steps}")
    for s in steps:
        report = mgr.verify(s, deep=True)
        if not report.ok:
            problems.append(f"visible step {s} does not verify: {report.problems}")
    return steps, problems


def store_problems(
    url: str,
    fmt: str,
    must: set[int],
    may: set[int],
    *,
    state_of: Callable[[int], Mapping[str, Any]],
    names: Callable[[], list[str]],
) -> list[str]:
    """The invariants every faulted or cut-off run must leave; one line per violation.

    Every step in ``must`` is visible, nothing outside ``must | may`` is; every visible
    step verifies deeply; the newest loads its own model (``state_of(step)["model"]``);
    ``gc`` leaves no tmp or trash entry (``names()`` lists the root); a new manager saves
    the next step and loads it back.
    """
    from ckptstore import CheckpointManager, CkptStoreError
    from ckptstore.storage import wait_for_deletions

    def model_of(step: int) -> dict[str, torch.Tensor]:
        return dict(state_of(step)["model"].state_dict())

    wait_for_deletions()
    with CheckpointManager(url, format=fmt) as mgr:
        steps, problems = visible_problems(mgr, must, may)
        if steps:
            try:
                assert_same(dict(mgr.load(steps[-1])["model"]), model_of(steps[-1]))
            except (AssertionError, CkptStoreError) as e:
                problems.append(f"newest step {steps[-1]} does not load its own data: {e}")
        mgr.gc()
        left = [n for n in names() if n.startswith((".tmp-", ".trash-"))]
        left += mgr.storage.list_garbage()
        if left:
            problems.append(f"gc left {sorted(set(left))}")
        nxt = max([*steps, *must, *may, 0]) + 1
        try:
            mgr.save(nxt, state_of(nxt))
            assert_same(dict(mgr.load(nxt)["model"]), model_of(nxt))
        except (AssertionError, CkptStoreError) as e:
            problems.append(f"a new manager could not save step {nxt}: {e}")
    return problems


def make_mixed_store(workdir: Path) -> tuple[Path, dict[str, Any]]:
    """A store of one training state in every layout, made by real ranks (gloo on CPU).

    Step 3: DTensor (FSDP2 model and optimizer, a 10 MiB sharded table) saved by 2 ranks;
    step 4: the same DTensor state saved by 1 rank; step 5: the same values replicated
    (plain model, numbered optimizer state) by 2 ranks; step 6: per-rank ``sharded=True``
    state of 2 ranks. Returns the store and the digests of the full tensors.
    """
    from tests.multirank.launch import describe, launch

    args = {"dtensor_step": 3, "replicated_step": 5, "per_rank_step": 6}
    two = launch("export_scenarios:mixed_save", 2, workdir, timeout=240, args=args)
    assert all(r.ok for r in two), describe(two)
    one = launch("export_scenarios:mixed_save", 1, workdir, timeout=240, args={"dtensor_step": 4})
    assert all(r.ok for r in one), describe(one)
    return workdir / "store", two[0].value["digests"]


def index_chunks(step: Path, name: str) -> list[dict[str, Any]]:
    """The chunk rows of tensor ``name`` in a DTensor step's index, in offsets order.

    Format 2 lists them in ``dtensors.json``; the split index (format 3) in the part of the
    rank that wrote each (``_index.rankNNNNN.json``).
    """
    row = json.loads((step / "dtensors.json").read_text())["tensors"][name]
    if "chunks" in row:
        return row["chunks"]  # type: ignore[no-any-return]
    rows: list[dict[str, Any]] = []
    for part in sorted(step.glob("_index.rank*.json")):
        rows += json.loads(part.read_text())["chunks"].get(name, [])
    return sorted(rows, key=lambda c: c["offsets"])


def run_rank0_job(
    argv: list[str],
    log: Path,
    timeout: float,
    what: str,
    env: dict[str, str] | None = None,
) -> None:
    """Run ``python ARGV`` (rank 0 of a job: Lightning starts the other ranks itself) in its
    own session, logging to ``log``; the whole group is killed on timeout, and the test
    fails with the log's tail unless it exits 0.

    ``env``: the child's whole environment; by default this one with the repository on
    ``PYTHONPATH`` and none of torchrun's variables, as a Lightning job wants it.
    """
    import os
    import signal

    import pytest

    if env is None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{what} hung for {timeout}s:\n{log.read_text()[-4000:]}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, f"{what} exited {rc}:\n{log.read_text()[-6000:]}"


class TokenData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Eight random sequences of 16 tokens (a Trainer's dataset): four steps per epoch at
    batch size 2."""

    def __init__(self) -> None:
        self.x = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class HashCounter:
    """Stands in for ``ckptstore.integrity._crc32c``: counts the bytes every CRC32C pass reads.

    Every checksum of ckptstore goes through that module attribute; install it with
    ``monkeypatch.setattr(integrity, "_crc32c", HashCounter())``.
    """

    def __init__(self) -> None:
        self.hashed = 0

    def crc32c(self, data: Any, crc: int = 0) -> int:
        """The real CRC32C, counted."""
        import crc32c as real

        self.hashed += memoryview(data).nbytes
        return int(real.crc32c(data, crc))


def row_chunks(
    t: torch.Tensor, parts: int, block: int, at: int = 0
) -> tuple[bytearray, TensorEntry]:
    """``t`` (float32) saved as ``parts`` row chunks, one after another from offset ``at``
    of a file ``"f"``: their bytes, and the index entry, with block CRCs of ``block``."""
    raw = bytearray()
    chunks = []
    rows = t.shape[0] // parts
    for i in range(parts):
        part = t[i * rows : (i + 1) * rows].contiguous()
        data = bytearray(part.reshape(-1).view(torch.uint8).numpy())
        crcs = tuple(block_crcs(data, block))
        chunks.append(Chunk((i * rows, 0), tuple(part.shape), "f", at + len(raw), len(data), crcs))
        raw += data
    shape = tuple(t.shape)
    return raw, TensorEntry("float32", shape, tuple(chunks), (parts,), ("dp",), ("S(0)",))


def thp_at_first_touch() -> bool:
    """Whether a ``MADV_HUGEPAGE`` region gets huge pages at its first touch here (the
    kernel compacts memory for it then, where free 2 MiB blocks are short)."""
    try:
        base = Path("/sys/kernel/mm/transparent_hugepage")
        mode, defrag = (base / "enabled").read_text(), (base / "defrag").read_text()
    except OSError:
        return False
    on = "[always]" in mode or "[madvise]" in mode
    return on and any(f"[{d}]" in defrag for d in ("always", "madvise", "defer+madvise"))


def benchkit(name: str) -> Any:
    """tools/benchkit/<name>.py (the bench behind tools/bench.py, not part of the package)."""
    import importlib

    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module(f"benchkit.{name}")
    finally:
        sys.path.remove(str(REPO / "tools"))


def huge_share(buf: Any) -> float:
    """The share of the mapping ``buf`` (an ``mmap``) on huge pages: its ``AnonHugePages``
    in ``/proc/self/smaps`` over its length; 0.0 where unknown (the bench's own reading,
    ``benchkit.disk.huge_share``)."""
    return float(benchkit("disk").huge_share(buf))


def run_forked(body: Callable[[], object], timeout: float, hung: str) -> int:
    """Run ``body`` in a forked child; its exit code (0, or 1 if it raised).

    A child still running after ``timeout`` seconds is killed and the test fails with
    ``hung``.
    """
    import signal
    import time

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(hung)


def run_job_ranks(
    argv: list[str],
    ranks: int,
    log: Path,
    timeout: float,
    what: str,
    *,
    preload: tuple[str, ...] = ("lightning.pytorch",),
) -> None:
    """Run every rank of a job of ``ranks`` processes of ``python ARGV`` as torchrun starts
    them (``tests.multirank.launch.run_script``): Lightning sees a job launched from outside
    and starts no process of its own.

    Each rank is forked from the test fork server with ``preload`` imported there once: a
    fresh interpreter spends 6-9 s of CPU importing Lightning, and a test's job of 4 ranks
    that many times. Rank 0 logs to ``log``, rank r to ``LOG.rank<r>.log``; the test fails
    with the logs' tails unless every rank exits 0 within ``timeout``.
    """
    import pytest

    from tests.multirank.launch import run_script

    base = subprocess_env()
    base["OMP_NUM_THREADS"] = "1"
    logs = [log if r == 0 else log.with_name(f"{log.stem}.rank{r}.log") for r in range(ranks)]
    script, args = Path(argv[0]), [str(a) for a in argv[1:]]
    hung, codes = run_script(
        script, args, ranks, env=base, logs=logs, cwd=Path.cwd(), timeout=timeout, preload=preload
    )
    tails = "".join(f"--- {g.name}\n{g.read_text()[-4000:]}" for g in logs)
    if hung:
        pytest.fail(f"{what} hung for {timeout}s:\n{tails}")
    failed = [(r, code) for r, code in enumerate(codes) if code != 0]
    assert not failed, f"{what}: rank(s) exited {failed}:\n{tails}"

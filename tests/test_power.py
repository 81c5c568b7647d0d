"""Power loss at every point of a save, a prune and a gc: the last committed checkpoint stays.

tests/power.py traces the local backend's system calls and keeps the durable view of the
store after each one: file bytes count once the file is fsynced, directory entries (creates,
renames, unlinks) once their directory is fsynced, and a cut drops everything else. For each
call of the operation, the disk the machine would come back to is written out and opened as
a store, and must hold:

- every checkpoint committed before the operation, except those the retention policy was
  deleting (which may be there or not); the one being saved once ``Storage.commit``
  returned;
- nothing else that looks committed; every visible checkpoint verifies deeply, the newest
  loads with exactly its own data;
- after ``gc`` no garbage; a new manager saves the next step.

The last tests remove one fsync of the protocol at a time (in the model: the real call still
runs) and show that the same checks then fail: each fsync is needed. That covers the commit
(payloads, state.json, manifest, tmp directory, root), the background deleter's root fsync,
the step directory's fsync after a pin or an unpin, and the parents of a new store's root.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import make_state, store_problems
from power import VIEWS, PowerModel, Snapshot, materialize

from ckptstore import CheckpointManager
from ckptstore.storage import wait_for_deletions
from ckptstore.storage.base import Storage

pytestmark = pytest.mark.timeout(120)


@functools.cache
def state(step: int) -> dict[str, Any]:
    return make_state(step)


@pytest.fixture
def base(tmp_path: Path) -> Iterator[Path]:
    """A scratch directory on tmpfs where there is one (every check fsyncs)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="ckptstore-power-", dir=shm))
        yield d
        wait_for_deletions()
        shutil.rmtree(d, ignore_errors=True)
    else:  # pragma: no cover
        yield tmp_path


def make_store(root: Path, steps: list[int], fmt: str) -> None:
    with CheckpointManager(root, format=fmt) as mgr:
        for s in steps:
            mgr.save(s, state(s))
    wait_for_deletions()


@contextlib.contextmanager
def recording(model: PowerModel) -> Iterator[PowerModel]:
    """Trace the store and mark when each commit returns."""
    real = Storage.commit

    def commit(self: Storage, pending: Any, manifest: Any) -> None:
        real(self, pending, manifest)
        model.mark(f"commit {pending.step}")

    Storage.commit = commit  # type: ignore[method-assign]
    try:
        with model.installed():
            yield model
            wait_for_deletions()
    finally:
        Storage.commit = real  # type: ignore[method-assign]


def check_disk(root: Path, fmt: str, must: set[int], may: set[int]) -> list[str]:
    return store_problems(str(root), fmt, must, may, state_of=state, names=lambda: os.listdir(root))


def check_every_cut(
    model: PowerModel,
    base: Path,
    fmt: str,
    *,
    before: set[int],
    doomed: set[int],
    new: int | None = None,
    views: tuple[str, ...] = VIEWS,
) -> tuple[int, int, list[str]]:
    """Check the disk after every traced call: (cut points, distinct disks, violations)."""
    commit_at = next((i for i, m in model.markers if m == f"commit {new}"), None)
    seen: set[Any] = set()
    violations: list[str] = []
    # Whole or invisible: the step being saved may show up as soon as it is renamed into
    # place, and must once its commit returned.
    may = doomed | ({new} if new is not None else set())
    for i, (label, snaps) in enumerate(model.snapshots):
        committed = commit_at is not None and i >= commit_at
        must = (before - doomed) | ({new} if committed and new is not None else set())
        for view in views:
            snap = snaps[view]
            key = (frozenset(snap.items()), committed)
            if key in seen:
                continue
            seen.add(key)
            d = base / f"cut-{uuid.uuid4().hex[:8]}"
            materialize(snap, str(d))
            try:
                problems = check_disk(d, fmt, must, may)
            finally:
                wait_for_deletions()
                shutil.rmtree(d, ignore_errors=True)
            violations += [f"power cut ({view}) after #{i} {label}: {p}" for p in problems]
    return len(model.snapshots), len(seen), violations


def _save(root: Path, fmt: str, async_save: bool, keep: int | None) -> Callable[[], None]:
    mgr = CheckpointManager(root, keep=keep, format=fmt, async_save=async_save)

    def run() -> None:
        mgr.save(3, state(3))
        mgr.close()

    return run


SAVES = [
    (fmt, a, keep) for fmt in ("safetensors", "torch") for a in (False, True) for keep in (None, 2)
]


@pytest.mark.parametrize(
    ("fmt", "async_save", "keep"),
    SAVES,
    ids=[f"{f}-{'async' if a else 'sync'}-keep{k}" for f, a, k in SAVES],
)
def test_power_cut_during_save(base: Path, fmt: str, async_save: bool, keep: int | None) -> None:
    root = base / "store"
    make_store(root, [1, 2], fmt)
    model = PowerModel(str(root))
    with recording(model):
        _save(root, fmt, async_save, keep)()
    assert any(m == "commit 3" for _, m in model.markers)
    doomed = {1} if keep == 2 else set()
    cuts, disks, violations = check_every_cut(model, base, fmt, before={1, 2}, doomed=doomed, new=3)
    assert cuts >= 15, [label for label, _ in model.snapshots]  # every write, fsync, rename
    assert disks >= 6  # strict: before, committed (, retention); metadata: each fsync
    assert not violations, "\n".join(violations)
    # The last disk is the whole story: step 3 committed, and retention's rename durable.
    last = model.snapshots[-1][1]["strict"]
    assert "step-000000000003/manifest.json" in last
    assert ("step-000000000001/manifest.json" in last) == (keep is None)


def test_power_cut_during_prune(base: Path) -> None:
    root = base / "store"
    make_store(root, [1, 2, 3, 4], "safetensors")
    model = PowerModel(str(root))
    with recording(model), CheckpointManager(root, keep=2) as mgr:
        assert mgr.prune() == [1, 2]
    cuts, disks, violations = check_every_cut(
        model, base, "safetensors", before={1, 2, 3, 4}, doomed={1, 2}
    )
    assert cuts >= 6
    assert disks >= 3  # before, after the first and after the second delete
    assert not violations, "\n".join(violations)


def test_power_cut_during_gc(base: Path) -> None:
    root = base / "store"
    make_store(root, [1, 2], "safetensors")
    for name in (".tmp-step-000000000003-" + "a" * 32, ".trash-step-000000000000-" + "b" * 32):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(b"x" * 100)
    (root / "step-000000000005").mkdir()  # manifest-less: garbage
    model = PowerModel(str(root))
    with recording(model), CheckpointManager(root) as mgr:
        assert len(mgr.gc()) == 3
    _, _, violations = check_every_cut(model, base, "safetensors", before={1, 2}, doomed=set())
    assert not violations, "\n".join(violations)


# ---- each fsync is needed -------------------------------------------------------------------


def _is_tmp_dir(rel: str, is_dir: bool) -> bool:
    return is_dir and rel.startswith(".tmp-")


def _is_root(rel: str, is_dir: bool) -> bool:
    return is_dir and rel == ""


def _is_payload(rel: str, is_dir: bool) -> bool:
    return not is_dir and rel.endswith(".safetensors")


def _is_manifest(rel: str, is_dir: bool) -> bool:
    return not is_dir and rel.endswith("manifest.json")


def _is_state(rel: str, is_dir: bool) -> bool:
    return not is_dir and rel.endswith("/state.json")


@pytest.mark.parametrize(
    ("skip", "symptom"),
    [
        (_is_tmp_dir, "committed step(s) [3] lost"),
        (_is_root, "committed step(s) [3] lost"),
        (_is_payload, "does not verify"),
        (_is_manifest, "manifest.json: not valid JSON"),
        (_is_state, "state.json: 0 bytes, manifest says"),
    ],
    ids=["tmp-dir", "root", "payload", "manifest", "state"],
)
def test_each_fsync_is_needed(base: Path, skip: Callable[[str, bool], bool], symptom: str) -> None:
    root = base / "store"
    make_store(root, [1, 2], "safetensors")
    model = PowerModel(str(root), skip_fsync=skip)
    with recording(model):
        _save(root, "safetensors", False, None)()
    _, _, violations = check_every_cut(
        model, base, "safetensors", before={1, 2}, doomed=set(), new=3
    )
    assert any(symptom in v for v in violations), violations


def _is_deleter_root(rel: str, is_dir: bool) -> bool:
    # The background deleter's fsync of the root, which makes the rename to .trash- durable
    # before any file of the checkpoint is unlinked (the commit's own root fsync stays).
    return is_dir and rel == "" and threading.current_thread().name == "ckptstore-deleter"


def test_the_deleters_root_fsync_is_needed(base: Path) -> None:
    root = base / "store"
    make_store(root, [1, 2, 3, 4], "safetensors")
    model = PowerModel(str(root), skip_fsync=_is_deleter_root)
    with recording(model), CheckpointManager(root, keep=2) as mgr:
        assert mgr.prune() == [1, 2]
    _, _, violations = check_every_cut(
        model, base, "safetensors", before={1, 2, 3, 4}, doomed={1, 2}
    )
    # The rename away was lost, the unlinks inside were not: a half-removed checkpoint.
    assert any("(root-stale)" in v and "does not verify" in v for v in violations), violations


@pytest.mark.parametrize("skip", [None, "pin", "unpin"], ids=["all-fsyncs", "pin", "unpin"])
def test_pin_and_unpin_survive_a_power_cut(base: Path, skip: str | None) -> None:
    # The marker counts by its presence: its directory's fsync is what makes a pin (and an
    # unpin) durable. The file's own bytes are never fsynced: nothing reads them.
    root = base / "store"
    make_store(root, [1, 2], "safetensors")
    doing: list[str] = []

    def skip_fsync(rel: str, is_dir: bool) -> bool:  # the step directory's, in one call
        return is_dir and rel.startswith("step-") and doing[-1:] == [skip]

    model = PowerModel(str(root), skip_fsync=skip_fsync)
    with model.installed(), CheckpointManager(root) as mgr:
        doing.append("pin")
        mgr.pin(1)
        model.mark("pinned")
        doing.append("unpin")
        mgr.unpin(1)
        model.mark("unpinned")
    at = {label: i for i, label in model.markers}
    problems = []
    for label, what, pinned in (("pinned", "pin", True), ("unpinned", "unpin", False)):
        for view in VIEWS:
            d = base / f"cut-{label}-{view}"
            materialize(model.snapshots[at[label]][1][view], str(d))
            with CheckpointManager(d, keep=1) as mgr:
                if mgr.storage.is_pinned(1) != pinned:
                    problems.append(f"power cut ({view}) after {label}: the {what} is lost")
                # What the pin is for: retention keeps the step, or deletes it once unpinned.
                deleted = mgr.prune()
                if deleted != ([] if pinned else [1]):
                    problems.append(f"power cut ({view}) after {label}: prune deleted {deleted}")
            wait_for_deletions()
    if skip is None:
        assert not problems, problems
    else:
        assert f"power cut (strict) after {skip}ned: the {skip} is lost" in problems, problems


@pytest.mark.parametrize("skip", [None, "", "a", "a/b"], ids=["all-fsyncs", "top", "a", "a-b"])
def test_a_new_store_root_survives_a_power_cut(base: Path, skip: str | None) -> None:
    # makedirs creates the root and its missing parents: each new directory's entry is
    # durable only once its parent is fsynced.
    top = base / "top"
    top.mkdir()
    root = top / "a" / "b" / "store"
    skip_fsync = None if skip is None else (lambda rel, is_dir: is_dir and rel == skip)
    model = PowerModel(str(top), skip_fsync=skip_fsync)
    with recording(model), CheckpointManager(root) as mgr:
        mgr.save(1, state(1))
    commit_at = next(i for i, m in model.markers if m == "commit 1")
    manifest = "a/b/store/step-000000000001/manifest.json"
    after = model.snapshots[commit_at:]
    lost = [label for label, snaps in after if manifest not in snaps["strict"]]
    d = base / "cut"
    materialize(model.snapshots[-1][1]["strict"], str(d))
    with CheckpointManager(d / "a" / "b" / "store") as mgr:
        steps = mgr.steps()
    if skip is None:
        assert not lost, lost
        assert steps == [1]
    else:
        assert lost
        assert steps == []


def test_model_drops_what_was_not_fsynced(base: Path) -> None:
    # The model itself: a file written but not fsynced, in a directory not fsynced.
    root = base / "m"
    root.mkdir()
    model = PowerModel(str(root))
    with model.installed():
        from ckptstore.storage import local as local_mod

        fd = local_mod.os.open(str(root / "a"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        local_mod.os.pwrite(fd, b"hello", 0)
        after_write = model.durable_view()
        eager = model.durable_view("metadata")
        local_mod.os.fsync(fd)
        after_file_fsync = model.durable_view()
        local_mod.os.close(fd)
        dfd = local_mod.os.open(str(root), os.O_RDONLY | os.O_DIRECTORY)
        local_mod.os.fsync(dfd)
        local_mod.os.close(dfd)
        after_dir_fsync = model.durable_view()
        local_mod.os.rename(str(root / "a"), str(root / "b"))
        after_rename = model.durable_view()
    assert after_write == {}
    assert eager == {"a": b""}  # the name may survive without the bytes
    assert after_file_fsync == {}  # data durable, but the name is not
    assert after_dir_fsync == {"a": b"hello"}
    assert after_rename == {"a": b"hello"}  # the rename is not durable without a dir fsync
    assert sorted(os.listdir(root)) == ["b"]  # the real calls ran


def test_snapshot_roundtrip(base: Path) -> None:
    snap: Snapshot = {"d": None, "d/f": b"1", "g": b""}
    materialize(snap, str(base / "x"))
    assert (base / "x" / "d" / "f").read_bytes() == b"1"
    assert (base / "x" / "g").read_bytes() == b""

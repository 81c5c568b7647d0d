"""Storage conformance: every backend passes the same suite by adding only a fixture.

The ``store`` fixture yields a :class:`StoreView` of a local path, a ``file://`` URL and a
``memory://`` URL (fsspec's memory filesystem, the stand-in for object stores: no rename,
manifest-last commits). Local-only behaviour (symlinks, the writer lock file, ``.trash-``
renames) is tested at the end of the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from _helpers import (
    MANIFEST,
    STORE_FILES,
    StoreView,
    assert_same,
    drop_memory,
    forge_manifest,
    fresh_like,
    local_view,
    make_state,
    memory_view,
    step_dir,
)

from ckptstore import (
    CheckpointManager,
    CommitError,
    IntegrityError,
    KeepBest,
    KeepEvery,
    KeepLast,
    ManifestError,
    NoCheckpointError,
    StepExistsError,
    StoreLockedError,
)
from ckptstore.integrity import crc32c_of, format_crc
from ckptstore.manifest import MAX_JSON_FILE_BYTES
from ckptstore.storage import LocalStorage, Storage, open_storage, wait_for_deletions
from ckptstore.storage.remote import FsspecStorage

LOCK = ".ckptstore.lock"


@pytest.fixture(params=["local", "file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreView]:
    """A fresh, empty store of each backend; memory stores get a unique path and are wiped."""
    if request.param == "memory":
        view = memory_view()
        yield view
        drop_memory(view)
    else:
        yield local_view(tmp_path / "store", request.param)
        wait_for_deletions()


def root_names(view: StoreView) -> list[str]:
    return [n for n in view.names() if n not in STORE_FILES]


def saved(
    view: StoreView, steps: list[int], *, allow_older: bool = False, **kwargs: Any
) -> dict[int, dict[str, Any]]:
    """Save one state per step (seeded by the step) and close; returns the states."""
    states = {}
    with CheckpointManager(view.url, **kwargs) as mgr:
        for s in steps:
            states[s] = make_state(s)
            metrics = {"val_loss": 1.0 / (s + 1)}
            mgr.save(s, states[s], metrics=metrics, allow_older=allow_older)
    wait_for_deletions()
    return states


def model_sd(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return dict(state["model"].state_dict())


class Crash(BaseException):
    """Stands for the process dying at this point: nothing after it runs, no cleanup."""


# ---- backend selection --------------------------------------------------------------------


def test_backend_chosen_by_url(tmp_path: Path) -> None:
    assert type(open_storage(tmp_path / "a")) is LocalStorage
    assert type(open_storage(f"file://{tmp_path}/b")) is LocalStorage
    assert open_storage(f"file://{tmp_path}/b").root == f"{tmp_path}/b"
    mem = open_storage("memory://ckptstore-test-registry")
    assert type(mem) is FsspecStorage
    assert not mem.atomic_rename
    with pytest.raises(ValueError, match="storage_options"):
        open_storage(tmp_path, {"anon": True})


def test_missing_backend_names_the_package() -> None:
    import importlib.util

    for url, package in [("gs://b/run", "gcsfs"), ("az://c/run", "adlfs"), ("s3://b/run", "s3fs")]:
        if importlib.util.find_spec(package) is None:
            with pytest.raises(ImportError, match=f"pip install {package}"):
                open_storage(url)
            return
    pytest.skip("every optional fsspec backend is installed")  # pragma: no cover


# ---- save / restore / list ----------------------------------------------------------------


def test_roundtrip_restores_exact_bytes(store: StoreView) -> None:
    state = make_state(1)
    with CheckpointManager(store.url) as mgr:
        handle = mgr.save(5, state, metrics={"val_loss": 0.25}, metadata={"run": "a"})
        assert handle.done()
        assert handle.wait().step == 5
        fresh = fresh_like(state)
        assert mgr.restore(fresh) == 5
        assert_same(dict(fresh["model"].state_dict()), model_sd(state))
        assert_same(fresh["optimizer"].state_dict(), state["optimizer"].state_dict())
        assert_same(fresh["scheduler"].state_dict(), state["scheduler"].state_dict())
        assert fresh["step"] == 1
        assert_same(fresh["extra"], state["extra"])
        raw = mgr.load()
        assert_same(dict(raw["model"]), model_sd(state))
        m = mgr.manifest(5)
        assert (m.step, dict(m.metrics), dict(m.metadata)) == (5, {"val_loss": 0.25}, {"run": "a"})
        assert (mgr.steps(), mgr.latest_step()) == ([5], 5)


def test_commit_leaves_exactly_the_step_directory(store: StoreView) -> None:
    with CheckpointManager(store.url) as mgr:
        mgr.save(7, make_state(7))
    assert root_names(store) == [step_dir(7)], "no .tmp-/.trash- or other leftovers"
    doc = json.loads(store.read(f"{step_dir(7)}/{MANIFEST}"))
    files = doc["files"]
    # One payload per top-level key holding tensors (the scheduler and plain data hold none).
    assert set(files) == {"state.json", "model.safetensors", "optimizer.safetensors"}
    assert store.names(step_dir(7)) == sorted([*files, MANIFEST])
    for name, entry in files.items():
        data = store.read(f"{step_dir(7)}/{name}")
        assert entry["bytes"] == len(data)
        assert entry["crc32c"] == format_crc(crc32c_of(data))
    # Payloads are standard safetensors files.
    tensors = safetensors.torch.load(store.read(f"{step_dir(7)}/model.safetensors"))
    assert tensors
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())


def test_steps_are_ordered_by_number(store: StoreView) -> None:
    saved(store, [100, 9, 10], allow_older=True)
    with CheckpointManager(store.url) as mgr:
        assert mgr.steps() == [9, 10, 100]
        assert mgr.latest_step() == 100
        assert mgr.restore(fresh_like(make_state(0))) == 100
    assert root_names(store) == [step_dir(9), step_dir(10), step_dir(100)]


def test_empty_store(store: StoreView) -> None:
    with CheckpointManager(store.url) as mgr:
        assert (mgr.steps(), mgr.latest_step()) == ([], None)
        state = fresh_like(make_state(0))
        assert mgr.resume(state) == 0
        assert state["step"] == -1
        with pytest.raises(NoCheckpointError):
            mgr.restore(state)
        with pytest.raises(NoCheckpointError):
            mgr.load()
        with pytest.raises(NoCheckpointError):
            mgr.verify()
        with pytest.raises(NoCheckpointError, match="no committed checkpoint"):
            mgr.manifest(3)
        assert mgr.prune() == []
        assert mgr.gc() == []


def test_resume_returns_next_step(store: StoreView) -> None:
    states = saved(store, [3, 4])
    with CheckpointManager(store.url) as mgr:
        fresh = fresh_like(states[4])
        assert mgr.resume(fresh) == 5
        assert_same(dict(fresh["model"].state_dict()), model_sd(states[4]))


# ---- the commit protocol --------------------------------------------------------------


def test_manifest_is_written_last(store: StoreView, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, ...]] = []
    with CheckpointManager(store.url) as mgr:
        st = mgr.storage
        real_open, real_put = st._open_write, st._put_small

        def open_write(rel: str) -> Any:
            if events[-1:] != [("write", rel)]:  # the base _put_small opens via _open_write
                events.append(("write", rel))
            return real_open(rel)

        def put_small(rel: str, data: bytes) -> None:
            events.append(("write", rel))
            real_put(rel, data)

        monkeypatch.setattr(st, "_open_write", open_write)
        monkeypatch.setattr(st, "_put_small", put_small)
        if st.atomic_rename:
            real_rename = st._rename

            def rename(src: str, dst: str) -> None:
                events.append(("rename", src, dst))
                real_rename(src, dst)

            monkeypatch.setattr(st, "_rename", rename)
        mgr.save(1, make_state(1))
    writes = [e[1] for e in events if e[0] == "write"]
    pending_dir = writes[0].split("/")[0]
    assert all(w.startswith(pending_dir + "/") for w in writes)
    assert writes[-1] == f"{pending_dir}/{MANIFEST}", "manifest.json must be the last write"
    manifest = json.loads(store.read(f"{step_dir(1)}/{MANIFEST}"))
    assert sorted(w.split("/")[1] for w in writes[:-1]) == sorted(manifest["files"])
    if store.local:
        assert pending_dir.startswith(".tmp-step-000000000001-")
        assert events[-1] == ("rename", pending_dir, step_dir(1)), "rename after the manifest"
    else:
        assert pending_dir == step_dir(1), "object stores write in place, manifest last"


@pytest.mark.parametrize("where", ["manifest", "commit"])
def test_crash_before_commit_is_invisible(
    store: StoreView, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    states = saved(store, [1])
    mgr = CheckpointManager(store.url)
    if where == "manifest":  # the process dies while putting the manifest

        def put_small(rel: str, data: bytes) -> None:
            raise Crash

        monkeypatch.setattr(mgr.storage, "_put_small", put_small)
    else:  # ... or right before the commit starts
        monkeypatch.setattr(Storage, "commit", lambda self, pending, manifest: _raise(Crash()))
    monkeypatch.setattr(Storage, "abort", lambda self, pending: None)  # a crash cleans nothing
    with pytest.raises(Crash):
        mgr.save(2, make_state(2))
    monkeypatch.undo()
    mgr.close()

    garbage = [n for n in root_names(store) if n != step_dir(1)]
    assert len(garbage) == 1
    if store.local:
        assert garbage[0].startswith(".tmp-step-000000000002-")
    else:
        assert garbage[0] == step_dir(2)
    inside = store.names(garbage[0])
    assert MANIFEST not in inside
    assert "model.safetensors" in inside, "payloads are written before the manifest"

    with CheckpointManager(store.url) as mgr2:
        assert mgr2.steps() == [1]
        fresh = fresh_like(states[1])
        assert mgr2.restore(fresh) == 1
        assert_same(dict(fresh["model"].state_dict()), model_sd(states[1]))
        with pytest.raises(NoCheckpointError):
            mgr2.restore(fresh, step=2)
        assert mgr2.verify(1).ok
        assert mgr2.gc() == garbage
        assert root_names(store) == [step_dir(1)]
        mgr2.save(2, make_state(2))
        assert mgr2.steps() == [1, 2]
        assert mgr2.verify(2).ok


def test_save_over_crash_leftovers(store: StoreView, monkeypatch: pytest.MonkeyPatch) -> None:
    saved(store, [1])
    with CheckpointManager(store.url) as mgr:
        monkeypatch.setattr(Storage, "commit", lambda self, pending, manifest: _raise(Crash()))
        monkeypatch.setattr(Storage, "abort", lambda self, pending: None)
        with pytest.raises(Crash):
            mgr.save(2, make_state(2))
    monkeypatch.undo()
    assert len(root_names(store)) == 2, "a leftover of the crashed save"
    with CheckpointManager(store.url) as mgr:  # no explicit gc: saving step 2 again works
        state = make_state(22)
        mgr.save(2, state)
        assert mgr.steps() == [1, 2]
        assert mgr.verify(2).ok
        assert_same(dict(mgr.load(2)["model"]), model_sd(state))
    wait_for_deletions()
    assert root_names(store) == [step_dir(1), step_dir(2)]


def _raise(e: BaseException) -> None:
    raise e


def _fails_verification_once(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """The next verification of ``step`` by the manager fails, as a flaky read would."""
    from ckptstore.integrity import VerifyReport
    from ckptstore.save import admit as manager_mod

    real = manager_mod.verify_checkpoint
    flaky = [True]

    def verify(storage: Storage, s: int, **kw: Any) -> VerifyReport:
        if s == step and flaky:
            flaky.clear()
            return VerifyReport(target=storage.describe(s), step=s, problems=["read timed out"])
        return real(storage, s, **kw)

    monkeypatch.setattr(manager_mod, "verify_checkpoint", verify)


def test_a_failed_save_keeps_the_step_it_was_to_replace(
    store: StoreView, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.codec import payload

    states = saved(store, [1, 2])
    with CheckpointManager(store.url) as mgr:
        # Step 2 fails verification transiently, and its replacement fails to write.
        _fails_verification_once(monkeypatch, 2)

        def full(*a: Any, **k: Any) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(payload, "write_group", full)
        with pytest.raises(CommitError, match="disk is full"):
            mgr.save(2, make_state(20))
        monkeypatch.undo()
        # The good checkpoint is still there, whole.
        assert mgr.steps() == [1, 2]
        assert mgr.verify(2).ok
        assert_same(dict(mgr.load(2)["model"]), model_sd(states[2]))


def test_a_corrupt_step_is_replaced_only_when_its_replacement_commits(
    store: StoreView, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved(store, [1, 2])
    store.corrupt(2, "model.safetensors")
    with CheckpointManager(store.url) as mgr:
        real = Storage.commit
        seen: list[list[int]] = []

        def commit(self: Storage, pending: Any, manifest: Any) -> None:
            seen.append(self.list_steps())  # everything is written: the old one is there
            real(self, pending, manifest)

        monkeypatch.setattr(Storage, "commit", commit)
        state = make_state(22)
        mgr.save(2, state)
        assert seen == [[1, 2]]
        assert mgr.steps() == [1, 2]
        assert mgr.verify(2).ok
        assert_same(dict(mgr.load(2)["model"]), model_sd(state))
    wait_for_deletions()
    assert root_names(store) == [step_dir(1), step_dir(2)], "the old one is gone afterwards"


@pytest.mark.parametrize("exchange", [True, False])
def test_a_crash_while_replacing_leaves_the_old_or_the_new_step(
    local: StoreView, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    states = saved(local, [1, 2])
    local.corrupt(2, "model.safetensors")
    old_bytes = local.read(f"{step_dir(2)}/model.safetensors")
    if not exchange:  # NFS, say: two renames, and the process dies between them
        monkeypatch.setattr(
            LocalStorage, "_exchange", lambda self, a, b: _raise(NotImplementedError())
        )
    real_rename = LocalStorage._rename

    def rename(self: LocalStorage, src: str, dst: str) -> None:
        if src.startswith(".tmp-step-000000000002-") and dst == step_dir(2):
            raise Crash
        real_rename(self, src, dst)

    monkeypatch.setattr(LocalStorage, "_rename", rename)
    monkeypatch.setattr(Storage, "abort", lambda self, pending: None)  # a crash cleans nothing
    real_fsync = LocalStorage._fsync_dir

    def fsync_dir(self: LocalStorage, rel: str) -> None:
        if rel == "" and exchange:
            raise Crash  # the exchange happened; the process dies before the fsync
        real_fsync(self, rel)

    monkeypatch.setattr(LocalStorage, "_fsync_dir", fsync_dir)
    mgr = CheckpointManager(local.url)
    with pytest.raises(Crash):
        mgr.save(2, state := make_state(22))
    monkeypatch.undo()
    mgr._lock.release()  # the process is gone, and its lock with it
    with CheckpointManager(local.url) as mgr2:
        if exchange:  # the new one is step 2 from the exchange on
            assert mgr2.steps() == [1, 2]
            assert_same(dict(mgr2.load(2)["model"]), model_sd(state))
        else:  # between the renames: the next writer's gc puts the old one back
            assert mgr2.steps() == [1]
            mgr2.gc()
            assert mgr2.steps() == [1, 2]
            assert local.read(f"{step_dir(2)}/model.safetensors") == old_bytes
            assert not mgr2.verify(2).ok  # still the corrupt one ...
            mgr2.save(2, state)  # ... which the next save replaces
            assert_same(dict(mgr2.load(2)["model"]), model_sd(state))
        mgr2.gc()
    assert root_names(local) == [step_dir(1), step_dir(2)]
    assert states


def test_failed_write_is_cleaned_up(store: StoreView, monkeypatch: pytest.MonkeyPatch) -> None:
    states = saved(store, [1])
    with CheckpointManager(store.url) as mgr:

        def put_small(rel: str, data: bytes) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(mgr.storage, "_put_small", put_small)
        with pytest.raises(CommitError, match="step 1 is still the newest") as ei:
            mgr.save(2, make_state(2))
        assert "I/O error" in str(ei.value)
        monkeypatch.undo()
        wait_for_deletions()
        assert root_names(store) == [step_dir(1)], "the aborted save left nothing behind"
        assert mgr.steps() == [1]
        fresh = fresh_like(states[1])
        assert mgr.restore(fresh) == 1
        mgr.save(2, make_state(2))
        assert mgr.steps() == [1, 2]


@pytest.mark.parametrize("how", ["interrupt", "answer lost"])
def test_a_manifest_put_that_lands_after_its_failure_leaves_a_whole_step(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a store without rename the manifest put is the commit. A Ctrl-C ended the wait for
    it, not the request (s3fs runs it on its own thread), and the save's abort removed the
    payloads before the manifest landed: the newest step was visible and had no files
    (found by review). A put whose answer was lost landed too, and was aborted the same way.
    Now the first is left as it is, the second is read back and committed."""
    view = memory_view()
    try:
        states = saved(view, [1])
        with CheckpointManager(view.url) as mgr:
            real = mgr.storage._put_small

            def put_small(rel: str, data: bytes) -> None:
                real(rel, data)  # the request reaches the store ...
                if rel.endswith("/manifest.json"):  # ... and its caller hears no answer
                    raise KeyboardInterrupt if how == "interrupt" else OSError(5, "timed out")

            monkeypatch.setattr(mgr.storage, "_put_small", put_small)
            if how == "interrupt":
                with pytest.raises(KeyboardInterrupt):
                    mgr.save(2, make_state(2))
            else:
                mgr.save(2, make_state(2))
            monkeypatch.undo()
            wait_for_deletions()
        with CheckpointManager(view.url) as mgr:
            assert mgr.steps() == [1, 2]
            assert mgr.verify(2).ok, mgr.verify(2).problems
            state = make_state(2)
            fresh = fresh_like(states[1])
            assert mgr.restore(fresh) == 2
            assert_same(dict(fresh["model"].state_dict()), model_sd(state))
            assert_same(fresh["extra"], state["extra"])
    finally:
        drop_memory(view)


def test_garbage_is_ignored_and_collected(store: StoreView) -> None:
    states = saved(store, [1])
    good = store.read(f"{step_dir(1)}/model.safetensors")
    # A manifest-less step (a crashed object-store save or a half copy) ...
    store.write(f"{step_dir(5)}/model.safetensors", good)
    store.write(f"{step_dir(5)}/state.json", b"{}")
    expected = [step_dir(5)]
    if store.local:  # ... and a crashed save and an interrupted deletion on a local disk.
        tmp = ".tmp-step-000000000006-" + "a" * 32
        trash = ".trash-step-000000000000-" + "b" * 32
        store.write(f"{tmp}/model.safetensors", good)
        store.write(f"{trash}/{MANIFEST}", store.read(f"{step_dir(1)}/{MANIFEST}"))
        expected = sorted([*expected, tmp, trash])
    with CheckpointManager(store.url) as mgr:
        assert mgr.steps() == [1]
        assert mgr.restore(fresh_like(states[1])) == 1
        assert mgr.gc() == expected
        assert root_names(store) == [step_dir(1)]
        assert mgr.verify(1).ok
        assert mgr.gc() == []


def test_second_save_of_a_step_is_refused(store: StoreView) -> None:
    saved(store, [3])
    before = store.files()
    with CheckpointManager(store.url) as mgr:
        with pytest.raises(StepExistsError, match="already committed") as ei:
            mgr.save(3, make_state(99))
        assert isinstance(ei.value, FileExistsError)
        assert mgr.steps() == [3]
    wait_for_deletions()
    assert store.files() == before, "the committed step is byte-identical"


# ---- retention ----------------------------------------------------------------------------


def test_keep_last_by_number(store: StoreView) -> None:
    saved(store, [9, 10, 100], keep=2)
    assert root_names(store) == [step_dir(10), step_dir(100)]


def test_keep_best_and_last(store: StoreView) -> None:
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.1, 5: 0.7, 6: 0.8}
    with CheckpointManager(store.url, keep=[KeepBest(2, "val_loss"), KeepLast(1)]) as mgr:
        for s, loss in losses.items():
            mgr.save(s, {"x": torch.full((3,), float(s))}, metrics={"val_loss": loss})
        mgr.wait()
        assert mgr.steps() == [2, 4, 6]
        assert float(mgr.load(4)["x"][0]) == 4.0
    assert root_names(store) == [step_dir(2), step_dir(4), step_dir(6)]


def test_keep_best_max_and_every(store: StoreView) -> None:
    acc = {1: 0.5, 2: 0.9, 3: 0.4, 4: 0.6, 5: 0.2}
    with CheckpointManager(store.url, keep=[KeepBest(1, "acc", mode="max"), KeepEvery(4)]) as mgr:
        for s, a in acc.items():
            mgr.save(s, {"x": torch.tensor(s)}, metrics={"acc": a})
        mgr.wait()
        assert mgr.steps() == [2, 4, 5], "best, every 4th, and always the newest"


def test_pin_protects_a_step(store: StoreView) -> None:
    with CheckpointManager(store.url, keep=1) as mgr:
        mgr.save(1, {"x": torch.tensor(1)})
        mgr.pin(1)
        assert store.exists(f"{step_dir(1)}/pinned")
        for s in (2, 3):
            mgr.save(s, {"x": torch.tensor(s)})
        mgr.wait()
        assert mgr.steps() == [1, 3]
        assert mgr.verify(1).ok, "the pin marker is not a problem for verify"
        mgr.unpin(1)
        assert not store.exists(f"{step_dir(1)}/pinned")
        assert mgr.prune() == [1]
        mgr.wait()
        assert mgr.steps() == [3]
        with pytest.raises(NoCheckpointError):
            mgr.pin(1)
    assert root_names(store) == [step_dir(3)]


@pytest.mark.timeout(60)
def test_deletion_is_atomic(store: StoreView, monkeypatch: pytest.MonkeyPatch) -> None:
    states = saved(store, [1, 2])
    gate = threading.Event()
    backend = LocalStorage if store.local else FsspecStorage
    real_rmtree = backend._rmtree

    def held_rmtree(self: Storage, rel: str) -> None:  # the background deleter waits
        assert gate.wait(20)
        real_rmtree(self, rel)

    monkeypatch.setattr(backend, "_rmtree", held_rmtree)
    try:
        with CheckpointManager(store.url, keep=1) as mgr:
            assert mgr.prune() == [1]
            # Gone at once for readers, though its bytes are still being removed.
            assert mgr.steps() == [2]
            with pytest.raises(NoCheckpointError):
                mgr.restore(fresh_like(states[1]), step=1)
            if store.local:  # renamed away whole
                assert step_dir(1) not in store.names()
                assert [n for n in store.names() if n.startswith(".trash-")]
            else:  # the manifest went first; the payloads follow
                assert not store.exists(f"{step_dir(1)}/{MANIFEST}")
                assert store.exists(f"{step_dir(1)}/model.safetensors")
            gate.set()
            wait_for_deletions()
            assert root_names(store) == [step_dir(2)]
            assert mgr.restore(fresh_like(states[2])) == 2
    finally:
        gate.set()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_last_good_checkpoint_survives_retention(store: StoreView, damage: str) -> None:
    states = saved(store, [1, 2, 3])
    name = "model.safetensors"
    if damage == "flip":
        store.corrupt(3, name, offset=-1)
    else:
        rel = f"{step_dir(3)}/{name}"
        store.write(rel, store.read(rel)[:-10])
    with CheckpointManager(store.url, keep=1) as mgr:
        deleted = mgr.prune()
        mgr.wait()
        assert deleted == [1]
        assert mgr.steps() == [2, 3], "the newest stays, and so does the newest good one"
        fresh = fresh_like(states[2])
        assert mgr.restore(fresh) == 2
        assert_same(dict(fresh["model"].state_dict()), model_sd(states[2]))


# ---- corruption ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_falls_back_to_previous(
    store: StoreView, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    states = saved(store, [1, 2])
    payload = f"{step_dir(2)}/model.safetensors"
    # The last byte is tensor data: only the checksum can tell. In the header, the
    # safetensors parser may notice first; either way the file is refused.
    store.corrupt(2, "model.safetensors", offset=-1 if where == "data" else 100)
    why = "crc32c" if where == "data" else ""
    with CheckpointManager(store.url) as mgr:
        fresh = fresh_like(states[1])
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert mgr.restore(fresh) == 1
        assert_same(dict(fresh["model"].state_dict()), model_sd(states[1]))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("step 2" in w and payload in w and why in w for w in warnings), warnings

        untouched = fresh_like(states[1])
        before = dict(untouched["model"].state_dict())
        before = {k: v.clone() for k, v in before.items()}
        with pytest.raises(IntegrityError, match=r"model\.safetensors") as ei:
            mgr.restore(untouched, step=2)
        assert why in str(ei.value)
        assert_same(dict(untouched["model"].state_dict()), before)

        report = mgr.verify(2)
        assert not report.ok
        assert len(report.problems) == 1
        assert "model.safetensors" in report.problems[0]
        assert "crc32c" in report.problems[0]  # verify always reports the checksum
        assert mgr.verify(1).ok
        assert_same(dict(mgr.load()["model"]), model_sd(states[1]))
        with pytest.raises(IntegrityError):
            mgr.load(2)


def test_nothing_verifies(store: StoreView) -> None:
    states = saved(store, [1, 2])
    for s in (1, 2):
        store.corrupt(s, "model.safetensors", offset=-1)
    with CheckpointManager(store.url) as mgr:
        target = fresh_like(states[1])
        before = {k: v.clone() for k, v in target["model"].state_dict().items()}
        # Resuming must not quietly start from scratch: that would lose the run.
        with pytest.raises(NoCheckpointError, match="no checkpoint verifies") as ei:
            mgr.resume(target)
        assert "step 2" in str(ei.value)
        assert "step 1" in str(ei.value)
        assert_same(dict(target["model"].state_dict()), before)
        with pytest.raises(NoCheckpointError):
            mgr.load()


@pytest.mark.parametrize("damage", ["truncate", "delete", "grow"])
def test_truncated_or_missing_payload(store: StoreView, damage: str) -> None:
    states = saved(store, [1, 2])
    rel = f"{step_dir(2)}/optimizer.safetensors"
    if damage == "truncate":
        store.write(rel, store.read(rel)[:-1])
    elif damage == "grow":
        store.write(rel, store.read(rel) + b"\0")
    else:
        store.remove(rel)
    with CheckpointManager(store.url) as mgr:
        assert mgr.restore(fresh_like(states[1])) == 1
        with pytest.raises(IntegrityError, match=r"optimizer\.safetensors"):
            mgr.restore(fresh_like(states[1]), step=2)
        for deep in (True, False):
            report = mgr.verify(2, deep=deep)
            assert not report.ok
            assert any("optimizer.safetensors" in p for p in report.problems)


def test_tampered_manifest_is_refused(store: StoreView) -> None:
    states = saved(store, [1, 2])
    rel = f"{step_dir(2)}/{MANIFEST}"
    store.write(rel, store.read(rel).replace(b'"world_size": 1', b'"world_size": 2'))
    with CheckpointManager(store.url) as mgr:
        assert mgr.restore(fresh_like(states[1])) == 1
        with pytest.raises(ManifestError, match="self-checksum mismatch"):
            mgr.restore(fresh_like(states[1]), step=2)
        assert not mgr.verify(2).ok


def test_newer_format_version_is_refused(store: StoreView) -> None:
    states = saved(store, [1, 2])
    rel = f"{step_dir(2)}/{MANIFEST}"
    store.write(rel, forge_manifest(store.read(rel), lambda d: d.update(format_version=99)))
    with CheckpointManager(store.url) as mgr:
        with pytest.raises(ManifestError, match="format version 99") as ei:
            mgr.restore(fresh_like(states[1]), step=2)
        assert "newer ckptstore" in str(ei.value)
        assert "Upgrade" in str(ei.value)
        assert mgr.restore(fresh_like(states[1])) == 1
        report = mgr.verify(2)
        assert not report.ok
        assert "newer" in report.problems[0]


HOSTILE = ["../../sentinel", "../sentinel", "/etc/passwd", "a/b", ".hidden", "..", "x\\y", ""]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_manifest_names(store: StoreView, name: str) -> None:
    states = saved(store, [1, 2])
    # A file an escaping name would reach, outside the step and outside ROOT.
    outside = StoreView(store.kind, "", store.fs, store.base.rsplit("/", 1)[0])
    sentinels = {"sentinel": b"do not touch\n", f"{store.base.rsplit('/', 1)[1]}-x": b"!"}
    for n, data in sentinels.items():
        outside.write(n, data)
    store.write("sentinel", b"inside root, outside the step\n")
    rel = f"{step_dir(2)}/{MANIFEST}"

    def edit(doc: dict[str, Any]) -> None:
        doc["files"][name] = doc["files"].pop("model.safetensors")

    store.write(rel, forge_manifest(store.read(rel), edit))
    try:
        with CheckpointManager(store.url, keep=1) as mgr:
            with pytest.raises(ManifestError, match="unsafe file name"):
                mgr.restore(fresh_like(states[1]), step=2)
            with pytest.raises(ManifestError, match="unsafe file name"):
                mgr.manifest(2)
            assert mgr.restore(fresh_like(states[1])) == 1
            report = mgr.verify(2)
            assert not report.ok
            assert "unsafe file name" in report.problems[0]
            mgr.gc()
            mgr.save(3, make_state(3))  # retention deletes steps 1 and 2
            mgr.wait()
            assert mgr.steps() == [3]
        for n, data in sentinels.items():
            assert outside.read(n) == data
        assert store.read("sentinel") == b"inside root, outside the step\n"
    finally:
        for n in sentinels:
            outside.remove(n)


# ---- local filesystems only -------------------------------------------------------------


@pytest.fixture
def local(tmp_path: Path) -> Iterator[StoreView]:
    yield local_view(tmp_path / "store")
    wait_for_deletions()


def test_lock_file_lives_in_root(local: StoreView) -> None:
    with CheckpointManager(local.url) as mgr:
        mgr.save(1, {"x": torch.tensor(1)})
        assert os.path.exists(os.path.join(local.base, LOCK))
    assert local.names() == sorted([LOCK, step_dir(1)])


@pytest.mark.parametrize("planted", ["symlink", "dangling-symlink", "directory", "fifo"])
def test_lock_path_is_never_followed_or_opened_as_anything_else(
    local: StoreView, tmp_path: Path, planted: str
) -> None:
    states = saved(local, [1])
    lock = Path(local.base) / LOCK
    victim = tmp_path / "victim"
    lock.unlink()
    if planted == "symlink":
        # filelock 3.13-3.x opened the lock with O_TRUNC through the link: emptied victim.
        victim.write_bytes(b"keep me")
        os.symlink(victim, lock)
    elif planted == "dangling-symlink":
        os.symlink(victim, lock)  # O_CREAT through the link would create the victim
    elif planted == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with CheckpointManager(local.url, keep=1) as mgr:
        for call in (lambda: mgr.save(2, make_state(2)), mgr.prune):
            with pytest.raises(CommitError) as ei:
                call()
            msg = str(ei.value)
            assert f"its writer lock {lock} is a symlink or not a regular file" in msg, msg
            assert "Remove it" in msg
        assert mgr.steps() == [1], "nothing written, nothing deleted"
        fresh = fresh_like(states[1])
        assert mgr.restore(fresh) == 1  # readers take no lock
        assert_same(model_sd(fresh), model_sd(states[1]))
    if planted == "symlink":
        assert victim.read_bytes() == b"keep me"
    else:
        assert not victim.exists()
    assert root_names(local) == [step_dir(1)]
    # Once it is removed, the next writer creates a plain lock file and works.
    if planted == "directory":
        lock.rmdir()
    else:
        lock.unlink()
    with CheckpointManager(local.url, keep=1) as mgr:
        mgr.save(2, make_state(2))
        assert mgr.steps() == [2]
    assert lock.is_file()
    assert not lock.is_symlink()


def test_writer_lock_excludes_a_second_writer(local: StoreView) -> None:
    saved(local, [1])
    st = LocalStorage(local.base)
    first, second = st.writer_lock(), st.writer_lock()
    first.acquire()
    try:
        assert first.is_locked
        # Another lock object of this very process is refused as another process would be.
        with pytest.raises(StoreLockedError, match="is locked by another writer"):
            second.acquire()
        assert not second.is_locked
        with CheckpointManager(local.url) as mgr, pytest.raises(StoreLockedError):
            mgr.save(2, {"x": torch.tensor(2)})
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError):
            second.acquire(timeout=0.2)  # waits, then gives up
        assert time.monotonic() - t0 >= 0.2
    finally:
        first.release()
    assert not first.is_locked
    second.acquire()
    second.release()
    lock = Path(local.base) / LOCK
    assert lock.is_file()
    assert lock.read_bytes() == b"", "the lock file is never written"


def test_pin_never_follows_a_symlinked_step_directory(local: StoreView, tmp_path: Path) -> None:
    states = saved(local, [1, 2])
    # Step 2 moved out of the store and linked back in: pin and unpin would write or
    # remove the marker in the directory outside.
    outside = tmp_path / "outside-ckpt"
    os.rename(os.path.join(local.base, step_dir(2)), outside)
    os.symlink(outside, os.path.join(local.base, step_dir(2)))
    (outside / "pinned").write_bytes(b"pinned\n")  # for unpin to (not) remove
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    with CheckpointManager(local.url) as mgr:
        assert mgr.steps() == [1, 2]  # listed, as before: readers refuse it when they read
        for call, what in ((mgr.pin, "pin"), (mgr.unpin, "unpin")):
            with pytest.raises(CommitError) as ei:
                call(2)
            msg = str(ei.value)
            assert msg.startswith(f"{local.base}/{step_dir(2)} is a symlink or not a directory")
            assert f"ckptstore does not {what} it" in msg
        mgr.pin(1)  # a real step directory still pins
        assert (Path(local.base) / step_dir(1) / "pinned").is_file()
        fresh = fresh_like(states[1])
        assert mgr.restore(fresh) == 1, "the linked step is refused, the previous one loads"
        assert_same(model_sd(fresh), model_sd(states[1]))
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    assert os.path.islink(os.path.join(local.base, step_dir(2)))


def test_deletion_goes_through_trash(local: StoreView, monkeypatch: pytest.MonkeyPatch) -> None:
    saved(local, [1, 2])
    gate = threading.Event()
    real_rmtree = LocalStorage._rmtree

    def slow_rmtree(self: LocalStorage, rel: str) -> None:
        assert gate.wait(10)
        real_rmtree(self, rel)

    monkeypatch.setattr(LocalStorage, "_rmtree", slow_rmtree)
    renames: list[tuple[str, str]] = []
    real_rename = LocalStorage._rename

    def rename(self: LocalStorage, src: str, dst: str) -> None:
        renames.append((src, dst))
        real_rename(self, src, dst)

    monkeypatch.setattr(LocalStorage, "_rename", rename)
    try:
        with CheckpointManager(local.url, keep=1) as mgr:
            assert mgr.prune() == [1]
            names = root_names(local)
            assert step_dir(1) not in names, "the step vanishes at once"
            trash = [n for n in names if n.startswith(".trash-step-000000000001-")]
            assert len(trash) == 1
            assert renames == [(step_dir(1), trash[0])]
            assert mgr.steps() == [2]
            gate.set()
            wait_for_deletions()
            assert root_names(local) == [step_dir(2)]
    finally:
        gate.set()


def test_symlinked_payload_is_never_followed(local: StoreView, tmp_path: Path) -> None:
    states = saved(local, [1, 2])
    payload = os.path.join(local.base, step_dir(2), "model.safetensors")
    outside = tmp_path / "outside.safetensors"
    # The link target holds exactly the right bytes: following it would "verify".
    outside.write_bytes(Path(payload).read_bytes())
    content = outside.read_bytes()
    os.unlink(payload)
    os.symlink(outside, payload)
    with CheckpointManager(local.url, keep=1) as mgr:
        with pytest.raises(IntegrityError, match="not a regular file"):
            mgr.restore(fresh_like(states[1]), step=2)
        report = mgr.verify(2)
        assert not report.ok
        assert "not a regular file" in report.problems[0]
        assert mgr.restore(fresh_like(states[1])) == 1
        mgr.save(3, make_state(3))
        mgr.wait()
        assert mgr.steps() == [3]
    assert outside.read_bytes() == content


def test_symlinked_step_directory_is_never_followed(local: StoreView, tmp_path: Path) -> None:
    states = saved(local, [1, 2])
    # A complete, valid checkpoint outside ROOT, linked in as step 5.
    outside = tmp_path / "outside-ckpt"
    os.rename(os.path.join(local.base, step_dir(2)), outside)
    with open(outside / MANIFEST, "rb") as f:
        doc = f.read()
    (outside / MANIFEST).write_bytes(forge_manifest(doc, lambda d: d.update(step=5)))
    os.symlink(outside, os.path.join(local.base, step_dir(5)))
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    with CheckpointManager(local.url, keep=1) as mgr:
        with pytest.raises(ManifestError):
            mgr.restore(fresh_like(states[1]), step=5)
        assert mgr.restore(fresh_like(states[1])) == 1
        assert not mgr.verify(5).ok
        mgr.save(6, make_state(6))
        mgr.wait()
        mgr.gc()
        assert mgr.steps() == [6]
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before


def test_gc_never_follows_symlinks_out_of_root(local: StoreView, tmp_path: Path) -> None:
    saved(local, [1])
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"keep me")
    root = Path(local.base)
    os.symlink(victim, root / (".tmp-step-000000000002-" + "c" * 32))
    os.symlink(victim, root / step_dir(3))  # manifest-less "step": garbage
    trash = root / (".trash-step-000000000004-" + "d" * 32)
    trash.mkdir()
    os.symlink(victim / "precious", trash / "link")
    os.symlink(victim, trash / "dirlink")
    with CheckpointManager(local.url) as mgr:
        assert len(mgr.gc()) == 3
    assert root_names(local) == [step_dir(1)]
    assert (victim / "precious").read_bytes() == b"keep me"


def test_gc_takes_a_tmp_entry_out_of_the_way_before_an_uploader_can_publish_it(
    local: StoreView, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: `ckptstore gc` on a local replica (whose uploader holds no lock of
    # it) emptied a `.tmp-` directory while the uploader renamed it to `step-N`: the
    # rmtree went on inside the committed step, which verified as missing files, and the
    # job's retention deleted the local copy it thought safe. gc now renames the entry to
    # `.trash-` first: a commit that comes after fails, and nothing is published.
    import shutil

    from ckptstore.manifest import Manifest

    saved(local, [1])
    storage = LocalStorage(local.base)
    one = storage.read_manifest(1)
    pending = storage.begin(2)
    for name in one.files:
        shutil.copy(Path(local.base, step_dir(1), name), Path(local.base, pending.dirname, name))
    raw = Path(local.base, step_dir(1), MANIFEST).read_bytes()
    storage.prepare(pending, Manifest.from_bytes(forge_manifest(raw, lambda d: d.update(step=2))))
    real = LocalStorage._rmtree
    errors: list[OSError] = []

    def rmtree(self: LocalStorage, rel: str) -> None:
        if not errors:  # the uploader's commit, just as gc starts to remove its entry
            try:
                storage.publish(pending)
            except OSError as e:
                errors.append(e)
            else:
                errors.append(OSError("published"))
        real(self, rel)

    monkeypatch.setattr(LocalStorage, "_rmtree", rmtree)
    assert storage.gc(include_tmp=True) == [pending.dirname]
    assert isinstance(errors[0], FileNotFoundError), errors
    assert storage.list_steps() == [1]
    assert root_names(local) == [step_dir(1)]


def test_a_manifest_that_fails_to_stat_is_never_taken_for_garbage(
    local: StoreView, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A disk or a network filesystem failing for a moment (EIO, ESTALE) on the lstat of a
    # committed step's manifest. os.path.lexists answers False on every error: the step was
    # counted as manifest-less garbage, left out of steps() and removed by gc (the CLI's,
    # and a job's first save's).
    import errno

    from _helpers import run_cli

    states = saved(local, [10, 20])
    bad = os.path.join(local.base, step_dir(20), MANIFEST)
    real = os.lstat

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fspath(path) == bad:
            raise OSError(errno.EIO, os.strerror(errno.EIO), bad)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    storage = LocalStorage(local.base)
    with pytest.raises(OSError, match="Input/output error") as e:
        storage.list_steps()
    assert e.value.filename == bad
    with pytest.raises(OSError, match="Input/output error"):
        storage.gc()
    rc, _, err = run_cli(capsys, "gc", local.base)
    assert rc != 0
    assert "Input/output error" in err
    assert step_dir(20) in err
    with CheckpointManager(local.url) as mgr:
        with pytest.raises(OSError, match="Input/output error"):
            mgr.restore(fresh_like(states[20]))  # not step 10 as the newest: it cannot know
        with pytest.raises(OSError, match="Input/output error"):
            mgr.save(21, make_state(21))  # it cannot know which steps there are
    assert root_names(local) == [step_dir(10), step_dir(20)]
    monkeypatch.setattr(os, "lstat", real)  # the disk answers again: nothing was lost
    wait_for_deletions()
    with CheckpointManager(local.url) as mgr:
        assert mgr.steps() == [10, 20]
        got = fresh_like(states[20])
        assert mgr.restore(got, step=20) == 20
        assert_same(dict(got["model"].state_dict()), model_sd(states[20]))


def test_retention_keeps_the_step_a_resume_restored_over_one_it_could_not_read(
    local: StoreView, caplog: pytest.LogCaptureFixture
) -> None:
    # The restore of step 30 failed (an I/O error on its first read), so the job resumed
    # from 20 and trains on. Retention's "last good" walk then deep-verified 30 (which
    # reads fine now), kept it as the last good step and, with keep=1, deleted each new
    # step the job saved right after its commit; and it read all of 30 again at every save.
    from faults import Injector, injected

    states = saved(local, [20, 30])
    with CheckpointManager(local.url, keep=1) as mgr:
        with (
            injected(Injector(1, "EIO", target=step_dir(30))) as inj,
            caplog.at_level(logging.WARNING, logger="ckptstore"),
        ):
            assert mgr.restore(fresh_like(states[20])) == 20
        assert inj.fired is not None
        assert any("step 30" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            for s in (21, 22):
                mgr.save(s, make_state(s), allow_older=True)
                mgr.wait()
                wait_for_deletions()
                # keep=1 keeps the newest step (30), and the newest known good: this one.
                assert mgr.steps() == [s, 30]
        assert not [r for r in caplog.records if "retention keeps an older" in r.getMessage()]
        got = fresh_like(states[20])
        assert mgr.restore(got, step=22) == 22
        assert_same(dict(got["model"].state_dict()), model_sd(make_state(22)))


# ckptstore inspect under an address space of 1 GiB (it never imports torch).
_INSPECT_UNDER_1GIB = (
    "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
    "from ckptstore.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.timeout(120)
def test_a_json_file_claimed_larger_than_a_save_writes_is_refused_unread(
    local: StoreView, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: state.json made a sparse hole of gigabytes (no disk used), the
    forged manifest claiming its size: load and inspect allocated it all, and read it, before
    its CRC failed (3.4 GB and 17 s at 3 GiB)."""
    states = saved(local, [1, 2])
    step2 = Path(local.base) / step_dir(2)
    size = MAX_JSON_FILE_BYTES + 1
    os.truncate(step2 / "state.json", size)
    m = step2 / MANIFEST
    m.write_bytes(
        forge_manifest(m.read_bytes(), lambda d: d["files"]["state.json"].update(bytes=size))
    )
    said = f"{step2}/state.json: {size} bytes of JSON, more than a save writes"
    with CheckpointManager(local.url) as mgr:
        with pytest.raises(IntegrityError, match=re.escape(said)):
            mgr.load(2)
        assert mgr.restore(fresh_like(states[1])) == 1  # the step before still loads
    cmd = [sys.executable, "-c", _INSPECT_UNDER_1GIB, "inspect", local.base, "--step", "2"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert said in proc.stderr, proc.stderr


def test_a_save_refuses_json_larger_than_a_reader_reads(
    local: StoreView, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.storage import pending

    states = saved(local, [1])
    monkeypatch.setattr(pending, "MAX_JSON_FILE_BYTES", 4096)
    with CheckpointManager(local.url) as mgr:
        with pytest.raises(CommitError, match=r"state\.json would be \d+ bytes of JSON, more than"):
            mgr.save(2, {"order": list(range(2000))})  # a permutation kept as a list
        assert mgr.steps() == [1]
        assert mgr.restore(fresh_like(states[1])) == 1


def test_tmp_directory_is_in_root(local: StoreView, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = Storage.commit

    def commit(self: Storage, pending: Any, manifest: Any) -> None:
        seen.append(pending.dirname)
        assert os.path.isdir(os.path.join(local.base, pending.dirname))
        real(self, pending, manifest)

    monkeypatch.setattr(Storage, "commit", commit)
    with CheckpointManager(local.url) as mgr:
        mgr.save(1, {"x": torch.tensor(1)})
    assert len(seen) == 1
    assert "/" not in seen[0]
    assert seen[0].startswith(".tmp-step-000000000001-")

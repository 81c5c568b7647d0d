"""ckptstore against a real S3 HTTP endpoint (moto's server on loopback, through s3fs).

Nothing is mocked in-process: every request goes over HTTP to the server started once for
this module (``tests/s3server.py``), which also logs the requests it receives, so the tests
can assert what reached the wire (the order of PUTs and DELETEs, the number of listings).

"Another process" is played by a second s3fs filesystem instance
(``s3.other_options``: ``skip_instance_cache=True``): its own listing cache and connection
pool, which is all the state a second process would have that this one does not (the
botocore session it shares holds only the static service models).

At the end, the storage conformance suite of ``test_storage.py`` runs against S3 as well:
its tests are collected here with an ``s3`` ``store`` fixture, nothing else added.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import fsspec
import torch
from _helpers import (
    MANIFEST,
    StoreView,
    assert_same,
    forge_manifest,
    fresh_like,
    make_state,
    step_dir,
)
from s3server import S3Endpoint

from ckptstore import (
    CheckpointManager,
    CkptStoreError,
    CommitError,
    IntegrityError,
    KeepLast,
    ManifestError,
    NoCheckpointError,
    delete_steps,
    pin_steps,
    prune_store,
)
from ckptstore.cli import main
from ckptstore.storage import Storage, wait_for_deletions
from ckptstore.storage.remote import FsspecStorage

# Tests collected from test_storage.py carry no timeout of their own.
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def prefix(s3: S3Endpoint) -> str:
    return s3.unique_prefix()


@pytest.fixture
def url(s3: S3Endpoint, prefix: str) -> str:
    return s3.url(prefix)


def manager(s3: S3Endpoint, url: str, *, other: bool = False, **kwargs: Any) -> CheckpointManager:
    """A manager on ``url``; ``other=True``: with its own s3fs instance and listing cache."""
    opts = s3.other_options if other else s3.storage_options
    return CheckpointManager(url, storage_options=opts, **kwargs)


def objects(s3: S3Endpoint, prefix: str) -> list[str]:
    """The objects under ``prefix/`` (paths relative to it, sorted), listed by another client."""
    base = f"{s3.bucket}/{prefix}/"
    return sorted(p[len(base) :] for p in s3.client.find(base) if p.startswith(base))


def etags(s3: S3Endpoint, under: str) -> dict[str, str]:
    """``{path: ETag}`` of every object under ``under`` (``bucket[/prefix]``), fresh."""
    fs = s3.client
    return {k: str(v["ETag"]) for k, v in fs.find(under, detail=True).items()}


def model_sd(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def writes_to(s3: S3Endpoint, prefix: str, step: int) -> list[str]:
    """Names of the objects of ``step`` written (PUT / multipart) on the wire, in order."""
    base = f"/{s3.bucket}/{prefix}/{step_dir(step)}/"
    return [
        r.path[len(base) :]
        for r in s3.requests()
        if r.method in ("PUT", "POST") and r.path.startswith(base)
    ]


class Crash(BaseException):
    """The process dies here: nothing after it runs, no cleanup."""


# ---- save / restore / load / verify on S3 ------------------------------------------------


@pytest.mark.timeout(60)
def test_roundtrip(s3: S3Endpoint, url: str, prefix: str, codec: dict[str, Any]) -> None:
    states = {s: make_state(s) for s in (1, 2)}
    with manager(s3, url, keep=1, **codec) as mgr:
        assert mgr.steps() == []
        assert mgr.latest_step() is None
        for s, st in states.items():
            mgr.save(s, st, metrics={"val_loss": 1.0 / s})
        mgr.wait()
        assert mgr.steps() == [2]
        assert mgr.latest_step() == 2
        assert mgr.manifest().format == codec["format"]

        fresh = fresh_like(states[2])
        assert mgr.restore(fresh) == 2
        assert_same(model_sd(fresh), model_sd(states[2]))
        assert fresh["step"] == 2
        loaded = mgr.load()
        assert_same(dict(loaded["model"]), model_sd(states[2]))
        assert_same(loaded["extra"], states[2]["extra"])
        for deep in (True, False):
            report = mgr.verify(deep=deep)
            assert report.ok, report.problems
            assert report.files == 3  # the payloads and state.json
        assert mgr.verify().bytes_checked == mgr.manifest(2).total_bytes

    suffix = {"safetensors": ".safetensors", "torch": ".pt"}[codec["format"]]
    suffix += ".zst" if codec["compression"] else ""
    assert objects(s3, prefix) == sorted(
        f"{step_dir(2)}/{n}"
        for n in (MANIFEST, "state.json", f"model{suffix}", f"optimizer{suffix}")
    ), "step 1 was removed whole by retention; nothing else is there"


@pytest.mark.timeout(60)
def test_async_save(s3: S3Endpoint, url: str) -> None:
    states = {s: make_state(s) for s in (1, 2, 3)}
    expected = {}
    with manager(s3, url, keep=2, async_save=True, format="torch", compression="zstd") as mgr:
        for s, st in states.items():
            expected[s] = model_sd(st)
            handle = mgr.save(s, st)
            with torch.no_grad():  # training goes on at once; the checkpoint keeps the copy
                for p in st["model"].parameters():
                    p.add_(1.0)
        handle.wait()
        mgr.wait()
        assert mgr.steps() == [2, 3]
        for s in (3, 2):
            fresh = fresh_like(states[s])
            assert mgr.restore(fresh, step=s) == s
            assert_same(model_sd(fresh), expected[s])
        assert mgr.verify(2).ok


# ---- the commit protocol on S3 -----------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manifest_is_the_last_object_written(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    with manager(s3, url) as mgr:
        mgr.save(1, make_state(1))
    observer = manager(s3, url, other=True)
    assert observer.steps() == [1]

    events: list[str] = []
    in_flight: dict[str, Any] = {}
    real_open, real_put = FsspecStorage._open_write, FsspecStorage._put_small

    def open_write(self: FsspecStorage, rel: str) -> Any:
        events.append(rel)
        return real_open(self, rel)

    def put_small(self: FsspecStorage, rel: str, data: bytes) -> None:
        events.append(rel)
        if rel.endswith(MANIFEST):
            # The save is in flight: every payload is on S3, the manifest is not yet.
            in_flight["steps"] = observer.steps()
            in_flight["load"] = observer.latest_step()
            in_flight["objects"] = objects(s3, prefix)
        real_put(self, rel, data)

    monkeypatch.setattr(FsspecStorage, "_open_write", open_write)
    monkeypatch.setattr(FsspecStorage, "_put_small", put_small)
    s3.requests.clear()
    with manager(s3, url, async_save=async_save) as mgr:
        mgr.save(2, make_state(2))
        mgr.wait()
    monkeypatch.undo()

    d = step_dir(2)
    assert events[-1] == f"{d}/{MANIFEST}", events
    assert all(e.startswith(f"{d}/") for e in events), "object stores write in place"
    payloads = sorted(e.split("/", 1)[1] for e in events[:-1])
    assert payloads == ["model.safetensors", "optimizer.safetensors", "state.json"]
    # ... and on the wire: the manifest PUT is the last write of the step, made once.
    wire = writes_to(s3, prefix, 2)
    assert wire[-1] == MANIFEST, wire
    assert wire.count(MANIFEST) == 1
    assert sorted(wire[:-1]) == payloads

    assert in_flight["steps"] == [1], "a step is invisible until its manifest is put"
    assert in_flight["load"] == 1
    assert in_flight["objects"] == sorted(
        [f"{step_dir(1)}/{n}" for n in (MANIFEST, *payloads)] + [f"{d}/{n}" for n in payloads]
    )
    assert observer.steps() == [1, 2], "and visible as soon as it is"
    assert observer.verify(2).ok
    observer.close()


@pytest.mark.timeout(30)
def test_crash_before_the_manifest_leaves_an_invisible_step(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state1 = make_state(1)
    with manager(s3, url) as mgr:
        mgr.save(1, state1)

    def put_small(self: FsspecStorage, rel: str, data: bytes) -> None:
        raise Crash  # the process dies while putting the manifest

    monkeypatch.setattr(FsspecStorage, "_put_small", put_small)
    monkeypatch.setattr(Storage, "abort", lambda self, pending: None)  # a crash cleans nothing
    mgr = manager(s3, url)
    with pytest.raises(Crash):
        mgr.save(2, make_state(2))
    monkeypatch.undo()
    mgr.close()

    leftovers = sorted(n for n in objects(s3, prefix) if n.startswith(step_dir(2)))
    assert leftovers == [
        f"{step_dir(2)}/{n}" for n in ("model.safetensors", "optimizer.safetensors", "state.json")
    ]
    with manager(s3, url, other=True) as mgr:
        assert mgr.steps() == [1]
        assert mgr.latest_step() == 1
        fresh = fresh_like(state1)
        assert mgr.restore(fresh) == 1
        assert_same(model_sd(fresh), model_sd(state1))
        with pytest.raises(NoCheckpointError):
            mgr.restore(fresh, step=2)
        with pytest.raises(NoCheckpointError):
            mgr.load(2)
        assert_same(dict(mgr.load()["model"]), model_sd(state1))
        assert mgr.storage.list_garbage() == [step_dir(2)]
        assert mgr.gc() == [step_dir(2)]
        assert not [n for n in objects(s3, prefix) if n.startswith(step_dir(2))]
        assert mgr.gc() == []
        mgr.save(2, make_state(2))
        assert mgr.steps() == [1, 2]
        assert mgr.verify(2).ok


@pytest.mark.timeout(30)
def test_failed_upload_is_never_published(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with manager(s3, url) as mgr:
        mgr.save(1, make_state(1))
    real_open = FsspecStorage._open_write

    def open_write(self: FsspecStorage, rel: str) -> Any:
        upload = real_open(self, rel)
        if rel.endswith("optimizer.safetensors"):
            write = upload.write

            def fail(data: Any) -> int:
                write(data)  # some bytes are in the upload's buffer, then it fails
                raise OSError(5, "Input/output error")

            upload.write = fail
        return upload

    monkeypatch.setattr(FsspecStorage, "_open_write", open_write)
    s3.requests.clear()
    with manager(s3, url) as mgr:
        with pytest.raises(CommitError, match="step 1 is still the newest"):
            mgr.save(2, make_state(2))
        mgr.wait()
        assert mgr.steps() == [1]
    # Closing an S3 file uploads it: the failed one was discarded, never PUT, not even briefly.
    assert "optimizer.safetensors" not in writes_to(s3, prefix, 2)
    assert not [n for n in objects(s3, prefix) if n.startswith(step_dir(2))], "and aborted"


@pytest.mark.timeout(60)
def test_a_payload_another_process_removed_is_never_committed(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An object store has no writer lock: `ckptstore gc` (or another manager starting) on
    # the prefix while a save or an upload runs takes the uncommitted step's objects for
    # garbage. The manifest put after that committed a step whose payload was gone.
    state1 = make_state(1)
    with manager(s3, url) as mgr:
        mgr.save(1, state1)
    real = Storage.commit

    def commit(self: Storage, pending: Any, manifest: Any) -> None:
        # Another process: its own client lists the step's objects and removes one.
        s3.client.rm_file(f"{s3.bucket}/{prefix}/{pending.dirname}/optimizer.safetensors")
        real(self, pending, manifest)

    monkeypatch.setattr(Storage, "commit", commit)
    with manager(s3, url) as mgr:
        with pytest.raises(CommitError, match=r"optimizer\.safetensors was written") as e:
            mgr.save(2, make_state(2))
        assert "is gone at the commit" in str(e.value)
        assert "nothing was committed" in str(e.value)
    monkeypatch.undo()
    assert f"{step_dir(2)}/{MANIFEST}" not in objects(s3, prefix)
    with manager(s3, url, other=True) as mgr:
        assert mgr.steps() == [1]
        fresh = fresh_like(state1)
        assert mgr.restore(fresh) == 1
        assert_same(model_sd(fresh), model_sd(state1))


@pytest.mark.timeout(30)
def test_delete_removes_the_manifest_first(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with manager(s3, url) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
    observer = manager(s3, url, other=True)
    events: list[tuple[str, str]] = []
    real_remove, real_rmtree = FsspecStorage._remove, FsspecStorage._rmtree

    def remove(self: FsspecStorage, rel: str) -> None:
        events.append(("remove", rel))
        real_remove(self, rel)

    def rmtree(self: FsspecStorage, rel: str) -> None:
        # The manifest is gone: the step has vanished for every reader already.
        events.append(("rmtree", rel))
        events.append(("visible", ",".join(map(str, observer.steps()))))
        real_rmtree(self, rel)

    monkeypatch.setattr(FsspecStorage, "_remove", remove)
    monkeypatch.setattr(FsspecStorage, "_rmtree", rmtree)
    s3.requests.clear()
    with manager(s3, url, keep=1) as mgr:
        assert mgr.prune() == [1]
        mgr.wait()
    assert events == [
        ("remove", f"{step_dir(1)}/{MANIFEST}"),
        ("rmtree", step_dir(1)),
        ("visible", "2"),
    ]
    # On the wire: the manifest's DELETE comes before any other deletion of the step.
    base = f"/{s3.bucket}/{prefix}/{step_dir(1)}/"
    deletes = [r for r in s3.requests() if r.method == "DELETE" or r.is_bulk_delete]
    assert deletes[0].method == "DELETE"
    assert deletes[0].path == base + MANIFEST
    assert len(deletes) == 2
    assert deletes[1].is_bulk_delete, "the rest goes in one DeleteObjects request"
    assert objects(s3, prefix) == sorted(
        f"{step_dir(2)}/{n}"
        for n in (MANIFEST, "model.safetensors", "optimizer.safetensors", "state.json")
    )
    observer.close()


# ---- corruption and hostile manifests ------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", ["flip", "grow"])
def test_damaged_payload_is_caught(
    s3: S3Endpoint,
    url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    states = {s: make_state(s) for s in (1, 2)}
    with manager(s3, url) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
        assert mgr.verify(2).ok  # reads every object: the listing cache is warm

        # Another client damages the newest payload behind this process's back.
        fs = s3.client
        key = f"{s3.bucket}/{prefix}/{step_dir(2)}/model.safetensors"
        data = bytearray(fs.cat_file(key))
        if damage == "flip":
            data[-1] ^= 0xFF  # in the tensor data, past the header
        else:
            data += b"\0"
        fs.pipe_file(key, bytes(data))

        fresh = fresh_like(states[1])
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert mgr.restore(fresh) == 1, "falls back to the previous checkpoint"
        assert_same(model_sd(fresh), model_sd(states[1]))
        assert any("step 2" in r.getMessage() for r in caplog.records)
        with pytest.raises(IntegrityError, match=r"model\.safetensors"):
            mgr.restore(fresh_like(states[1]), step=2)
        with pytest.raises(IntegrityError, match=r"model\.safetensors"):
            mgr.load(2)
        report = mgr.verify(2)
        assert not report.ok
        assert len(report.problems) == 1
        assert f"{url}/{step_dir(2)}/model.safetensors" in report.problems[0]
        assert ("crc32c" if damage == "flip" else "bytes") in report.problems[0]
        # A quick check sees sizes and headers only: a flipped byte in tensor data passes it.
        assert mgr.verify(2, deep=False).ok is (damage == "flip")
        assert mgr.verify(1).ok


class GetCounter:
    """Counts the bytes of every ranged GET a storage makes, and how many run at once.

    Wraps the real ``FsspecStorage._get`` (one request to the server each): the payloads a
    load reads all go through it.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        self.bytes = 0
        self.calls = 0
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()
        real = FsspecStorage._get

        def counted(storage: FsspecStorage, p: str, start: int, end: int) -> bytes:
            with self._lock:
                self.running += 1
                self.most = max(self.most, self.running)
            try:
                data = real(storage, p, start, end)
            finally:
                with self._lock:
                    self.running -= 1
            with self._lock:
                self.bytes += len(data)
                self.calls += 1
            return data

        monkeypatch.setattr(FsspecStorage, "_get", counted)


def big_state() -> dict[str, Any]:
    """Three payload files, the model's 6 MiB; "alias" shares the model's tensor "b"."""
    block = 4 << 20
    model = {
        "a": torch.arange((block - 4096) // 4, dtype=torch.int32),
        "b": torch.arange(3 << 20, dtype=torch.int32) * 3,  # 12 MiB, block-aligned in the file
        "c": torch.arange(1 << 20, dtype=torch.int32) * 5,
    }
    return {
        "model": model,
        "optimizer": {"m": torch.arange(1 << 20, dtype=torch.float32)},
        "alias": {"b": model["b"]},
        "extra": {"v": torch.ones(100)},
        "step": 7,
    }


@pytest.mark.timeout(120)
def test_restore_reads_files_and_ranges_concurrently_byte_exact(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.storage import remote

    monkeypatch.setattr(remote, "RANGE", 1 << 20)  # many ranges out of small objects
    monkeypatch.setattr(remote, "MAX_RANGE", 1 << 20)
    state = big_state()
    with manager(s3, url) as mgr:
        mgr.save(7, state)
    counter = GetCounter(monkeypatch)
    s3.requests.clear()
    with manager(s3, url, other=True) as mgr:
        got = mgr.load(7)
    assert_same(got, state)
    model_key = f"/{s3.bucket}/{prefix}/{step_dir(7)}/model.safetensors"
    gets = [r for r in s3.requests() if r.method == "GET" and r.path == model_key]
    assert len(gets) == 20  # 20 MiB (4 KiB of header), one ranged GET per MiB
    assert counter.most > 1, "ranges and files were fetched one at a time"
    assert counter.most <= remote.WINDOW * FsspecStorage.read_concurrency


@pytest.mark.timeout(120)
def test_corrupt_block_of_a_large_object_is_found_before_use(
    s3: S3Endpoint, url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = big_state()
    older = big_state()
    older["model"]["c"] += 1
    with manager(s3, url) as mgr:
        mgr.save(6, older)
        mgr.save(7, state)
        key = f"{s3.bucket}/{prefix}/{step_dir(7)}/model.safetensors"
        data = bytearray(s3.client.cat_file(key))
        data[(4 << 20) + 12345] ^= 0x10  # block 1, inside "b"
        s3.client.pipe_file(key, bytes(data))
        where = f"{url}/{step_dir(7)}/model.safetensors"
        with pytest.raises(IntegrityError) as ei:
            mgr.load(7)
        assert str(ei.value).startswith(f"{where}: block 1 (bytes {4 << 20}..{8 << 20}) crc32c")
        with pytest.raises(IntegrityError, match=r"block 1 "):
            mgr.load(7, keys=["alias"])  # a ranged read checks the same block
        assert mgr.load(7, keys=["optimizer"])["optimizer"]["m"].equal(state["optimizer"]["m"])
        fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            assert mgr.restore(fresh) == 6
        assert_same(fresh["model"], older["model"])


@pytest.mark.timeout(120)
def test_partial_load_reads_only_the_ranges_it_needs(
    s3: S3Endpoint, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = big_state()
    with manager(s3, url) as mgr:
        mgr.save(7, state)
    small = 64 << 10  # state.json
    with manager(s3, url, other=True) as mgr:
        counter = GetCounter(monkeypatch)
        got = mgr.load(7, keys=["model"])
        assert_same(got["model"], state["model"])
        needed = sum(t.numel() * t.element_size() for t in state["model"].values())
        assert needed <= counter.bytes <= 1.05 * needed + small, (counter.bytes, needed)

        counter = GetCounter(monkeypatch)
        got = mgr.load(7, keys=["alias"])
        assert_same(got["alias"], state["alias"])
        needed = 12 << 20  # "b": three blocks; and the block holding the header
        assert counter.bytes <= 1.05 * needed + (4 << 20) + small, (counter.bytes, needed)


HOSTILE = ["../x", "../../x"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_manifest_touches_nothing_outside(s3: S3Endpoint, prefix: str, name: str) -> None:
    bucket = s3.new_bucket()  # of its own, so that every object in it can be accounted for
    url = f"s3://{bucket}/{prefix}"
    # Sentinels where an escaping name could reach: in ROOT, in the bucket, a sibling store.
    fs = s3.client
    for key in (f"{prefix}/x", "x", f"{prefix}-sibling/{step_dir(1)}/x", f"{prefix}x"):
        fs.pipe_file(f"{bucket}/{key}", b"sentinel " + key.encode())
    states = {s: make_state(s) for s in (1, 2)}
    with manager(s3, url) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    key = f"{bucket}/{prefix}/{step_dir(2)}/{MANIFEST}"

    def edit(doc: dict[str, Any]) -> None:
        doc["files"][name] = doc["files"].pop("model.safetensors")

    fs.pipe_file(key, forge_manifest(bytes(fs.cat_file(key)), edit))
    before = {k: v for k, v in etags(s3, bucket).items() if f"/{prefix}/step-" not in k}
    assert len(before) == 4

    with manager(s3, url, keep=1) as mgr:
        for call in (lambda: mgr.restore(fresh_like(states[1]), step=2), lambda: mgr.load(2)):
            with pytest.raises(ManifestError, match="unsafe file name"):
                call()
        with pytest.raises(ManifestError, match="unsafe file name"):
            mgr.manifest(2)
        assert mgr.restore(fresh_like(states[1])) == 1
        report = mgr.verify(2)
        assert not report.ok
        assert "unsafe file name" in report.problems[0]
        assert mgr.prune() == [], "step 2 is the newest, step 1 the newest that verifies"
        assert mgr.gc() == []
        mgr.save(3, make_state(3))  # retention now deletes steps 1 and 2
        mgr.wait()
        assert mgr.steps() == [3]
        assert mgr.restore(fresh_like(states[1])) == 3

    after = etags(s3, bucket)
    assert {k: v for k, v in after.items() if f"/{prefix}/step-" not in k} == before
    assert sorted({k.split("/")[2] for k in after if k not in before}) == [step_dir(3)]


# ---- listing: one request, the right prefix, no stale cache -----------------------------------


@pytest.mark.timeout(30)
def test_steps_is_one_listing(s3: S3Endpoint, url: str, prefix: str) -> None:
    with manager(s3, url) as mgr:
        for s in (1, 2, 3, 10, 200):
            mgr.save(s, make_state(s))
        mgr.pin(2)
        s3.client.pipe_file(f"{s3.bucket}/{prefix}/{step_dir(7)}/state.json", b"{}")

        s3.requests.clear()
        assert mgr.steps() == [1, 2, 3, 10, 200]
        reqs = s3.requests()
        assert len(reqs) == 1, reqs
        assert reqs[0].is_list
        assert reqs[0].query["prefix"] == f"{prefix}/"
        assert not reqs[0].query.get("delimiter"), "recursive: no delimiter, no per-step ls"

        s3.requests.clear()
        assert mgr.storage.list_garbage() == [step_dir(7)]
        assert len(s3.requests()) == 1

        s3.requests.clear()
        assert mgr.latest_step() == 200
        assert mgr.steps() == [1, 2, 3, 10, 200]
        assert len(s3.requests()) == 2, "never answered from a cached listing"


@pytest.mark.timeout(30)
def test_prefix_sharing_a_string_prefix_is_another_store(s3: S3Endpoint, prefix: str) -> None:
    run1, run10 = f"{prefix}/run1", f"{prefix}/run10"
    with manager(s3, s3.url(run10)) as mgr:
        for s in (5, 6, 7):
            mgr.save(s, make_state(s))
    fs = s3.client
    fs.pipe_file(f"{s3.bucket}/{run10}/{step_dir(9)}/state.json", b"{}")  # run10's garbage
    fs.pipe_file(f"{s3.bucket}/{run1}0", b"an object named like the store")
    everything = f"{s3.bucket}/{prefix}"
    run10_before = {
        k: v for k, v in etags(s3, everything).items() if not k.startswith(f"{everything}/run1/")
    }

    state = make_state(2)
    with manager(s3, s3.url(run1), keep=1) as mgr:
        assert mgr.steps() == []
        assert mgr.storage.list_garbage() == []
        assert mgr.resume(fresh_like(state)) == 0
        mgr.save(1, make_state(1))
        mgr.save(2, state)
        mgr.wait()
        assert mgr.steps() == [2]
        assert mgr.gc() == []
        fresh = fresh_like(state)
        assert mgr.restore(fresh) == 2
        assert_same(model_sd(fresh), model_sd(state))
    assert etags(s3, everything).items() >= run10_before.items(), "run10 is untouched"
    assert sorted({n.split("/")[0] for n in objects(s3, run1)}) == [step_dir(2)]
    with manager(s3, s3.url(run10)) as mgr:
        assert mgr.steps() == [5, 6, 7]
        assert mgr.storage.list_garbage() == [step_dir(9)]


@pytest.mark.timeout(30)
def test_glob_characters_in_root_stay_literal(s3: S3Endpoint, prefix: str) -> None:
    # fsspec's rm expands "[1]" as a glob: removing exp[1]/step-1 would remove exp1/step-1.
    literal, lookalike = f"{prefix}/exp[1]", f"{prefix}/exp1"
    with manager(s3, s3.url(lookalike)) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
    before = etags(s3, f"{s3.bucket}/{lookalike}")
    with manager(s3, s3.url(literal), keep=1) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
        mgr.wait()
        assert mgr.steps() == [2]
        s3.client.pipe_file(f"{s3.bucket}/{literal}/{step_dir(5)}/x", b"")
        assert mgr.gc() == [step_dir(5)]
    assert etags(s3, f"{s3.bucket}/{lookalike}") == before
    assert sorted({n.split("/")[0] for n in objects(s3, literal)}) == [step_dir(2)]
    with manager(s3, s3.url(lookalike)) as mgr:
        assert mgr.steps() == [1, 2]
        assert mgr.verify(1).ok


@pytest.mark.timeout(30)
def test_clients_see_each_others_commits_and_deletions(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two s3fs instances, each with its own listing cache, as two processes have."""
    writer = manager(s3, url, other=True, keep=2)
    reader = manager(s3, url, other=True)
    assert writer.storage.fs is not reader.storage.fs
    states = {s: make_state(s) for s in (1, 2, 3)}
    writer.save(1, states[1])
    assert reader.steps() == [1]
    assert_same(dict(reader.load()["model"]), model_sd(states[1]))

    # The reader lists while the writer's save of step 2 is in flight: its cache now holds
    # step-2/ without a manifest. After the commit it must not believe that listing.
    seen: dict[str, Any] = {}
    real_put = FsspecStorage._put_small

    def put_small(self: FsspecStorage, rel: str, data: bytes) -> None:
        if rel.endswith(MANIFEST) and self is writer.storage:
            seen["steps"] = reader.steps()
            seen["garbage"] = reader.storage.list_garbage()
            seen["exists"] = reader.storage.is_pinned(2)  # lists step-2/: no manifest yet
        real_put(self, rel, data)

    monkeypatch.setattr(FsspecStorage, "_put_small", put_small)
    writer.save(2, states[2])
    monkeypatch.undo()
    assert seen == {"steps": [1], "garbage": [step_dir(2)], "exists": False}
    assert reader.steps() == [1, 2]
    assert reader.manifest(2).step == 2
    assert reader.verify(2).ok
    assert_same(dict(reader.load()["model"]), model_sd(states[2]))
    assert reader.storage.list_garbage() == []

    # The writer's retention deletes step 1: the reader sees it gone.
    writer.save(3, states[3])
    writer.wait()
    assert reader.steps() == [2, 3]
    with pytest.raises(NoCheckpointError):
        reader.load(1)

    # The reader pins step 3; the writer (its cache warm) sees the pin and keeps the step.
    assert not writer.storage.is_pinned(3)
    reader.pin(3)
    assert writer.storage.is_pinned(3)
    writer.save(4, make_state(4))
    writer.save(5, make_state(5))
    writer.wait()
    assert reader.steps() == [3, 4, 5]
    reader.close()
    writer.close()


# ---- retention and pins -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_pin_prune_gc(s3: S3Endpoint, url: str, prefix: str) -> None:
    with manager(s3, url, keep=KeepLast(1)) as mgr:
        mgr.save(1, make_state(1))
        mgr.pin(1)
        for s in (2, 3):
            mgr.save(s, make_state(s))
        mgr.wait()
        assert mgr.steps() == [1, 3]
        assert mgr.storage.is_pinned(1)
        assert f"{step_dir(1)}/pinned" in objects(s3, prefix)
        assert mgr.plan_prune() == []
        mgr.unpin(1)
        assert mgr.plan_prune() == [1]
        assert mgr.prune() == [1]
        mgr.wait()
        assert mgr.steps() == [3]
        assert sorted({n.split("/")[0] for n in objects(s3, prefix)}) == [step_dir(3)]


def _three_steps(s3: S3Endpoint, url: str) -> None:
    with manager(s3, url) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, make_state(s))
        mgr.wait()


@pytest.mark.timeout(60)
def test_a_step_pinned_as_its_manifest_goes_is_kept(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object store has no rename: a pin written between a deleter's look at the pins and
    its removal of the manifest was lost (the step deleted, its marker swept with it) while
    `ckptstore pin` had said it held (found by review). The deleter looks again after the
    removal and puts the manifest back; the pin holds and the step verifies."""
    _three_steps(s3, url)
    real = FsspecStorage._remove
    pins: list[Any] = []

    def remove(self: FsspecStorage, rel: str) -> None:
        if rel == f"{step_dir(2)}/manifest.json" and not pins:
            pins.append(pin_steps(url, [2], storage_options=s3.storage_options))
        real(self, rel)

    monkeypatch.setattr(FsspecStorage, "_remove", remove)
    res = prune_store(url, 1, storage_options=s3.storage_options)
    wait_for_deletions()
    assert pins[0].changed == [2]  # the pinner was told it held
    assert res.deleted == [1]
    assert res.kept == [2, 3]
    names = objects(s3, prefix)
    assert f"{step_dir(2)}/manifest.json" in names
    assert f"{step_dir(2)}/pinned" in names
    assert not [n for n in names if n.startswith(step_dir(1))]
    with manager(s3, url) as mgr:
        assert mgr.steps() == [2, 3]
        assert mgr.storage.is_pinned(2)
        assert mgr.verify(2).ok


@pytest.mark.timeout(60)
def test_a_failed_second_look_at_the_pins_puts_the_manifest_back(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look after the manifest's removal failing (the store erring) left a manifest-less
    step, garbage to `gc`, whose pin may have landed (found by review): it comes back."""
    _three_steps(s3, url)
    real_pinned, real_remove = FsspecStorage.is_pinned, FsspecStorage._remove
    removed: list[str] = []

    def remove(self: FsspecStorage, rel: str) -> None:
        removed.append(rel)
        real_remove(self, rel)

    def is_pinned(self: FsspecStorage, step: int) -> bool:
        if f"{step_dir(step)}/manifest.json" in removed:  # the look after the removal
            raise OSError("the store erred")
        return real_pinned(self, step)

    monkeypatch.setattr(FsspecStorage, "_remove", remove)
    monkeypatch.setattr(FsspecStorage, "is_pinned", is_pinned)
    with pytest.raises(CommitError, match=r"could not delete .*step-000000000001.*the store erred"):
        prune_store(url, 1, storage_options=s3.storage_options)
    monkeypatch.undo()
    wait_for_deletions()
    assert f"{step_dir(1)}/manifest.json" in objects(s3, prefix)
    with manager(s3, url) as mgr:
        assert mgr.steps() == [1, 2, 3]
        assert mgr.verify(1).ok


@pytest.mark.timeout(60)
def test_a_pin_written_after_the_manifest_went_fails(
    s3: S3Endpoint, url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: the manifest is gone before the marker lands. The pin is refused
    (its confirmation looked at the marker alone, which the deleter leaves for its
    background sweep: "pinned" was said of a deleted step), and its marker removed."""
    _three_steps(s3, url)
    real = FsspecStorage._put_marker

    def put_marker(self: FsspecStorage, rel: str, data: bytes) -> None:
        delete_steps(url, [3], force=True, storage_options=s3.storage_options)
        real(self, rel, data)

    monkeypatch.setattr(FsspecStorage, "_put_marker", put_marker)
    with pytest.raises(CkptStoreError, match="was deleted as it was being pinned; nothing is pin"):
        pin_steps(url, [3], storage_options=s3.storage_options)
    wait_for_deletions()
    assert not [n for n in objects(s3, prefix) if n.startswith(step_dir(3))]
    with manager(s3, url) as mgr:
        assert mgr.steps() == [1, 2]


# ---- the command line against S3 ------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.timeout(30)
def test_cli_ls_verify_prune(
    s3: S3Endpoint, url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with manager(s3, url) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, make_state(s), metrics={"val_loss": 1.0 / s})
        mgr.pin(1)
    opts = s3.cli_options  # key, secret, endpoint_url: flat strings, as a shell passes them
    fs = s3.client
    fs.pipe_file(f"{s3.bucket}/{prefix}/{step_dir(4)}/model.safetensors", b"x")  # a crashed save

    rc, out, err = cli(capsys, "ls", url, *opts)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["step", "created"]
    assert [ln.split()[0] for ln in lines[1:4]] == ["1", "2", "3"]
    assert lines[1].rstrip().endswith("yes"), "step 1 is pinned"
    assert "val_loss=0.5" in lines[2]
    assert lines[4].startswith("3 checkpoints, ")
    # Review (s39, docs #2): ls said "`ckptstore gc` removes them", and plain gc keeps it.
    assert lines[5] == (
        "1 pending entry (manifest-less, at or above the newest committed step: an upload may "
        f"still finish it): {step_dir(4)}; `ckptstore gc --pending` removes it (only for a "
        "prefix no job uploads to any more)"
    )
    # Step 4 is above the newest committed step: on an object store (no writer lock) an
    # uploader may still finish it, so plain gc keeps it and says so; --pending removes it.
    rc, out, _ = cli(capsys, "gc", url, *opts)
    assert rc == 0
    assert out.startswith(f"kept {step_dir(4)}: pending at or above the newest committed step")
    assert "`ckptstore gc --pending` removes it" in out
    assert step_dir(4) in {n.split("/")[0] for n in objects(s3, prefix)}
    rc, out, _ = cli(capsys, "gc", "--pending", url, *opts)
    assert (rc, out) == (0, f"removed {step_dir(4)}\n")

    rc, out, err = cli(capsys, "verify", url, *opts)
    assert rc == 0, err
    assert out.startswith("step 3: OK (3 files, ")
    rc, out, _ = cli(capsys, "verify", url, "--all", "--quick", *opts)
    assert rc == 0
    assert "step 1: OK (3 files, quick: sizes and headers, no checksums)" in out
    assert out.rstrip().endswith("3 checkpoints verified, 0 failed")

    before = etags(s3, f"{s3.bucket}/{prefix}")
    rc, out, _ = cli(capsys, "prune", url, "--keep-last", "1", "--dry-run", *opts)
    assert rc == 0
    assert out.splitlines() == [
        "would delete 1 step: 2",
        "would keep 2 steps: 1, 3",
        "dry run: nothing was deleted",
    ]
    assert etags(s3, f"{s3.bucket}/{prefix}") == before

    # Damage step 3 behind the CLI's back: verify fails, prune keeps the newest good step.
    key = f"{s3.bucket}/{prefix}/{step_dir(3)}/optimizer.safetensors"
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    rc, out, _ = cli(capsys, "verify", url, "--step", "3", *opts)
    assert rc == 1
    assert out.splitlines()[0] == "step 3: FAILED"
    assert f"{url}/{step_dir(3)}/optimizer.safetensors: crc32c" in out
    rc, out, _ = cli(capsys, "prune", url, "--keep-last", "1", "--json", *opts)
    assert rc == 0
    assert json.loads(out) == {"root": url, "dry_run": False, "deleted": [], "kept": [1, 2, 3]}


@pytest.mark.timeout(30)
def test_cli_empty_and_missing_stores(
    s3: S3Endpoint, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3.url(prefix)
    rc, out, err = cli(capsys, "ls", url, *s3.cli_options)
    assert (rc, out) == (1, "")
    assert err.startswith(f"ckptstore: error: {url}: no store there: nothing is stored under")
    rc, _, err = cli(capsys, "verify", url, *s3.cli_options)
    assert rc == 1
    assert err.startswith(f"ckptstore: error: {url}: no store there")
    # A store whose only checkpoint is pending (its manifest not yet put) is a store.
    s3.client.pipe_file(f"{url}/{step_dir(1)}/model.safetensors", b"x")
    rc, out, _ = cli(capsys, "ls", url, *s3.cli_options)
    assert rc == 0
    assert out.startswith(f"{url}: no checkpoints\n")


# ---- the storage conformance suite, against S3 ---------------------------------------------------


@pytest.fixture
def store(s3: S3Endpoint) -> Iterator[StoreView]:
    """A fresh S3 store for the conformance tests of ``test_storage.py``.

    Those tests open ``CheckpointManager(store.url)`` without options, so the server's
    options go into fsspec's configuration for the ``s3`` protocol (what a user's
    ``~/.config/fsspec/s3.json`` does), for this test only. A private MonkeyPatch: the
    tests undo their own ``monkeypatch`` midway.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(fsspec.config.conf, "s3", s3.storage_options)
        prefix = s3.unique_prefix("conformance")
        fs = fsspec.filesystem("s3")
        yield StoreView("s3", s3.url(prefix), fs, f"{s3.bucket}/{prefix}")
        wait_for_deletions()


#: Left out for time only (an S3 request costs 10-20 ms against moto, and these make hundreds):
#: retention policies, whose planning is the same on every backend (S3 deletion, pins and
#: the last good step are tested above), and eight hostile names, whose S3 escapes are
#: tested above with a bucket-wide ETag snapshot.
_NOT_ON_S3 = {
    "test_hostile_manifest_names",
    "test_keep_last_by_number",
    "test_keep_best_and_last",
    "test_keep_best_max_and_every",
    "test_pin_protects_a_step",
    "test_last_good_checkpoint_survives_retention",
}


def _conformance_tests() -> dict[str, Any]:
    import test_storage

    return {
        f"test_conformance_{name[len('test_') :]}": fn
        for name, fn in vars(test_storage).items()
        if name.startswith("test_")
        and name not in _NOT_ON_S3
        and inspect.isfunction(fn)
        and "store" in inspect.signature(fn).parameters
    }


globals().update(_conformance_tests())


def test_range_reader_read_into_fills_the_callers_buffers_from_one_get(
    s3: S3Endpoint, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a resharded restore from an object store reads a chunk's blocks with: the bytes
    # of one ranged GET, scattered into side buffers and the target's memory.
    state = big_state()
    with manager(s3, url) as mgr:
        mgr.save(7, state)
        files = mgr.storage.read_manifest(7).files
        name = "model.safetensors"
        with mgr.storage.range_reader(7, files) as reader:
            want = reader.read(name, 1000, 9000)
            bufs = [memoryview(bytearray(n)) for n in (24, 8000, 976)]
            counter = GetCounter(monkeypatch)
            reader.read_into(name, 1000, bufs)
            assert (counter.calls, counter.bytes) == (1, 9000)
            assert b"".join(bytes(b) for b in bufs) == bytes(want)
            with pytest.raises(IntegrityError, match="run past the file"):
                reader.read_into(name, files[name].bytes - 10, [memoryview(bytearray(20))])


@pytest.mark.parametrize(
    "refused",
    [
        ("HEAD", MANIFEST, 403),
        ("HEAD", MANIFEST, 503),
        ("GET", MANIFEST, 403),
        ("GET", MANIFEST, 500),
        ("GET", "model.safetensors", 503),
    ],
    ids=["manifest-403", "manifest-503", "manifest-get-403", "manifest-get-500", "payload-503"],
)
def test_a_request_the_store_refuses_is_never_taken_for_a_bad_step(
    s3: S3Endpoint,
    url: str,
    refused: tuple[str, str, int],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The newest step's manifest look-up refused (403 AccessDenied: credentials or a bucket
    # policy) or failing (503 SlowDown, still after the client's retries), or a GET of its
    # payload failing so. Any such error read as a missing manifest ("missing or not a
    # regular file") or a damaged file ("unreadable"): resume skipped step 20 with a warning
    # and restored 10, ten steps lost on a store that was only throttling.
    import s3fs

    from ckptstore import StoreUnreachableError

    method, name, status = refused
    states = {s: make_state(s) for s in (10, 20)}
    with manager(s3, url) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    before = objects(s3, url.rsplit("/", 1)[1])
    opts = {**s3.storage_options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    # One try a request (s3fs makes 5, ~1.9 s of back-off for each refused 503 or 500): the
    # error that reaches ckptstore after the client's retries is the same after one.
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    with s3.refusing(method, f"{step_dir(20)}/{name}", status):
        with (
            caplog.at_level(logging.WARNING, logger="ckptstore"),
            CheckpointManager(url, storage_options=opts) as mgr,
        ):
            target = fresh_like(states[20])
            with pytest.raises(StoreUnreachableError) as e:
                mgr.resume(target)
            if name == MANIFEST:
                with pytest.raises(StoreUnreachableError):
                    mgr.load()
        assert "skipping" not in caplog.text
        if status == 403:
            assert "access denied" in str(e.value)
        else:
            assert f"{step_dir(20)}/{name}" in str(e.value)
            assert "nothing was skipped or removed" in str(e.value)
        if name == MANIFEST:
            assert_same(model_sd(target), model_sd(fresh_like(states[20])))  # untouched
    assert objects(s3, url.rsplit("/", 1)[1]) == before
    with manager(s3, url) as mgr:  # the store answers again: nothing was lost
        target = fresh_like(states[20])
        assert mgr.resume(target) == 21
        assert_same(model_sd(target), model_sd(states[20]))


@pytest.mark.parametrize("status", [403, 500])
def test_a_refused_read_of_a_dtensor_steps_rank_table_is_the_stores_not_a_bad_step(
    s3: S3Endpoint,
    url: str,
    mesh: Any,
    status: int,
    *,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DTensor step's rank table (``_ranks.jsonl``) read back refused (403) or failing
    (500): resume skipped step 20 as corrupt and restored 10 (found by review). One rank's
    DTensors on a one-rank mesh write the same files as N ranks'."""
    import s3fs
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstore import StoreUnreachableError

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # a 500 tried once, not 5 times
    values = {s: torch.arange(8.0) + s for s in (10, 20)}
    with manager(s3, url) as mgr:
        for s, v in values.items():
            mgr.save(s, {"w": distribute_tensor(v, mesh, [Shard(0)])})
    prefix = url.rsplit("/", 1)[1]
    before = objects(s3, prefix)
    assert f"{step_dir(20)}/_ranks.jsonl" in before
    opts = {**s3.storage_options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    target = {"w": distribute_tensor(torch.zeros(8), mesh, [Shard(0)])}
    with (
        s3.refusing("GET", f"{step_dir(20)}/_ranks.jsonl", status),
        caplog.at_level(logging.WARNING, logger="ckptstore"),
        CheckpointManager(url, storage_options=opts) as mgr,
        pytest.raises(StoreUnreachableError) as e,
    ):
        mgr.resume(target)
    assert "skipping" not in caplog.text
    assert f"{step_dir(20)}/_ranks.jsonl" in str(e.value) or "access denied" in str(e.value)
    assert torch.equal(target["w"].full_tensor(), torch.zeros(8))
    assert objects(s3, prefix) == before
    with manager(s3, url) as mgr:  # the store answers again: step 20 restores
        assert mgr.resume(target) == 21
    assert torch.equal(target["w"].full_tensor(), values[20])


def test_a_refused_read_never_lets_a_save_replace_a_good_step_or_hides_a_listing(
    s3: S3Endpoint, url: str
) -> None:
    """save(N) of a committed step verifies it first (a step that does not verify is
    replaced): a payload GET refused with 403 made the verify fail, and the good step 20
    was overwritten. A listing failing with 500 reached the caller as a bare OSError
    naming neither the store nor what happened (found by review)."""
    from ckptstore import StoreUnreachableError

    state = make_state(20)
    with manager(s3, url) as mgr:
        mgr.save(20, state)
    before = objects(s3, url.rsplit("/", 1)[1])
    opts = {**s3.storage_options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    with (
        s3.refusing("GET", f"{step_dir(20)}/model.safetensors", 403),
        CheckpointManager(url, storage_options=opts) as mgr,
        pytest.raises(StoreUnreachableError, match="access denied"),
    ):
        mgr.save(20, make_state(99))
    assert objects(s3, url.rsplit("/", 1)[1]) == before
    bucket = url.removeprefix("s3://").partition("/")[0]
    with (
        s3.refusing("GET", bucket, 500),
        pytest.raises(StoreUnreachableError, match="the object store failed a request"),
        CheckpointManager(url, storage_options=opts) as mgr,
    ):
        mgr.resume(fresh_like(state))
    with manager(s3, url) as mgr:
        target = fresh_like(state)
        assert mgr.resume(target) == 21
        assert_same(model_sd(target), model_sd(state))

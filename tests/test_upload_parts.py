"""Per-rank uploads (``ckptstore.tiers.upload_parts``) in one process, on moto's S3 server.

Each "rank" is a :class:`Replicator` with its ``rank`` set, uploading from a local store that
holds a sharded step of 2 ranks (written with the local commit protocol): the manifest is put
only by the uploader that finds every rank's done object, a stale or lying done object never
completes a step, and cleaning a shared prefix keeps the pending steps that may still finish.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from s3server import S3Endpoint

from ckptstore.errors import IntegrityError
from ckptstore.layout import step_dirname
from ckptstore.manifest import Manifest
from ckptstore.ops.verify import verify_checkpoint
from ckptstore.storage import Storage, open_storage
from ckptstore.tiers import upload_parts
from ckptstore.tiers.replica import Replicator

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def replica(s3: S3Endpoint) -> Storage:
    url = s3.url(s3.unique_prefix("parts"))
    st = open_storage(url, {**s3.storage_options, "skip_instance_cache": True})
    st.check_root(create=True)
    return st


def sharded_step(local: Storage, step: int, salt: str = "") -> Manifest:
    """Commit a sharded step of 2 ranks into ``local``: each rank's state and rank 1's blob."""
    pending = local.begin(step)
    for rank in (0, 1):
        # A state file a restore reads (deep verify decodes it): a dict of three values.
        root = {"t": "dict", "keys": ["rank", "step", "salt"], "vals": [rank, step, salt]}
        body = json.dumps({"ckptstore_state": 1, "root": root}).encode()
        pending.write_bytes(f"state.rank{rank:05d}.json", body, codec="json", rank=rank)
    blob = json.dumps(list(range(2000))).encode()
    pending.write_bytes("blob.rank00001.json", blob, codec="json", rank=1)
    manifest = Manifest(step=step, files=dict(pending.files), world_size=2, sharded=True)
    local.commit(pending, manifest)
    return manifest


def uploaders(local: Storage, replica: Storage) -> list[Replicator]:
    return [Replicator(local, replica, rank=r, retention=False, read_back=False) for r in (0, 1)]


def test_a_job_resumed_on_fewer_ranks_uploads_every_rank_s_part(
    tmp_path: Path, replica: Storage
) -> None:
    # A step of 2 ranks still waits for its upload when the job is killed; it comes back on
    # 1 rank. Each uploader sent only its own rank's files: rank 1's were never sent, the
    # manifest never put, the step never safe (so never deleted locally), and no error.
    local = open_storage(tmp_path / "local")
    manifest = sharded_step(local, 2)
    up = Replicator(local, replica, rank=0, world=1, retention=False, read_back=False)
    assert up.ranks_of(manifest) == [0, 1]
    assert up.recover(clean=False) == [2]
    up.wait()
    assert replica.list_steps() == [2]
    assert verify_checkpoint(replica, 2, deep=True).ok
    assert up.is_safe(2)
    assert up.deletable([2]) == [2]
    assert up.parts == {2: ["blob.rank00001.json", "state.rank00000.json", "state.rank00001.json"]}
    assert not upload_parts.held(replica)  # no pending part left behind
    up.close()
    # On 2 ranks of 3 (a job that grew, or the usual case): each its own files only.
    big = Replicator(local, replica, rank=1, world=3, retention=False)
    assert big.ranks_of(manifest) == [1]
    assert Replicator(local, replica, rank=2, world=3, retention=False).ranks_of(manifest) == [2]
    assert Replicator(local, replica, rank=0, retention=False).ranks_of(manifest) == [0]


def test_retention_never_lists_the_replica_on_the_training_thread(
    tmp_path: Path, replica: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1's node (its own local root) holds a step that rank 0's uploader committed on
    # the replica. Local retention runs on the training thread after each save, and asked
    # the replica there whether the step is safe: a replica that accepts connections and
    # does not answer held every save ~90 s (measured). The uploader's thread asks now.
    import shutil
    import threading

    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    local0 = open_storage(node0)
    sharded_step(local0, 2)
    shutil.copytree(node0, node1)
    local1 = open_storage(node1)
    up0 = Replicator(local0, replica, rank=0, retention=False, read_back=False)
    safe_now: list[int] = []
    up1 = Replicator(
        local1, replica, rank=1, retention=False, read_back=False, on_safe=safe_now.append
    )
    assert up1.upload_step(2)
    assert up0.upload_step(2)  # rank 0's uploader commits it, and records it on node 0 only
    real = up1.refresh
    asked, answer = threading.Event(), threading.Event()
    threads: list[str] = []

    def refresh(steps: Any = None) -> None:
        threads.append(threading.current_thread().name)
        asked.set()
        answer.wait(30)  # the replica answers only when the test says so
        real(steps)

    monkeypatch.setattr(up1, "refresh", refresh)
    assert up1.deletable([2]) == []  # held for now: not known to be safe on this node
    assert asked.wait(30)
    assert not answer.is_set()  # deletable returned while the listing was still waiting
    assert threads == ["ckptstore-replica"]
    answer.set()
    up1.wait()
    assert up1.is_safe(2)
    assert safe_now == [2]  # retention is called again, from the uploader's thread
    assert up1.deletable([2]) == [2]
    up0.close()
    up1.close()


def test_manifest_is_put_by_the_uploader_that_completes_the_step(
    tmp_path: Path, replica: Storage
) -> None:
    local = open_storage(tmp_path / "local")
    manifest = sharded_step(local, 2)
    up0, up1 = uploaders(local, replica)
    assert up1.upload_step(2)
    assert replica.list_steps() == []  # rank 0's files are not there: nothing visible
    names = replica._list(step_dirname(2))
    done = upload_parts.done_name(1, manifest)
    assert sorted(names) == ["blob.rank00001.json", "state.rank00001.json", done]
    assert not up1.is_safe(2)
    assert up0.upload_step(2)
    assert replica.list_steps() == [2]
    assert up0.is_safe(2)
    assert verify_checkpoint(replica, 2).ok
    assert up0.parts == {2: ["state.rank00000.json"]}
    assert up1.parts == {2: ["blob.rank00001.json", "state.rank00001.json"]}
    # Rank 1's retention asks: the replica is listed again, the whole step is safe there.
    assert up1.deletable([2]) == [2]
    assert up1.is_safe(2)


def test_stale_or_lying_done_objects_never_complete_a_step(
    tmp_path: Path, replica: Storage
) -> None:
    local = open_storage(tmp_path / "local")
    manifest = sharded_step(local, 3)
    up0, up1 = uploaders(local, replica)
    # Rank 1's done object of another save of step 3 (another manifest), and one of this
    # save that lists other files than the manifest says rank 1 wrote: neither counts.
    stale = {"rank": 1, "manifest": "0" * 32, "files": {}}
    replica._put_small(
        f"{step_dirname(3)}/upload.rank00001.{'0' * 32}.done", json.dumps(stale).encode()
    )
    tag = upload_parts.done_name(1, manifest).split(".")[2]
    lying = {"rank": 1, "manifest": tag, "files": {"state.rank00001.json": [1, 2]}}
    replica._put_small(
        f"{step_dirname(3)}/{upload_parts.done_name(1, manifest)}", json.dumps(lying).encode()
    )
    up0.upload_step(3)
    assert replica.list_steps() == []
    # Rank 1 uploads; then its blob vanishes from the replica: the step must not be committed.
    up1.upload_step(3)
    assert replica.list_steps() == [3]
    replica.delete(3, background=False)
    up0b, up1b = uploaders(local, replica)
    up1b.upload_step(3)
    replica._remove(f"{step_dirname(3)}/blob.rank00001.json")
    with pytest.raises(IntegrityError, match=r"blob\.rank00001\.json: marked uploaded"):
        up0b.upload_step(3)
    assert replica.list_steps() == []


def test_clean_keeps_pending_steps_that_may_still_finish(tmp_path: Path, replica: Storage) -> None:
    local = open_storage(tmp_path / "local")
    manifests = {s: sharded_step(local, s) for s in (1, 2, 3)}
    up0, up1 = uploaders(local, replica)
    up1.upload_step(1)  # rank 0 never uploads step 1
    up1.upload_step(2)
    up0.upload_step(2)  # committed
    up1.upload_step(3)  # rank 0's uploader died before step 3
    assert replica.list_steps() == [2]
    removed = upload_parts.clean(replica)
    assert removed == [step_dirname(1)]  # older than the newest committed step
    done3 = upload_parts.done_name(1, manifests[3])
    assert done3 in replica._list(step_dirname(3))  # kept
    # Rank 0 starts again: recover queues step 3 (and 1), and step 3 completes.
    again = Replicator(local, replica, rank=0, retention=False, read_back=False)
    assert again.recover(clean=False) == [3, 1]
    again.wait(timeout=30)
    again.close()
    assert replica.list_steps() == [2, 3]
    assert verify_checkpoint(replica, 3).ok


def test_cli_gc_keeps_pending_steps_an_upload_may_finish(
    tmp_path: Path, s3: S3Endpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ckptstore gc URL`` on a replica a job uploads to, rank by rank: it removes only the
    pending step older than the newest committed one (as the uploaders' own cleanup), keeps
    the newer one, which the job's uploader then completes; ``--pending`` removes what it
    names."""
    from ckptstore.cli import main

    url = s3.url(s3.unique_prefix("gc"))
    replica = open_storage(url, {**s3.storage_options, "skip_instance_cache": True})
    replica.check_root(create=True)
    local = open_storage(tmp_path / "local")
    manifests = {s: sharded_step(local, s) for s in (1, 2, 3, 4)}
    up0, up1 = uploaders(local, replica)
    up1.upload_step(1)  # rank 0 never uploads step 1
    up1.upload_step(2)
    up0.upload_step(2)  # committed
    up1.upload_step(3)  # rank 0's part of step 3 is still to come
    assert replica.list_steps() == [2]

    assert main(["gc", url, *s3.cli_options]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"removed {step_dirname(1)}"
    assert out[1].startswith(f"kept {step_dirname(3)}: pending at or above the newest")
    assert len(out) == 2
    assert replica._list(step_dirname(1)) == []
    done3 = upload_parts.done_name(1, manifests[3])
    assert done3 in replica._list(step_dirname(3))
    # The job goes on: rank 0's uploader completes step 3 with rank 1's kept part.
    assert up0.upload_step(3)
    assert replica.list_steps() == [2, 3]
    assert verify_checkpoint(replica, 3).ok

    up1.upload_step(4)
    assert main(["gc", "--json", url, *s3.cli_options]) == 0
    assert json.loads(capsys.readouterr().out) == {"removed": [], "kept": [step_dirname(4)]}
    assert main(["gc", "--pending", url, *s3.cli_options]) == 0
    assert capsys.readouterr().out == f"removed {step_dirname(4)}\n"
    assert replica._list(step_dirname(4)) == []
    assert replica.list_steps() == [2, 3]


def test_two_uploaders_completing_one_step_on_a_filesystem_both_succeed(tmp_path: Path) -> None:
    """Issue 24 #12: both ranks' uploaders find every done object at once and complete the
    step on a filesystem replica together; the second checks the files' sizes only after the
    first renamed the pending directory into place. Completing is idempotent: both report
    the step committed (no IntegrityError, so no ReplicaError at close), it verifies, and
    nothing of it is left pending."""
    import threading

    local = open_storage(tmp_path / "local")
    manifest = sharded_step(local, 2)
    root = tmp_path / "replica"
    stores = [open_storage(root), open_storage(root)]  # each uploader its own, as processes
    stores[0].check_root(create=True)
    both_done = threading.Barrier(2, timeout=20)
    published = threading.Event()
    for rank, st in enumerate(stores):
        put, size, publish = st._put_small, st._size, st.publish

        def put_done(rel: str, data: bytes, put: Any = put) -> None:
            put(rel, data)
            if rel.endswith(".done"):
                both_done.wait()  # each listing then shows both done objects

        def late_size(rel: str, size: Any = size, rank: int = rank) -> int:
            if rank == 1:  # the second completer checks sizes after the first's rename
                assert published.wait(20)
            return int(size(rel))

        def publish_then_tell(pending: Any, publish: Any = publish, rank: int = rank) -> None:
            if rank == 1:
                assert published.wait(20)
            publish(pending)
            if rank == 0:
                published.set()

        st._put_small = put_done  # type: ignore[method-assign]
        st._size = late_size  # type: ignore[method-assign]
        st.publish = publish_then_tell  # type: ignore[method-assign]
    ups = [
        Replicator(local, st, rank=r, retention=False, read_back=False)
        for r, st in enumerate(stores)
    ]
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = ups[rank].upload_step(2)
        except BaseException as e:  # reported below
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: True, 1: True}
    assert ups[0].is_safe(2)
    assert ups[1].is_safe(2)
    plain = open_storage(root)
    assert plain.list_steps() == [2]
    assert plain.read_manifest(2).to_bytes() == manifest.to_bytes()
    assert verify_checkpoint(plain, 2).ok
    assert plain.list_garbage() == []


def test_a_rank_whose_part_is_in_never_redoes_it(tmp_path: Path) -> None:
    """Found by the sharded crash campaign: a job was killed while step 15 was on its way to
    a filesystem replica (rank 0's part in, rank 2's not); in the next job rank 0's uploader
    started its part afresh, removing its files, while rank 2's, finding every done object,
    renamed the step into place: the replica showed step 15 without ``_ranks.jsonl``. A part
    that is whole is now left alone (nothing of it removed), and the step completes with it."""
    import os

    local = open_storage(tmp_path / "local")
    manifest = sharded_step(local, 2)
    replica = open_storage(tmp_path / "replica")
    replica.check_root(create=True)
    ups = [Replicator(local, replica, rank=r, retention=False, read_back=False) for r in (0, 1)]
    assert ups[0].upload_step(2)
    assert replica.list_steps() == []  # rank 0's part is in; rank 1's is not
    pending = tmp_path / "replica" / upload_parts.pending_dirname(replica, 2, manifest)
    assert "state.rank00000.json" in os.listdir(pending)
    # A new job's uploader of rank 0 (its first one was killed before the step completed).
    removed: list[str] = []
    real_remove = replica._remove

    def remove(rel: str) -> None:
        removed.append(rel)
        real_remove(rel)

    replica._remove = remove  # type: ignore[method-assign]
    again = Replicator(local, replica, rank=0, retention=False, read_back=False)
    again.upload_step(2)
    assert removed == []
    assert replica.list_steps() == []
    assert ups[1].upload_step(2)
    assert replica.list_steps() == [2]
    assert verify_checkpoint(replica, 2, deep=True).ok
    assert not os.path.exists(pending)


def test_a_local_replica_is_cleaned_of_what_is_a_day_old_only(tmp_path: Path) -> None:
    """A replica on a local path (another disk, a network mount): a manifest-less step
    written to just now may be another process's upload in flight and stays; one nothing
    was written to for a day (its files' mtimes) is a crash's and goes."""
    import os
    import time

    from ckptstore import CheckpointManager
    from ckptstore.tiers import replica as replica_mod

    with CheckpointManager(tmp_path / "job") as mgr:
        mgr.save(3, {"w": 1})
    replica = open_storage(str(tmp_path / "replica"))
    up = Replicator(open_storage(str(tmp_path / "job")), replica)
    up.recover()
    up.close()
    assert replica.list_steps() == [3]
    for s in (1, 2):  # pending steps, older than the committed one
        d = tmp_path / "replica" / step_dirname(s) / "sub"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
    old = time.time() - replica_mod.STALE_UPLOAD_S - 60
    for p in (tmp_path / "replica" / step_dirname(1)).rglob("*"):
        os.utime(p, (old, old))
    os.utime(tmp_path / "replica" / step_dirname(1), (old, old))
    assert replica.entry_age(step_dirname(2)) < 60
    assert replica.entry_age(step_dirname(1)) > replica_mod.STALE_UPLOAD_S
    again = Replicator(open_storage(str(tmp_path / "other")), replica)
    again.clean()
    again.close(wait=False)
    assert replica.list_garbage() == [step_dirname(2)]
    assert replica.list_steps() == [3]

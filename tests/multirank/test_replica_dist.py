"""Two tiers under torch.distributed: 2 gloo ranks on CPU, a replica on moto's S3 server.

Replicated saves are uploaded by rank 0 alone; a per-rank sharded save on a shared local root
is uploaded rank by rank (each rank its own files, the manifest once all are in); both ranks
resume on a new, empty root from the replica, and a
third "node" (one process, an empty disk) loads each rank's part from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from s3server import s3_server

from ckptstore import CheckpointManager
from ckptstore.storage import open_storage
from tests.multirank.launch import launch, values


@pytest.mark.timeout(180)
def test_sharded_save_replicated_and_restored_on_new_nodes(tmp_path: Path) -> None:
    with s3_server() as ep:
        url = ep.url(ep.unique_prefix("dist"))
        args = {"url": url, "options": ep.storage_options}
        saved = values(launch("replica_save", 2, tmp_path / "a", timeout=120, args=args))
        # Every rank has an uploader: each uploads its own files of a sharded step.
        assert [v["uploader"] for v in saved] == [True, True]
        for rank, v in enumerate(saved):
            mine = [f"{n}.rank{rank:05d}.safetensors" for n in ("model", "shard")]
            mine.append(f"state.rank{rank:05d}.json")
            assert v["parts"] == {"2": mine}
        replica = open_storage(url, {**ep.storage_options, "skip_instance_cache": True})
        assert replica.list_steps() == [1, 2]
        m = replica.read_manifest(2)
        assert sorted(m.files) == saved[0]["files"]
        assert "model.rank00001.safetensors" in m.files
        # Rank 1's done object lists the files it uploaded; the plain step 1 has none.
        (name,) = [
            n for n in replica._list("step-000000000002") if n.startswith("upload.rank00001.")
        ]
        with replica._open_read(f"step-000000000002/{name}") as f:
            done = json.loads(f.read())
        assert (done["rank"], sorted(done["files"])) == (1, saved[1]["parts"]["2"])
        assert not any(n.startswith("upload.") for n in replica._list("step-000000000001"))
        shutil.rmtree(tmp_path / "a" / "store")  # the nodes are gone

        got = values(launch("replica_restore", 2, tmp_path / "b", timeout=120, args=args))
        for rank, v in enumerate(got):
            assert v["next"] == 3
            assert v["shard"] == [100.0 * rank + i for i in range(6)]
            assert v["meta"] == {"rank": rank}
            assert v["model"] == saved[rank]["model"]
            assert v["local_steps"] == [2]  # fetched once, by rank 0, into the shared root

        # A third node, one process, an empty disk: each rank's part, from the replica.
        with CheckpointManager(
            tmp_path / "c", replica=url, replica_options=ep.storage_options
        ) as mgr:
            for rank in (0, 1):
                part = mgr.load(2, rank=rank)
                assert part["shard"].tolist() == [100.0 * rank + i for i in range(6)]

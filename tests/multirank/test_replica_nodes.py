"""Node-local roots: 2 gloo ranks, each its own local root (a directory per "node").

Sharded (FSDP2) saves commit a copy per node holding that node's ranks' files; each rank
uploads its own files to one S3 prefix (moto's server) and the manifest is put once every
rank's are there. An uploader that dies mid-upload leaves no visible step until the rank's
next manager finishes it. Without a replica, a node's copy verifies for what it holds, and a
read needing the other node's files fails, naming the rank. A third "node" with an empty
disk restores from the replica, and 2 ranks on new empty roots resume from it. One test,
three launches: each launch costs seconds of process start on a 2-core host.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointManager
from ckptstore.errors import IntegrityError
from ckptstore.storage import open_storage
from ckptstore.verify import verify_checkpoint
from tests.multirank.dtensor_scenarios import digests, make_net
from tests.multirank.launch import launch, values

NODES = {"roots": ["node0", "node1"]}
SHARDS = ["_shards.rank00000.safetensors", "_shards.rank00001.safetensors"]


def _plain_restore(mgr: CheckpointManager) -> tuple[int, dict[str, str]]:
    model = make_net(seed=42)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    step = mgr.restore(state)
    return step, digests(model, opt)


@pytest.mark.timeout(300)
def test_node_local_sharded_saves_upload_per_rank_and_restore_anywhere(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3server import s3_server

    with s3_server() as ep:
        url = ep.url(ep.unique_prefix("nodes"))
        args = {**NODES, "url": url, "options": ep.storage_options, "abandon": True}
        saved = values(launch("node_scenarios:nodes_save", 2, tmp_path, timeout=150, args=args))
        assert [v["split"] for v in saved] == [True, True]
        assert [v["peers"] for v in saved] == [[0], [1]]
        # Each node holds its own rank's shard, rank 0's plain files and the full manifest.
        for rank, v in enumerate(saved):
            assert SHARDS[rank] in v["files3"]
            assert SHARDS[1 - rank] not in v["files3"]
            assert {"model.safetensors", "state.json", "manifest.json"} <= set(v["files3"])
            assert "local-ranks" in v["files3"]
            assert v["verify3"] == {"ok": True, "problems": [], "elsewhere": [1 - rank]}
        assert saved[0]["local_steps"] == [1, 2, 3]
        assert saved[1]["local_steps"] == [2, 3]  # the plain step 1 is rank 0's alone
        assert saved[0]["close"]["ok"]
        assert saved[1]["close"]["error_type"] == "ReplicaError"  # its upload was stopped
        # Each rank uploaded its own part of step 2 (rank 0 also the plain files).
        assert SHARDS[0] in saved[0]["parts"]["2"]
        assert SHARDS[1] not in saved[0]["parts"]["2"]
        assert saved[1]["parts"]["2"] == [SHARDS[1]]

        opts = {**ep.storage_options, "skip_instance_cache": True}
        replica = open_storage(url, opts)
        # Rank 1's uploader died in step 3: no manifest, so no step 3 on the replica.
        assert replica.list_steps() == [1, 2]
        pending3 = sorted(replica._list("step-000000000003"))
        dones = [n for n in pending3 if n.startswith("upload.")]
        assert len(dones) == 1  # rank 0's alone
        assert dones[0].startswith("upload.rank00000.")
        assert "manifest.json" not in pending3
        assert SHARDS[1] not in pending3
        (name,) = [
            n for n in replica._list("step-000000000002") if n.startswith("upload.rank00001.")
        ]
        done = json.loads(replica._open_read(f"step-000000000002/{name}").read())
        assert done["rank"] == 1
        assert list(done["files"]) == [SHARDS[1]]

        # Without a replica, one process on node 0's disk: what the node holds verifies; a
        # read that needs rank 1's shard fails naming it (never a partial result); the
        # newest step this node holds whole (the plain step 1) still loads.
        with CheckpointManager(tmp_path / "node0") as mgr:
            report = mgr.verify(3)
            assert report.ok
            assert report.elsewhere == [1]
            assert report.to_dict()["elsewhere"] == [1]
            only0 = r"holds only rank\(s\) \[0\]'s files.*rank\(s\) \[1\]"
            with pytest.raises(IntegrityError, match=only0):
                mgr.load(3)
            with pytest.raises(IntegrityError, match=r"rank\(s\) \[1\]"):
                mgr.restore({"model": make_net(), "step": 0}, step=3, strict=False)
            raw = mgr.load()
            assert raw["step"] == 1
            assert torch.equal(raw["w"], torch.arange(4.0))
        # A corrupt shard of the node's own rank is a problem, not "elsewhere".
        shutil.copytree(tmp_path / "node1", tmp_path / "copy1")
        (tmp_path / "copy1" / "step-000000000003" / SHARDS[1]).write_bytes(b"x")
        with CheckpointManager(tmp_path / "copy1") as mgr:
            report = mgr.verify(3)
            assert report.elsewhere == [0]
            assert any(SHARDS[1] in p for p in report.problems)

        # The ranks start again on the same roots: rank 1's uploader finishes step 3, while
        # both resume from their own disks (rank 1 gets the plain step 1 from rank 0).
        again = {**args, "plain_step": 1}
        back = values(launch("node_scenarios:nodes_recover", 2, tmp_path, timeout=150, args=again))
        assert back[1]["parts"] == {"3": [SHARDS[1]]}
        for v in back:
            assert (v["next"], v["step"], v["digests"]) == (4, 3, saved[0]["digests3"])
            assert v["plain"] == [[0.0, 1.0, 2.0, 3.0], 1]
        assert replica.list_steps() == [1, 2, 3]
        assert verify_checkpoint(replica, 3).ok

        # A third node with an empty disk: one process, a plain model, the full tensors.
        with CheckpointManager(tmp_path / "node2", replica=url, replica_options=opts) as mgr:
            assert _plain_restore(mgr) == (3, saved[0]["digests3"])

        # Two ranks on new, empty node-local roots resume from the replica.
        fresh = {**args, "roots": ["new0", "new1"]}
        got = values(launch("node_scenarios:nodes_resume", 2, tmp_path, timeout=150, args=fresh))
        for v in got:
            assert (v["next"], v["step"], v["split"]) == (4, 3, True)
            assert v["digests"] == saved[0]["digests3"]
            assert v["local_steps"] == [3]

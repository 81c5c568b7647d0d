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
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from ckptstore import CheckpointManager
from ckptstore.cli import main
from ckptstore.errors import IntegrityError
from ckptstore.ops.diff import diff_steps
from ckptstore.ops.export import export_dcp_step, export_hf_step
from ckptstore.ops.inspect import inspect_step
from ckptstore.ops.verify import verify_checkpoint
from ckptstore.storage import open_storage
from tests.faults import Injector, injected
from tests.multirank.dtensor_scenarios import digests, make_net
from tests.multirank.launch import describe, launch, values

if TYPE_CHECKING:
    from s3server import S3Endpoint

NODES = {"roots": ["node0", "node1"]}
SHARDS = ["_shards.rank00000.safetensors", "_shards.rank00001.safetensors"]
#: Each rank's part of the split chunk index (format 3), a file of that rank like its shards.
PARTS = ["_index.rank00000.json", "_index.rank00001.json"]


def _plain_restore(mgr: CheckpointManager) -> tuple[int, dict[str, str]]:
    model = make_net(seed=42)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    step = mgr.restore(state)
    return step, digests(model, opt)


@pytest.mark.timeout(300)
def test_node_local_sharded_saves_upload_per_rank_and_restore_anywhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
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
        # Paused, rank 1's uploader never began step 3 (it chooses a step once the gate
        # opens); closed without waiting, it dropped the step, which stays local.
        assert saved[1]["close"]["ok"]
        # Each rank uploaded its own part of step 2 (rank 0 also the plain files).
        assert SHARDS[0] in saved[0]["parts"]["2"]
        assert SHARDS[1] not in saved[0]["parts"]["2"]
        assert saved[1]["parts"]["2"] == sorted([PARTS[1], SHARDS[1]])

        opts = {**ep.storage_options, "skip_instance_cache": True}
        replica = open_storage(url, opts)
        # Rank 1 never uploaded its part of step 3: no manifest, so no step 3 on the replica.
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
        assert sorted(done["files"]) == sorted([PARTS[1], SHARDS[1]])

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
        # The commands that read a DTensor step's index and shards say so too: they called
        # rank 1's missing index part "missing or not a regular file" (read as damage).
        node0 = tmp_path / "node0"
        for command in (
            lambda: inspect_step(node0, 3),
            lambda: diff_steps(node0, 2, 3),
            lambda: export_hf_step(node0, 3, tmp_path / "hf"),
            lambda: export_dcp_step(node0, 3, tmp_path / "dcp"),
        ):
            with pytest.raises(IntegrityError, match=only0 + r".*Run it on the replica"):
                command()
        assert not (tmp_path / "hf").exists()
        assert not (tmp_path / "dcp").exists()
        # A corrupt shard of the node's own rank is a problem, not "elsewhere".
        shutil.copytree(tmp_path / "node1", tmp_path / "copy1")
        (tmp_path / "copy1" / "step-000000000003" / SHARDS[1]).write_bytes(b"x")
        with CheckpointManager(tmp_path / "copy1") as mgr:
            report = mgr.verify(3)
            assert report.elsewhere == [0]
            assert any(SHARDS[1] in p for p in report.problems)

        # One process on a copy of node 0's disk, with the replica: step 3 is partial here and
        # not on the replica yet. Only the job's uploaders (each rank its part) can upload it:
        # this process does not queue it, so its close() does not fail on a step it never
        # saved (the sharded crash campaign's one-process check did), and uploads nothing.
        shutil.copytree(tmp_path / "node0", tmp_path / "solo0")
        caplog.set_level(logging.INFO, logger="ckptstore")
        solo = CheckpointManager(tmp_path / "solo0", replica=url, replica_options=opts)
        solo.close()
        assert "step 3 here holds only some ranks' files" in caplog.text
        assert replica.list_steps() == [1, 2]

        # The ranks start again on the same roots: rank 1's uploader finishes step 3, while
        # both resume from their own disks (rank 1 gets the plain step 1 from rank 0).
        again = {**args, "plain_step": 1}
        back = values(launch("node_scenarios:nodes_recover", 2, tmp_path, timeout=150, args=again))
        assert back[1]["parts"] == {"3": sorted([PARTS[1], SHARDS[1]])}
        for v in back:
            assert (v["next"], v["step"], v["digests"]) == (4, 3, saved[0]["digests3"])
            assert v["plain"] == [[0.0, 1.0, 2.0, 3.0], 1]
        assert replica.list_steps() == [1, 2, 3]
        assert verify_checkpoint(replica, 3).ok

        # Node 0's partial copy read whole by one process: only rank 1's shard comes from
        # the replica (every read of the replica is counted), checked, linked in beside
        # node 0's own files; the step is then complete on this disk.
        shutil.copytree(tmp_path / "node0", tmp_path / "fill0")
        filled = tmp_path / "fill0" / "step-000000000003"
        inode = (filled / SHARDS[0]).stat().st_ino
        open_storage(tmp_path / "fill0").set_pinned(3, True)  # the completed copy keeps it
        counted = Injector(op="_stream", target=replica.root)
        caplog.set_level(logging.INFO, logger="ckptstore")
        with CheckpointManager(tmp_path / "fill0", replica=url, replica_options=opts) as mgr:
            ep.requests.clear()
            with injected(counted):
                assert _plain_restore(mgr) == (3, saved[0]["digests3"])
            streamed = [op.target.rsplit("/", 1)[1] for op in counted.ops]
            # and the replica's rank table, read with its manifest (format 4; twice: when the
            # copy is chosen, and when the fill checks the replica's manifest)
            table = [n for n in streamed if n == "_ranks.jsonl"]
            assert 1 <= len(table) <= 2
            assert sorted(n for n in streamed if n not in table) == sorted([PARTS[1], SHARDS[1]])
            # The server's side: the objects of step 3 it served (GET), the manifest (and
            # its rank table) aside.
            served = {
                r.path.rsplit("/", 1)[1]
                for r in ep.requests()
                if r.method == "GET" and "/step-000000000003/" in r.path
            }
            assert served - {"manifest.json", "_ranks.jsonl"} == {PARTS[1], SHARDS[1]}
            entry = mgr.manifest(3).files[SHARDS[1]]
            part = mgr.manifest(3).files[PARTS[1]]
            assert f"(2 file(s), {entry.bytes + part.bytes} bytes)" in caplog.text
            assert "fetched rank(s) [1]'s files" in caplog.text
            report = mgr.verify(3)
            assert (report.ok, report.elsewhere) == (True, [])
        assert not (filled / "local-ranks").exists()
        assert open_storage(tmp_path / "fill0").is_pinned(3)  # issue 24 #4: node_fill too
        assert (filled / SHARDS[0]).stat().st_ino == inode  # kept (linked), not fetched
        assert (filled / SHARDS[1]).stat().st_size == entry.bytes

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


@pytest.mark.timeout(240)
def test_a_node_failing_its_commit_leaves_the_step_on_no_node(
    tmp_path: Path, s3: S3Endpoint
) -> None:
    """Two-phase commit of node-local copies: a full disk while node 1 prepares aborts
    every node's copy; node 1's rename failing makes node 0 take its renamed copy back.
    Either way the previous step stays the newest everywhere, restores on both ranks, and
    never reaches the replica (the uploader only learns of a step once every node has it).

    The same launch then runs ``async_save=True`` with DTensor state on 2 other roots: the
    background commit makes each node's copy (the staged state, not what training changed
    since), a full disk on node 1 in the background prepare fails the save on both ranks
    with nothing visible, the next one commits, and every committed step restores and
    reaches the replica.
    """
    url = s3.url(s3.unique_prefix("fault"))
    args = {**NODES, "url": url, "options": s3.storage_options}
    args.update(async_roots=["async0", "async1"], async_url=s3.url(s3.unique_prefix("async")))
    both = values(launch("node_scenarios:nodes_commits", 2, tmp_path, timeout=200, args=args))
    got = [b["sync"] for b in both]
    for rank, v in enumerate(got):
        two, three = v["2"], v["3"]
        assert not two["ok"]
        assert two["error_type"] == "CommitError"
        assert "aborted on every node" in two["message"]
        assert "rank(s) 1 " in two["message"]
        assert "disk is full" in two["message"]
        assert "step 1 is still the newest" in two["message"]
        assert not three["ok"]
        assert three["error_type"] == "CommitError"
        assert "rolled back on every node" in three["message"]
        assert "rank(s) 1 " in three["message"]
        for res in (two, three):
            assert res["steps"] == [1]  # on this rank's node
            assert res["tmp"] == []
        if rank == 1:
            assert "state.json" in two["fired"]
            assert "_rename" in three["fired"]
            assert ".tmp-step-000000000003" in three["fired"]
        else:
            assert two["fired"] is None
            assert three["fired"] is None
        assert v["restored"] == [1, 1, got[0]["digests1"]]
        assert v["steps4"] == [1, 4]
        assert v["digests4"] == got[0]["digests4"]
        assert v["replica_steps"] == [1, 4]

    got = [b["async"] for b in both]
    for rank, v in enumerate(got):
        assert v["steps2"] == [1, 2]
        assert SHARDS[rank] in v["files2"]
        assert SHARDS[1 - rank] not in v["files2"]
        assert "local-ranks" in v["files2"]
        failed = v["failed3"]
        assert not failed["ok"]
        assert "aborted on every node" in failed["message"]
        assert "rank(s) 1 " in failed["message"]
        assert "disk is full" in failed["message"]
        assert v["steps3"] == [1, 2]
        assert v["tmp3"] == []
        assert v["steps4"] == [1, 2, 4]
        assert v["restored"] == [4, 4, got[0]["digests4"]]
        assert v["restored2"] == got[0]["digests2"]
        assert v["replica_steps"] == [1, 2, 4]


@pytest.mark.timeout(240)
def test_two_ranks_per_node_on_two_nodes(
    tmp_path: Path, s3: S3Endpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 ranks, 2 node-local roots (ranks 0,1 share A; 2,3 share B), one FSDP2 save: each
    node holds its two ranks' shards, verify names the other node's ranks, each rank
    restores bit-exactly from its node, and a third empty "node" restores from the replica.
    """
    shards = [f"_shards.rank{r:05d}.safetensors" for r in range(4)]
    url = s3.url(s3.unique_prefix("four"))
    args = {"roots": ["nodeA", "nodeA", "nodeB", "nodeB"], "url": url}
    args["options"] = s3.storage_options
    got = values(launch("node_scenarios:nodes_shared", 4, tmp_path, timeout=200, args=args))
    want = got[0]["digests"]
    for rank, v in enumerate(got):
        node = [0, 1] if rank < 2 else [2, 3]
        other = [2, 3] if rank < 2 else [0, 1]
        assert (v["split"], v["peers"]) == (True, node)
        assert v["digests"] == want
        for r in node:
            assert shards[r] in v["files"]
        for r in other:
            assert shards[r] not in v["files"]
        assert {"model.safetensors", "state.json", "manifest.json", "local-ranks"} <= set(
            v["files"]
        )
        assert v["verify"] == {"ok": True, "problems": [], "elsewhere": other}
        assert v["restored"] == [1, 1, want]
        # The rank table (a line a rank) goes down the tree of node leaders (0 -> 2) only;
        # ranks 1 and 3 receive the outcome and a manifest of the files of no rank.
        ((sent, received),) = [(r[2], r[3]) for r in v["prepared"] if r[1] == "broadcast_tree"]
        if rank == 2:
            assert received > v["table"] > 4 * 200, v
        elif rank in (1, 3):
            assert received < v["table"], v
        else:
            assert sent > v["table"], v
        # Each rank uploaded its own shard (rank 0 also the files of no rank).
        part = v["parts"]["1"]
        assert [n for n in part if n.startswith("_shards.")] == [shards[rank]]
        assert ("state.json" in part) == (rank == 0)
    marker = json.loads((tmp_path / "nodeB" / "step-000000000001" / "local-ranks").read_text())
    assert marker == {"ranks": [2, 3], "world_size": 4, "checksum": marker["checksum"]}
    assert len(marker["checksum"]) == 8

    opts = {**s3.storage_options, "skip_instance_cache": True}
    with CheckpointManager(tmp_path / "nodeC", replica=url, replica_options=opts) as mgr:
        assert _plain_restore(mgr) == (1, want)

    # `ckptstore ls` flags a node's partial copy; nodeC's (fetched whole) is not partial.
    for node, here in (("nodeA", "ranks 0-1 of 4"), ("nodeB", "ranks 2-3 of 4")):
        assert main(["ls", str(tmp_path / node)]) == 0
        out = capsys.readouterr().out
        header, row = out.splitlines()[:2]
        assert header.split()[-3:] == ["pinned", "here", "tiers"]
        # Every node records its replica (not only the one whose uploader put the manifest);
        # a node learns that the step is complete there only from a later listing of it.
        assert row.endswith(("local+replica", "local only"))
        assert row.split()[0] == "1"
        assert here in row
        assert "1 step holds only some ranks' files here (node-local roots" in out
        assert main(["ls", "--json", str(tmp_path / node)]) == 0
        (entry,) = json.loads(capsys.readouterr().out)
        assert entry["local_ranks"] == ([0, 1] if node == "nodeA" else [2, 3])
    assert main(["ls", str(tmp_path / "nodeC")]) == 0
    out = capsys.readouterr().out
    assert "here" not in out.splitlines()[0]
    assert "ranks" not in out
    assert main(["ls", "--json", str(tmp_path / "nodeC")]) == 0
    assert json.loads(capsys.readouterr().out)[0]["local_ranks"] is None


@pytest.mark.timeout(240)
def test_a_rank_dying_in_the_publish_round_leaves_the_published_copies(tmp_path: Path) -> None:
    # Every node renamed its copy of step 2, then rank 1 died entering the exchange that
    # reports it. The survivors used to take their copies back: when rank 0's verdict
    # "committed" had reached some ranks first (they returned from save), that lost an
    # acknowledged step on the nodes that took it back (the sharded crash campaign:
    # "a node lost the acknowledged step"). The copies stay: step 2 is whole on every node
    # and the next job resumes it.
    roots = ["node0", "node1", "node2"]
    args = {"roots": roots, "timeout": 3}
    res = launch("node_scenarios:nodes_die_in_commit", 3, tmp_path, timeout=150, args=args)
    assert res[1].returncode == -9, describe(res)
    for r in (0, 2):
        save2 = res[r].value["save2"]
        assert save2["error_type"] == "BarrierTimeout", describe(res)
        assert save2["missing_ranks"] == [1], describe(res)
        assert res[r].value["steps"] == [1, 2], describe(res)
    assert sorted(p.name for p in (tmp_path / "node1").glob("step-*")) == [
        "step-000000000001",
        "step-000000000002",
    ]
    got = values(launch("node_scenarios:nodes_resume", 3, tmp_path, timeout=150, args=args))
    assert [g["step"] for g in got] == [2, 2, 2]
    assert all(g["digests"] == res[0].value["digests2"] for g in got)

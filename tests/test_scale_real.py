"""tools/scale_real.py: real ranks, what each one's coordination costs as the world grows."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from _helpers import REPO, fork_tool_servers


@pytest.mark.timeout(300)
def test_a_non_zero_rank_receives_as_much_on_4_ranks_as_on_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scale.json"
    # The tool's main in this process (it imports no torch itself), so that its rank server
    # is forked from the test fork server (fork_tool_servers) instead of a fresh interpreter
    # importing torch, FSDP2 and ckptstore; the ranks are still forked by that server.
    fork_tool_servers(monkeypatch)
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # sys.path as it was, after the test
    argv = ["scale_real.py", "--worlds", "2", "4", "--layers", "6", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    importlib.import_module("scale_real").main()
    assert "this tree:" in capsys.readouterr().out
    runs = json.loads(out.read_text())["current"]
    assert [r["world"] for r in runs] == [2, 4]
    for run in runs:
        assert all(r["restored_equal"] for r in run["ranks"])
        for r in run["ranks"]:
            # save: enter, plan, gather, commit; restore: enter (a reduce: the ranks agree on
            # the call), choose, check (no rank refused its targets), load, applied
            # (+ barriers)
            assert r["save1"]["collectives"] == 8
            assert r["restore"]["collectives"] == 10
    for op in ("save1", "save2", "restore"):
        small = max(r[op]["received"] for r in runs[0]["ranks"][1:])
        large = max(r[op]["received"] for r in runs[1]["ranks"][1:])
        assert large <= small * 1.05 + 64, (op, small, large)
        # rank 0 receives one slot more per rank it gathers from
        assert runs[1]["ranks"][0][op]["received"] > runs[0]["ranks"][0][op]["received"]

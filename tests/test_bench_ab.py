"""tools/bench_ab.py: this tree's ckptstore and a commit's, side by side, each really run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import fork_tool_servers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import baseline  # noqa: E402
import bench_ab  # noqa: E402 - tools/ is not a package


def test_operation_names_and_sizes_are_read_as_the_bench_spells_them() -> None:
    assert bench_ab.parse_op("save-2") == ("save", 2, 2)
    assert bench_ab.parse_op("restore-2to3") == ("restore", 2, 3)
    assert bench_ab.parse_op("restore-4to2") == ("restore", 4, 2)
    assert bench_ab.parse_size("256MB") == 256 << 20
    assert bench_ab.parse_size("1.5GB") == int(1.5 * (1 << 30))
    assert bench_ab.parse_size("4096") == 4096
    # Which version goes first alternates from round to round.
    assert [bench_ab.order_of(r) for r in range(3)] == [
        ["current", "baseline"],
        ["baseline", "current"],
        ["current", "baseline"],
    ]


def test_the_verdict_is_noise_unless_the_rounds_say_otherwise() -> None:
    # The sign test, two-sided: 6 of 6 rounds one way is p = 2/64; 5 of 6 is 14/64.
    assert bench_ab.sign_test(6, 6) == pytest.approx(2 / 64)
    assert bench_ab.sign_test(0, 6) == pytest.approx(2 / 64)
    assert bench_ab.sign_test(5, 6) == pytest.approx(14 / 64)
    assert bench_ab.sign_test(3, 6) == 1.0
    assert bench_ab.sign_test(0, 0) == 1.0
    assert [bench_ab.verdict(w, 6) for w in (6, 0, 5, 3)] == ["faster", "slower", "noise", "noise"]
    assert bench_ab.verdict(5, 5) == "noise"  # 5 rounds cannot tell at the 5% level


def test_an_unknown_operation_is_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        bench_ab.main(["--baseline", "HEAD", "--ops", "restore-2to7"])


def test_baseline_extraction_holds_that_commits_package(tmp_path: Path) -> None:
    out = baseline.extract("HEAD", tmp_path / "code")
    assert (out / "ckptstore" / "__init__.py").is_file()
    assert not (out / "tests").exists()  # the package only


@pytest.mark.timeout(240)
def test_both_versions_restore_their_own_store_and_are_timed_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 2-rank save restored into one process, by this tree and by HEAD, each checked."""
    out = tmp_path / "ab.json"
    # The tool exits non-zero where a rank imported another version's ckptstore than the
    # one it was given, or a restore loaded other values than its version saved. Its main
    # runs here (it imports no torch itself): this tree's rank server is forked from the
    # test fork server (fork_tool_servers), HEAD's is a fresh interpreter importing HEAD's
    # ckptstore (launch.spawn_piped refuses another tree's).
    fork_tool_servers(monkeypatch)
    args = ["--baseline", "HEAD", "--size", "1MB", "--rounds", "1", "--ops", "restore-2to1"]
    assert bench_ab.main([*args, "--dir", str(tmp_path), "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["baseline"] == "HEAD"
    (row,) = doc["results"]
    assert row["op"] == "restore-2to1"
    assert row["rounds"] == 1
    for version in ("current", "baseline"):
        assert len(row["times"][version]) == 1
        assert all(t > 0 for t in row["times"][version])
        assert all(c > 0 for c in row["cpus"][version])
    assert row["speed_ratio"] == pytest.approx(row["baseline_s"] / row["current_s"])
    assert (row["sign_test_p"], row["verdict"]) == (1.0, "noise")  # one round tells nothing
    assert row["spread"] == {"current": 1.0, "baseline": 1.0}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("round ")]
    assert [ln.split()[3] for ln in lines] == ["current", "baseline"]
    assert list(tmp_path.glob("ckpt-ab-*")) == []  # its stores and the baseline's code removed

"""The Python snippets of README.md and docs/*.md run, so the docs cannot drift from the code.

Every ```python block of those files is a test: it runs as ``python snippet.py`` would, in
a temporary directory of its own, with a hard timeout, and must exit 0. Each process is
forked from the multi-rank tests' fork server (``tests/multirank/zygote.py``: torch and
ckptstore imported once, nothing run; the child takes the snippet's environment whole and
runs it as ``__main__``), or is a fresh interpreter with ``CKPTSTORE_TEST_FORK=0``. An
HTML comment on the line before a block changes how it runs:

- ``<!-- docs-test: ranks=N -->``: on N processes, each with ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set as torchrun sets them (no torchrun,
  no GPU: the snippet picks gloo on a CPU-only host).
- ``<!-- docs-test: s3 -->``: against moto's S3 server on loopback (``tests/s3server.py``):
  ``S3_ENDPOINT`` and the ``AWS_*`` credentials are set, and the bucket ``bucket`` exists.
- ``<!-- docs-test: continue -->``: in the directory of the block before it on the same page,
  after it (a page that builds a store, then inspects it).
- ``<!-- docs-test: skip REASON -->``: not run; :func:`test_skipped_snippets_are_few`
  reports each such block and bounds how many there are.

A block with no marker runs in one process. Blocks of other languages (``sh``, ``text``) are
not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multirank.launch import run_script

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
#: Seconds one snippet (all its ranks) may run before it is killed and fails.
TIMEOUT = 120.0
#: At most this many blocks may be marked skip (each needs a reason no test can remove).
MAX_SKIPS = 2

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Snippet:
    """One ```python block and how it runs."""

    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    ranks: int = 1
    s3: bool = False
    skip: str | None = None
    continues: bool = False

    @property
    def id(self) -> str:
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{self.line}"


def extract(page: Path) -> list[Snippet]:
    """The python blocks of ``page`` with their markers; a bad marker is an error."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Snippet] = []
    marker: str | None = None
    i = 0
    while i < len(lines):
        m = _MARKER.match(lines[i])
        if m:
            marker = m.group(1)
            i += 1
            continue
        f = _FENCE.match(lines[i])
        if f:
            lang, start = f.group(1), i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{page}:{start + 1}: unclosed code block")
            if lang == "python":
                out.append(_snippet(page, start + 1, "\n".join(body) + "\n", marker))
            elif marker is not None:
                raise AssertionError(f"{page}:{start + 1}: docs-test marker on a {lang!r} block")
            marker = None
        elif lines[i].strip() and marker is not None:
            raise AssertionError(f"{page}:{i + 1}: docs-test marker not before a code block")
        i += 1
    return out


def _snippet(page: Path, line: int, code: str, marker: str | None) -> Snippet:
    s = Snippet(page, line, code)
    if marker is None:
        return s
    if marker.startswith("skip"):
        s.skip = marker[4:].strip()
        if not s.skip:
            raise AssertionError(f"{s.id}: `docs-test: skip` needs a reason")
        return s
    for word in marker.split():
        if word.startswith("ranks="):
            s.ranks = int(word[6:])
        elif word == "s3":
            s.s3 = True
        elif word == "continue":
            s.continues = True
        else:
            raise AssertionError(f"{s.id}: unknown docs-test marker {word!r}")
    return s


def chains() -> list[list[Snippet]]:
    """Snippets grouped into runs: a ``continue`` block joins the chain before it."""
    out: list[list[Snippet]] = []
    for page in PAGES:
        if not page.exists():
            continue
        for s in extract(page):
            if s.continues:
                if not out or out[-1][0].page != page:
                    raise AssertionError(f"{s.id}: `continue` with no block before it")
                out[-1].append(s)
            else:
                out.append([s])
    return out


ALL = chains()
RUNNABLE = [c for c in ALL if c[0].skip is None]
SKIPPED = [s for c in ALL for s in c if s.skip is not None]


@contextlib.contextmanager
def _s3_env() -> Iterator[dict[str, str]]:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import s3server
    finally:
        sys.path.pop(0)
    with s3server.s3_server(bucket="bucket") as ep:
        yield {
            "S3_ENDPOINT": ep.endpoint,
            "AWS_ACCESS_KEY_ID": s3server.KEY,
            "AWS_SECRET_ACCESS_KEY": s3server.SECRET,
            "AWS_DEFAULT_REGION": s3server.REGION,
        }


def _run(s: Snippet, cwd: Path, extra_env: dict[str, str]) -> None:
    """Run one snippet on its ranks; fail with every rank's output if any exits non-zero."""
    script = cwd / f"snippet_{s.line}.py"
    script.write_text(s.code, encoding="utf-8")
    base = dict(os.environ)
    base.update(extra_env)
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    base["PYTHONPATH"] = os.pathsep.join([str(REPO), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    logs = [cwd / f"snippet_{s.line}.rank{rank}.log" for rank in range(s.ranks)]
    # Forked from the test server, which imported torch and ckptstore once (3-4 s of CPU a
    # process otherwise); the child takes the snippet's environment whole, its directory
    # and stdio, and runs it as __main__, as `python snippet.py` would.
    hung, codes = run_script(script, [], s.ranks, env=base, logs=logs, cwd=cwd, timeout=TIMEOUT)
    outputs = [
        (rc, log.read_bytes().decode(errors="replace")) for rc, log in zip(codes, logs, strict=True)
    ]
    if not hung and all(rc == 0 for rc, _ in outputs):
        return
    report = "\n".join(
        f"--- rank {r} (exit {rc}) ---\n{out[-4000:]}" for r, (rc, out) in enumerate(outputs)
    )
    what = f"hung past {TIMEOUT:.0f}s and was killed" if hung else "failed"
    pytest.fail(f"snippet {s.id} {what}\n{report}", pytrace=False)


@pytest.mark.timeout(TIMEOUT * 4)
@pytest.mark.parametrize("chain", RUNNABLE, ids=[c[0].id for c in RUNNABLE])
def test_snippet_runs(chain: list[Snippet], tmp_path: Path) -> None:
    """Each block (and the blocks that continue it) exits 0 in a fresh directory."""
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        if any(s.s3 for s in chain):
            env = stack.enter_context(_s3_env())
        for s in chain:
            _run(s, tmp_path, env)


def test_snippets_found() -> None:
    """The pages hold the snippets this file runs: a renamed page or fence is noticed."""
    pages = {c[0].page.name for c in ALL}
    assert {"README.md", "getting-started.md", "distributed.md", "tiers.md"} <= pages
    assert any(s.ranks > 1 for c in RUNNABLE for s in c), "no multi-rank snippet runs"
    assert any(s.s3 for c in RUNNABLE for s in c), "no S3 snippet runs"


def test_skipped_snippets_are_few() -> None:
    """Blocks that cannot run are marked with a reason, reported, and stay rare."""
    for s in SKIPPED:
        print(f"skipped snippet {s.id}: {s.skip}")
    total = sum(len(c) for c in ALL)
    print(f"{total} python snippets, {total - len(SKIPPED)} run, {len(SKIPPED)} skipped")
    assert len(SKIPPED) <= MAX_SKIPS, [f"{s.id}: {s.skip}" for s in SKIPPED]


def test_marker_errors_are_caught(tmp_path: Path) -> None:
    """A misspelt marker, or one that precedes no block, fails instead of being ignored."""
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: rank=2 -->\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="unknown docs-test marker 'rank=2'"):
        extract(page)
    page.write_text("<!-- docs-test: s3 -->\ntext\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="not before a code block"):
        extract(page)
    page.write_text("<!-- docs-test: skip -->\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="needs a reason"):
        extract(page)
    page.write_text("<!-- docs-test: ranks=2 s3 -->\n```python\nx = 1\n```\n")
    (s,) = extract(page)
    assert (s.ranks, s.s3, s.code) == (2, True, "x = 1\n")


def test_a_failing_snippet_fails(tmp_path: Path) -> None:
    """The runner reports a snippet that raises, on any rank, with that rank's output."""
    bad = Snippet(tmp_path / "p.md", 7, "import os\nassert os.environ['RANK'] != '1', 'boom'\n")
    bad.ranks = 2
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rank 1 \(exit 1\).*boom"):
        _run(bad, tmp_path, {})


_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives the headings of ``page`` (lower case, punctuation dropped)."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title)
            out.add("#" + re.sub(r"\s+", "-", title.strip()))
    return out


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_links_of_pages_outside_docs(name: str) -> None:
    """README and CONTRIBUTING (which mkdocs does not check) link only to what exists."""
    page = REPO / name
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"(?s)```.*?```", "", text)
    bad = []
    for m in _LINK.finditer(text):
        target, anchor = m.group(1), m.group(2)
        if re.match(r"^[a-z]+:", target):
            continue
        path = (page.parent / target).resolve()
        if not path.exists():
            bad.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(target + anchor)
    assert not bad, f"{name}: broken links {bad}"


def _site_copy(dst: Path) -> Path:
    """A copy of what `make docs` builds from: mkdocs.yml, the hook, the root pages, docs/."""
    shutil.copytree(REPO / "docs", dst / "docs")
    (dst / "tools").mkdir()
    shutil.copy(REPO / "tools" / "mkdocs_hooks.py", dst / "tools")
    for name in ("mkdocs.yml", "README.md", "CONTRIBUTING.md"):
        shutil.copy(REPO / name, dst)
    return dst / "mkdocs.yml"


def _mkdocs(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def test_docs_build(tmp_path: Path) -> None:
    """The docs as they are build cleanly under --strict, README and CONTRIBUTING included."""
    pytest.importorskip("mkdocs")
    good = _mkdocs(_site_copy(tmp_path))
    assert good.returncode == 0, good.stdout + good.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "contributing" / "index.html").exists()
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert 'href="distributed/#the-fsdp2-demo"' in home  # README's docs/ links, rewritten


@pytest.mark.parametrize(
    ("page", "line", "says"),
    [
        ("docs/cli.md", "See [the format](formats.md).", "'formats.md', but the target"),
        ("docs/cli.md", "See [blocks](format.md#no-such-part).", "anchor '#no-such-part'"),
        ("README.md", "See [tiers](docs/tier.md).", "'tier.md', but the target"),
        ("CONTRIBUTING.md", "See [design](docs/design.md#nope).", "anchor '#nope'"),
    ],
)
def test_docs_build_fails_on_a_broken_link(tmp_path: Path, page: str, line: str, says: str) -> None:
    """`make docs` (mkdocs --strict) builds the docs, and fails on any broken link or anchor."""
    pytest.importorskip("mkdocs")
    config = _site_copy(tmp_path)
    with open(tmp_path / page, "a", encoding="utf-8") as f:
        f.write(f"\n{line}\n")
    bad = _mkdocs(config)
    assert bad.returncode == 1, bad.stderr
    out = bad.stdout + bad.stderr
    assert says in out
    assert "Aborted with 1 warnings in strict mode" in out


def test_docs_build_fails_on_a_page_left_out(tmp_path: Path) -> None:
    """A page in docs/ that the nav does not list fails the build too."""
    pytest.importorskip("mkdocs")
    config = _site_copy(tmp_path)
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    bad = _mkdocs(config)
    assert bad.returncode == 1
    assert "orphan.md" in bad.stdout + bad.stderr


_PATH_REF = re.compile(r"`([\w./-]+\.(?:py|json)|(?:ckptstore|tests|tools|benchmarks)/[\w./-]*)`")
_DOTTED_REF = re.compile(r"`(ckptstore(?:\.\w+)+)")
_SEARCHED = ("ckptstore", "tests", "tools", "benchmarks")
#: Files the docs name that a command writes, not files of the repository.
_OUTPUTS = {
    "bench-out/bench.json",
    "model.safetensors.index.json",
    "config.json",
    "_index.rankNNNNN.json",  # a rank's part of a DTensor step's chunk index (format 3)
}


def _path_exists(ref: str) -> bool:
    """A path the docs name: from the repository's root, from ckptstore/, or a file's name."""
    if ref in _OUTPUTS or (REPO / ref).exists() or (REPO / "ckptstore" / ref).exists():
        return True
    if "/" in ref:
        return False
    return any(next((REPO / d).rglob(ref), None) is not None for d in _SEARCHED)


def _resolves(dotted: str) -> bool:
    """``ckptstore.a.b.c``: the longest importable module, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_code_the_docs_name_exists() -> None:
    """Every module, file and ``ckptstore.`` name the docs mention exists: a move is noticed."""
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for ref in sorted(set(_PATH_REF.findall(text))):
            if not _path_exists(ref):
                missing.append(f"{page.name}: {ref}")
        for ref in sorted(set(_DOTTED_REF.findall(text))):
            if not _resolves(ref):
                missing.append(f"{page.name}: {ref}")
    assert not missing, missing

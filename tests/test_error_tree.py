"""One error tree (issue 22 #11): every error ckptstore raises on purpose is a CkptStoreError.

``test_no_bare_builtin_raise`` walks every ``raise`` of the package: one that raises a
builtin exception class (``ValueError(...)``, ``OSError``...) must be on the small
allowlist below, each entry with the reason it is not a refusal the user sees. The
behaviour tests check that ``except CkptStoreError`` catches the refusals the docs name,
that the builtin bases stay (``except ValueError`` keeps working) and that messages did
not change.
"""

from __future__ import annotations

import ast
import builtins
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptstore
from ckptstore import CheckpointManager, KeepBest, KeepLast
from ckptstore.errors import (
    CkptStoreError,
    ClosedError,
    ConfigError,
    ConfigTypeError,
    MissingDependencyError,
    PathExistsError,
    PathNotFoundError,
    UsageError,
)

PACKAGE = Path(ckptstore.__file__).resolve().parent

#: (file under ckptstore/, enclosing function, builtin raised) -> why it is no refusal.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("__init__.py", "__getattr__", "AttributeError"): "module __getattr__ protocol",
    ("codec/safetensors.py", "__getattr__", "AttributeError"): "module __getattr__ protocol",
    ("codec/safetensors.py", "tensor_bytes", "ValueError"): "internal precondition (a bug)",
    ("codec/safetensors.py", "parse_header", "ValueError"): "internal precondition (a bug)",
    ("codec/safetensors.py", "encode_header", "ValueError"): (
        "internal: the encoder and export check dtypes first and raise their own errors"
    ),
    ("codec/safetensors.py", "_no_dups", "ValueError"): (
        "JSON object_pairs_hook; the header parser turns it into IntegrityError"
    ),
    ("codec/strictjson.py", "_refuse", "ValueError"): (
        "JSON parse_constant hook; each reader turns it into its own error ('not valid JSON')"
    ),
    ("codec/torchzip.py", "_first_bad", "OSError"): (
        "what testzip's seek raises there; its caller turns it into IntegrityError"
    ),
    ("codec/zipcheck.py", "__call__", "ValueError"): "internal precondition: feed in order",
    ("codec/zipstream.py", "seek", "OSError"): "the file protocol zipfile reads through",
    ("codec/zipstream.py", "readinto", "OSError"): (
        "the file protocol zipfile reads through; a read past what was parsed: not streamable"
    ),
    ("codec/zipstream.py", "__call__", "ValueError"): "internal precondition: feed in order",
    ("cli/replicate.py", "handler", "KeyboardInterrupt"): (
        "a second SIGINT/SIGTERM to `replicate --watch`: the interrupt Python itself raises"
    ),
    ("dist.py", "scatter", "ValueError"): "internal precondition (a bug), before any wait",
    ("dist.py", "_new_group", "TimeoutError"): (
        "internal: Coordinator.__init__ turns it into BarrierTimeout naming the missing ranks"
    ),
    ("integrity.py", "parse_crc", "ValueError"): "parse helper; callers raise ManifestError",
    ("integrity.py", "check_blocks", "ValueError"): "internal precondition (a bug)",
    ("integrity.py", "write", "OSError"): "an I/O failure (EIO short write); saves wrap it",
    ("ops/verify.py", "_dtensor_nodes", "RecursionError"): "caught by its caller",
    ("restore/partial.py", "read_some", "ValueError"): "internal: callers check first",
    ("sharded/chunks.py", "dtype_name", "KeyError"): "lookup; callers raise their own error",
    ("sharded/plan.py", "writes_here", "ValueError"): "internal: splittable() checked first",
    ("sharded/split_index.py", "global_bytes", "ValueError"): (
        "internal: splittable() checked first"
    ),
    ("manifest.py", "from_cache", "ValueError"): "a malformed cache row: the listing reads again",
    ("ranktable.py", "__getitem__", "KeyError"): "the Mapping protocol (a name not listed)",
    ("ranktable.py", "encode", "ValueError"): "internal precondition (a bug)",
    ("storage/base.py", "_rename", "NotImplementedError"): "abstract storage method",
    ("storage/base.py", "_exchange", "NotImplementedError"): "capability probe, caught",
    ("storage/base.py", "prepare", "ValueError"): "internal precondition (a bug)",
    ("storage/directio.py", "_pwrite_all", "OSError"): "an I/O failure (EIO short write)",
    ("storage/local.py", "_exchange", "NotImplementedError"): "capability probe, caught",
    ("storage/local.py", "_exchange", "OSError"): "the OS's errno, passed on",
    ("storage/local.py", "_create", "OSError"): "an I/O failure (EIO short write)",
    ("storage/local.py", "_open_read", "OSError"): (
        "I/O level: a store file that is not a regular file reads as unreadable"
    ),
    ("storage/local.py", "_stream", "OSError"): (
        "I/O level: a store file that is not a regular file reads as unreadable"
    ),
    ("storage/local.py", "_load_index", "ValueError"): "caught in the same function",
    ("storage/remote.py", "_rmtree", "FileNotFoundError"): "storage contract, caught",
    ("storage/remote.py", "_stream", "OSError"): "an I/O failure (short ranged GET)",
    ("storage/remote.py", "call", "OSError"): "an I/O failure of the backend (its cause)",
    ("storage/s3upload.py", "expect", "ValueError"): "internal precondition (a bug)",
    ("storage/s3upload.py", "write", "ValueError"): "internal precondition (a bug)",
    ("storage/s3upload.py", "_send", "OSError"): "an upload failure; saves wrap it",
}


def _raise_sites(root: Path = PACKAGE) -> dict[tuple[str, str, str], list[int]]:
    """Every ``raise <builtin exception>`` under ``root``: (file, function, name) -> lines."""
    found: dict[tuple[str, str, str], list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def visit(node: ast.AST, func: str, rel: str = rel) -> None:
            for child in ast.iter_child_nodes(node):
                name = func
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = child.name
                if isinstance(child, ast.Raise) and child.exc is not None:
                    exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                    cls = getattr(builtins, exc.id, None) if isinstance(exc, ast.Name) else None
                    if isinstance(cls, type) and issubclass(cls, BaseException):
                        found.setdefault((rel, name, exc.id), []).append(child.lineno)
                visit(child, name)

        visit(tree, "<module>")
    return found


def test_no_bare_builtin_raise() -> None:
    sites = _raise_sites()
    bare = sorted(
        f"ckptstore/{f}:{lines} in {fn}(): raise {exc}"
        for (f, fn, exc), lines in sites.items()
        if (f, fn, exc) not in ALLOWED
    )
    assert not bare, (
        "deliberate errors must be CkptStoreError subclasses (ckptstore.errors); an "
        "internal-only one goes on ALLOWED with its reason:\n" + "\n".join(bare)
    )
    stale = sorted(str(k) for k in ALLOWED if k not in sites)
    assert not stale, f"ALLOWED entries that match no raise any more: {stale}"


def test_the_walk_finds_every_kind_of_bare_raise(tmp_path: Path) -> None:
    # The walker itself: a call, a bare class, nested functions; not a CkptStoreError.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.py").write_text(
        "from ckptstore.errors import ConfigError\n"
        "class A:\n"
        "    def f(self):\n"
        "        msg = 'x'\n"
        "        raise ValueError(msg)\n"
        "    def g(self):\n"
        "        def inner():\n"
        "            raise OSError\n"
        "        raise ConfigError('fine')\n"
    )
    assert _raise_sites(tmp_path) == {
        ("sub/m.py", "f", "ValueError"): [5],
        ("sub/m.py", "inner", "OSError"): [8],
    }


# ---- the documented refusals are CkptStoreErrors, with their builtin bases --------------


def test_save_of_an_older_step_is_a_ckptstore_error(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(5, {"x": torch.zeros(2)})
        with pytest.raises(CkptStoreError) as ei:
            mgr.save(3, {"x": torch.zeros(2)})
        assert mgr.steps() == [5]
    assert type(ei.value) is UsageError
    assert isinstance(ei.value, ValueError)  # compatibility
    assert str(ei.value).startswith("refusing to save step 3 in ")
    assert "allow_older=True" in str(ei.value)


def test_keepbest_without_its_metric_is_a_ckptstore_error(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s", keep=KeepBest(1, "val_loss")) as mgr:
        with pytest.raises(CkptStoreError) as ei:
            mgr.save(1, {"x": torch.zeros(2)}, metrics={"loss": 1.0})
        assert mgr.steps() == []
    assert type(ei.value) is UsageError
    assert isinstance(ei.value, ValueError)
    assert "'val_loss'" in str(ei.value)


def test_prune_with_a_metric_no_checkpoint_has_is_a_ckptstore_error(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"x": torch.zeros(2)}, metrics={"loss": 1.0})
        mgr.save(2, {"x": torch.zeros(2)}, metrics={"loss": 0.5})
    with pytest.raises(CkptStoreError) as ei:
        ckptstore.prune_store(tmp_path / "s", KeepBest(1, "val_loss"))
    assert isinstance(ei.value, ValueError)
    assert "val_loss" in str(ei.value)
    with CheckpointManager(tmp_path / "s") as mgr:
        assert mgr.steps() == [1, 2]  # nothing deleted


@pytest.mark.parametrize(
    ("make", "cls", "base", "text"),
    [
        (lambda p: CheckpointManager(p, format="npz"), ConfigError, ValueError, "format must be"),
        (lambda p: CheckpointManager(p, compression="lz4"), ConfigError, ValueError, "compression"),
        (lambda p: CheckpointManager(p, keep=0), ConfigError, ValueError, "KeepLast(n)"),
        (lambda p: CheckpointManager(p, barrier_timeout=-1), ConfigError, ValueError, "barrier"),
        (lambda p: KeepLast(0), ConfigError, ValueError, "KeepLast(n) must be a positive int"),
        (lambda p: KeepBest(1, "m", mode="up"), ConfigError, ValueError, "KeepBest(mode)"),
        (lambda p: ckptstore.EMA(object()), ConfigTypeError, TypeError, "EMA(ema=...)"),
        (
            lambda p: CheckpointManager(p, storage_options={"x": 1}),
            ConfigError,
            ValueError,
            "fsspec",
        ),
    ],
)
def test_bad_options_are_config_errors(tmp_path: Path, make, cls, base, text) -> None:
    with pytest.raises(CkptStoreError) as ei:
        make(tmp_path / "s")
    assert type(ei.value) is cls
    assert isinstance(ei.value, base)
    assert text in str(ei.value)


def test_bad_save_arguments_are_ckptstore_errors(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        for bad, cls in [
            (lambda: mgr.save(-1, {}), ConfigError),
            (lambda: mgr.save(1, [1, 2]), ConfigTypeError),
            (lambda: mgr.save(1, {"x": 1}, metrics={"m": "high"}), ConfigError),
            (lambda: mgr.save(1, {"x": 1}, metadata={"f": float("nan")}), ConfigError),
            (lambda: mgr.load(keys="model"), ConfigTypeError),
        ]:
            with pytest.raises(CkptStoreError) as ei:
                bad()
            assert type(ei.value) is cls, ei.value
        assert mgr.steps() == []


def test_a_closed_manager_is_a_ckptstore_error(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "s")
    mgr.close()
    with pytest.raises(CkptStoreError) as ei:
        mgr.save(1, {"x": torch.zeros(1)})
    assert type(ei.value) is ClosedError
    assert isinstance(ei.value, RuntimeError)
    assert str(ei.value) == "this CheckpointManager is closed"


def test_export_over_an_existing_file_is_a_ckptstore_error(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": model})
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(CkptStoreError) as ei:
        ckptstore.export_step(tmp_path / "s", 1, out)
    assert type(ei.value) is PathExistsError
    assert isinstance(ei.value, FileExistsError)
    assert str(ei.value) == f"{out}: already exists; pass --force to overwrite it"
    assert ei.value.filename == str(out)
    assert out.read_bytes() == b"keep me"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("x")
    with pytest.raises(PathExistsError, match="exists and is not empty"):
        ckptstore.export_hf_step(tmp_path / "s", 1, tmp_path / "hf")
    with pytest.raises(PathNotFoundError, match="no such directory"):
        ckptstore.export_hf_step(tmp_path / "s", 1, tmp_path / "no" / "hf")
    with pytest.raises(PathNotFoundError, match="no such file") as nf:
        ckptstore.import_file(tmp_path / "absent.pt", tmp_path / "s2", step=1)
    assert isinstance(nf.value, FileNotFoundError)


def test_new_classes_pickle_with_their_attributes() -> None:
    e = PathExistsError("/x: already exists", path="/x")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is PathExistsError
    assert str(back) == "/x: already exists"
    assert back.path == "/x"
    m = MissingDependencyError("pip install ckptstore[hf]")
    assert isinstance(pickle.loads(pickle.dumps(m)), ImportError)

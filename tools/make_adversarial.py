"""Build tests/adversarial/: a corpus of broken and hostile stores, one directory per case.

    python tools/make_adversarial.py [--out tests/adversarial]

Every case is a store (``ckptstore verify tests/adversarial/CASE`` runs on it) that usually
holds a good step 1 and a broken or hostile step 2, built from deterministic tiny states, so
the corpus is reproducible byte for byte (``.pt`` files: as far as ``torch.save`` is). Where
the damage would be caught by a checksum, the manifest is forged to match the damaged file
(as an attacker would), so that the check meant for that damage is the one that fires.

``outside/`` stands for everything outside a store: symlinks in the cases point into it with
relative paths (``../../outside/...``), and what they point at is valid (a correct payload, a
correct manifest, a whole checkpoint), so following a link would *pass*. Tests check that
nothing there is ever opened. ``index.json`` lists every case with its expected outcomes;
``README.md`` is the same as a table.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import os
import pickle
import shutil
import struct
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ckptstore import CheckpointManager  # noqa: E402
from ckptstore.integrity import crc32c_of, format_crc  # noqa: E402
from ckptstore.manifest import Manifest  # noqa: E402

STEP1 = "step-000000000001"
STEP2 = "step-000000000002"
SECRET = b"SECRET: ckptstore must never read this file\n"
#: The environment variable the hostile pickle would write to, if it ever ran.
SENTINEL_ENV = "CKPTSTORE_ADVERSARIAL_SENTINEL"


def state(step: int) -> dict[str, Any]:
    """A tiny deterministic state: every value is a function of ``step``."""
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(4, dtype=torch.float32).view(2, 2) + step)
        model.bias.copy_(torch.tensor([float(step), -float(step)]))
    return {"model": model, "step": step}


def _normalize(step_dir: Path) -> None:
    """Fixed creation time and versions, so the corpus does not change with the clock."""
    p = step_dir / "manifest.json"
    m = Manifest.from_bytes(p.read_bytes())
    m = dataclasses.replace(m, created="2026-01-01T00:00:00.000000Z", versions={"ckptstore": "1"})
    p.write_bytes(m.to_bytes())


def good_store(root: Path, steps: tuple[int, ...] = (1, 2), **kwargs: Any) -> None:
    with CheckpointManager(root, **kwargs) as mgr:
        for s in steps:
            mgr.save(s, state(s))
    (root / ".ckptstore.lock").unlink(missing_ok=True)
    for s in steps:
        _normalize(root / f"step-{s:012d}")


def forge(step_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest's JSON and recompute its self-checksum."""
    p = step_dir / "manifest.json"
    doc = json.loads(p.read_bytes())
    doc.pop("checksum")
    edit(doc)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    doc["checksum"] = format_crc(crc32c_of(canonical.encode()))
    p.write_bytes((json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


def retable(step_dir: Path, name: str) -> None:
    """Make the manifest agree with ``name`` as it now is (size and checksum)."""
    data = (step_dir / name).read_bytes()

    def edit(doc: dict[str, Any]) -> None:
        doc["files"][name].update(bytes=len(data), crc32c=format_crc(crc32c_of(data)))

    forge(step_dir, edit)


def replace_payload(step_dir: Path, name: str, data: bytes) -> None:
    (step_dir / name).write_bytes(data)
    retable(step_dir, name)


def _safetensors_with(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


class _Exec:
    """Unpickles into a call of ``exec``: what a hostile ``.pt`` carries."""

    def __reduce__(self) -> tuple[Any, ...]:
        code = (
            "import os\n"
            f"p = os.environ.get({SENTINEL_ENV!r})\n"
            "if p:\n"
            "    open(p, 'w').write('the pickle ran')\n"
        )
        return (exec, (code,))


def _pt_with_pickle(good: bytes, pickled: bytes) -> bytes:
    """A torch.save zip whose data.pkl is replaced by ``pickled``."""
    src = zipfile.ZipFile(io.BytesIO(good))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pickled if info.filename.endswith("/data.pkl") else src.read(info)
            zi = zipfile.ZipInfo(info.filename, date_time=(2026, 1, 1, 0, 0, 0))
            dst.writestr(zi, data)
    return out.getvalue()


def _zip_without_pickle() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr(zipfile.ZipInfo("archive/notes.txt", date_time=(2026, 1, 1, 0, 0, 0)), "hi")
    return out.getvalue()


# ---- the cases -----------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One broken store and what every reader must make of it.

    ``verify``: exit status of ``ckptstore verify CASE`` and a phrase of its output.
    ``restore``: the outcome of ``restore()``/``load()`` of the newest: ``{"step": N}`` (it
    falls back to a good step) or ``{"error": class name, "says": phrase}``.
    ``restore_step``: the same for ``restore(step=2)``, where the case has a step 2.
    """

    name: str
    what: str
    build: Callable[[Path, Path], None]
    verify: tuple[int, str]
    restore: dict[str, Any]
    restore_step: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "what": self.what,
            "verify": {"exit": self.verify[0], "says": self.verify[1]},
            "restore": self.restore,
            "restore_step2": self.restore_step,
        }


def _err(cls: str, says: str) -> dict[str, Any]:
    return {"error": cls, "says": says}


FALLBACK = {"step": 1}
CASES: list[Case] = []


def case(
    name: str,
    what: str,
    verify: tuple[int, str],
    restore: dict[str, Any],
    restore_step: dict[str, Any] | None = None,
) -> Callable[[Callable[[Path, Path], None]], Callable[[Path, Path], None]]:
    def register(fn: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
        CASES.append(Case(name, what, fn, verify, restore, restore_step))
        return fn

    return register


def _rename_entry(old: str, new: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["files"][new] = doc["files"].pop(old)

    return edit


# -- manifests --


@case(
    "manifest-path-traversal",
    "a file name in the manifest climbs out of the store (../../outside/secret)",
    (1, "unsafe file name"),
    FALLBACK,
    _err("ManifestError", "unsafe file name"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    forge(root / STEP2, _rename_entry("model.safetensors", "../../outside/secret"))


@case(
    "manifest-absolute-path",
    "a file name in the manifest is an absolute path (/etc/passwd)",
    (1, "unsafe file name"),
    FALLBACK,
    _err("ManifestError", "unsafe file name"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    forge(root / STEP2, _rename_entry("model.safetensors", "/etc/passwd"))


@case(
    "manifest-hidden-name",
    "a file name in the manifest names the store's lock file (.ckptstore.lock)",
    (1, "unsafe file name"),
    FALLBACK,
    _err("ManifestError", "unsafe file name"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    forge(root / STEP2, _rename_entry("model.safetensors", ".ckptstore.lock"))


@case(
    "manifest-symlink",
    "manifest.json is a symlink to a valid manifest outside the store",
    (1, "missing or not a regular file"),
    FALLBACK,
    _err("ManifestError", "not a regular file"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    (root / STEP2 / "manifest.json").unlink()
    os.symlink("../../outside/manifest.json", root / STEP2 / "manifest.json")


@case(
    "manifest-wrong-types",
    'the manifest says "step": "2" (a string)',
    (1, "'step' must be an integer"),
    FALLBACK,
    _err("ManifestError", "'step' must be an integer"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    forge(root / STEP2, lambda d: d.update(step="2"))


@case(
    "manifest-files-not-an-object",
    'the manifest\'s "files" is a list',
    (1, "'files' must be an object"),
    FALLBACK,
    _err("ManifestError", "'files' must be an object"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    forge(root / STEP2, lambda d: d.update(files=[]))


@case(
    "manifest-size-out-of-range",
    "a file claims 2**60 bytes, beyond any real file",
    (1, "'bytes' must be an integer in [0, 2**50]"),
    FALLBACK,
    _err("ManifestError", "'bytes' must be an integer"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    forge(root / STEP2, lambda d: d["files"]["state.json"].update(bytes=2**60))


@case(
    "manifest-huge-size",
    "state.json claims 2**49 bytes (512 TiB): must be refused unread, not allocated",
    (1, "truncated or replaced"),
    FALLBACK,
    _err("IntegrityError", "562949953421312 bytes of JSON, more than a save writes"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    forge(root / STEP2, lambda d: d["files"]["state.json"].update(bytes=2**49))


@case(
    "manifest-duplicate-names",
    "the file table names model.safetensors twice (duplicate JSON keys)",
    (1, "duplicate key 'model.safetensors'"),
    FALLBACK,
    _err("ManifestError", "duplicate key"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "manifest.json"
    text = p.read_text()
    start = text.index(' "model.safetensors": {')
    end = text.index("}", start) + 1
    p.write_text(text[:end] + ",\n " + text[start:end].lstrip() + text[end:])


@case(
    "manifest-deep-nesting",
    "the manifest's metadata is nested 5000 levels deep",
    (1, "nested too deeply"),
    FALLBACK,
    _err("ManifestError", "nested too deeply"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "manifest.json"
    text = p.read_text()
    p.write_text(text.replace('"metadata": {}', '"metadata": ' + "[" * 5000 + "]" * 5000))


@case(
    "manifest-newer-format",
    "the manifest is format version 99, from a newer ckptstore",
    (1, "Upgrade ckptstore"),
    FALLBACK,
    _err("ManifestError", "newer ckptstore"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    forge(root / STEP2, lambda d: d.update(format_version=99))


@case(
    "manifest-bad-checksum",
    "the manifest was edited (world_size 1 -> 2) without its self-checksum",
    (1, "self-checksum mismatch"),
    FALLBACK,
    _err("ManifestError", "self-checksum mismatch"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "manifest.json"
    p.write_bytes(p.read_bytes().replace(b'"world_size": 1', b'"world_size": 2'))


@case(
    "manifest-torn",
    "the manifest is cut in half (a torn write)",
    (1, "not valid JSON"),
    FALLBACK,
    _err("ManifestError", "torn or corrupt"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "manifest.json"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


@case(
    "manifest-empty",
    "manifest.json is empty",
    (1, "not valid JSON"),
    FALLBACK,
    _err("ManifestError", "not valid JSON"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    (root / STEP2 / "manifest.json").write_bytes(b"")


@case(
    "manifest-nan",
    "the manifest holds a NaN literal (JSON allows none)",
    (1, "non-finite number"),
    FALLBACK,
    _err("ManifestError", "non-finite number"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "manifest.json"
    p.write_bytes(p.read_bytes().replace(b'"world_size": 1', b'"world_size": NaN'))


@case(
    "manifest-wrong-step",
    "step 2's directory holds step 1's manifest",
    (1, "manifest says step 1, directory says 2"),
    FALLBACK,
    _err("ManifestError", "manifest says step 1"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    shutil.copy(root / STEP1 / "manifest.json", root / STEP2 / "manifest.json")


# -- payloads --


@case(
    "payload-truncated",
    "model.safetensors lost its last 10 bytes",
    (1, "truncated or replaced"),
    FALLBACK,
    _err("IntegrityError", "truncated or replaced"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-10])


@case(
    "payload-bit-flip",
    "one bit of tensor data in model.safetensors is flipped",
    (1, "does not match the manifest's"),
    FALLBACK,
    _err("IntegrityError", "the file is corrupt"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01
    p.write_bytes(bytes(data))


@case(
    "payload-swapped",
    "step 2's model.safetensors is step 1's (same size, other values)",
    (1, "does not match the manifest's"),
    FALLBACK,
    _err("IntegrityError", "the file is corrupt"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    shutil.copy(root / STEP1 / "model.safetensors", root / STEP2 / "model.safetensors")


@case(
    "payload-symlink",
    "model.safetensors is a symlink to the right bytes outside the store",
    (1, "missing or not a regular file"),
    FALLBACK,
    _err("IntegrityError", "not a regular file"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    (root / STEP2 / "model.safetensors").unlink()
    os.symlink("../../outside/model.safetensors", root / STEP2 / "model.safetensors")


@case(
    "payload-symlink-to-secret",
    "state.json is a symlink to a secret outside the store",
    (1, "missing or not a regular file"),
    FALLBACK,
    _err("IntegrityError", "not a regular file"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    (root / STEP2 / "state.json").unlink()
    os.symlink("../../outside/secret", root / STEP2 / "state.json")


@case(
    "payload-missing",
    "model.safetensors is gone",
    (1, "missing or not a regular file"),
    FALLBACK,
    _err("IntegrityError", "missing or not a regular file"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    (root / STEP2 / "model.safetensors").unlink()


@case(
    "state-json-not-json",
    "state.json is not JSON (the manifest forged to match it)",
    (1, "not valid JSON"),
    FALLBACK,
    _err("IntegrityError", "not valid JSON"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    replace_payload(root / STEP2, "state.json", b"{'step': 2")


@case(
    "state-json-deep-nesting",
    "state.json is nested 5000 levels deep (forged to match)",
    (1, "not valid JSON"),
    FALLBACK,
    _err("IntegrityError", "not valid JSON"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    replace_payload(root / STEP2, "state.json", b"[" * 5000 + b"]" * 5000)


@case(
    "state-json-pickle",
    "state.json holds a pickled object (forged to match); pickles need allow_pickle=True",
    (0, "OK"),
    _err("UnsafeCheckpointError", "holds a pickled object"),
    _err("UnsafeCheckpointError", "allow_pickle=True"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "state.json"
    tree = json.loads(p.read_bytes())
    blob = pickle.dumps(_Exec(), protocol=2)
    tree["root"]["vals"][1] = {"t": "pickle", "b64": base64.b64encode(blob).decode()}
    replace_payload(root / STEP2, "state.json", json.dumps(tree).encode())


# -- safetensors headers (each forged to match its checksum) --


@case(
    "safetensors-overlap",
    "two tensors of model.safetensors share bytes (overlapping offsets)",
    (1, "overlaps the tensor before it"),
    FALLBACK,
    _err("IntegrityError", "overlaps"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    header = {
        "bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "weight": {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]},
    }
    replace_payload(root / STEP2, "model.safetensors", _safetensors_with(header, bytes(20)))


@case(
    "safetensors-past-end",
    "a tensor of model.safetensors runs past the end of the file",
    (1, "runs past the file"),
    FALLBACK,
    _err("IntegrityError", "runs past the file"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    header = {
        "bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]},
    }
    replace_payload(root / STEP2, "model.safetensors", _safetensors_with(header, bytes(12)))


@case(
    "safetensors-header-length",
    "the 8-byte header length of model.safetensors claims 2**40 bytes",
    (1, "runs past the file"),
    FALLBACK,
    _err("IntegrityError", "runs past the file"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root)
    p = root / STEP2 / "model.safetensors"
    replace_payload(
        root / STEP2, "model.safetensors", struct.pack("<Q", 2**40) + p.read_bytes()[8:]
    )


# -- torch payloads --


@case(
    "pt-pickle-runs-code",
    "model.pt's pickle calls exec() (forged to match); verify never unpickles, so it "
    "passes; restore refuses it and never falls back to weights_only=False",
    (0, "OK"),
    _err("UnsafeCheckpointError", "never falls back to weights_only=False"),
    _err("UnsafeCheckpointError", "refused to load"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root, format="torch")
    p = root / STEP2 / "model.pt"
    replace_payload(
        root / STEP2, "model.pt", _pt_with_pickle(p.read_bytes(), pickle.dumps(_Exec(), protocol=2))
    )


@case(
    "pt-truncated",
    "model.pt lost its zip central directory (forged to match)",
    (1, "no valid zip central directory"),
    FALLBACK,
    _err("IntegrityError", "central directory"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root, format="torch")
    p = root / STEP2 / "model.pt"
    replace_payload(root / STEP2, "model.pt", p.read_bytes()[:-60])


@case(
    "pt-not-torch",
    "model.pt is a zip, but not a torch.save archive (forged to match)",
    (1, "not a torch.save file"),
    FALLBACK,
    _err("IntegrityError", "not a torch.save file"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root, format="torch")
    replace_payload(root / STEP2, "model.pt", _zip_without_pickle())


@case(
    "zstd-truncated",
    "model.safetensors.zst ends mid-frame (forged to match)",
    (1, "zstd stream is truncated"),
    FALLBACK,
    _err("IntegrityError", "zstd stream is truncated"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root, compression="zstd")
    p = root / STEP2 / "model.safetensors.zst"
    replace_payload(root / STEP2, "model.safetensors.zst", p.read_bytes()[:-6])


# -- whole stores --


@case(
    "step-dir-symlink",
    "step-000000000002 is a symlink to a whole valid checkpoint outside the store",
    (1, "unreadable"),
    FALLBACK,
    _err("ManifestError", "unreadable"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root, steps=(1,))
    os.symlink("../outside/ckpt-step2", root / STEP2)


@case(
    "not-a-store",
    "a directory of other things: a README, a file named like a step, a step-1 directory",
    (1, "no committed checkpoint"),
    _err("NoCheckpointError", "no committed checkpoint"),
)
def _(root: Path, outside: Path) -> None:
    root.mkdir()
    (root / "README.txt").write_text("not a checkpoint store\n")
    (root / STEP1).write_bytes(b"a file, not a directory\n")
    (root / "step-1").mkdir()
    (root / "step-1" / "manifest.json").write_text("{}\n")


@case(
    "garbage-only",
    "only a crashed save (.tmp-) and a half-deleted checkpoint (.trash-)",
    (1, "no committed checkpoint"),
    _err("NoCheckpointError", "no committed checkpoint"),
)
def _(root: Path, outside: Path) -> None:
    good_store(root, steps=(1, 2))
    os.rename(root / STEP1, root / (".trash-step-000000000001-" + "0" * 32))
    os.rename(root / STEP2, root / (".tmp-step-000000000002-" + "1" * 32))


def build_outside(outside: Path, scratch: Path) -> None:
    """Valid things outside every store: following a link to them would pass the checks."""
    outside.mkdir(parents=True)
    (outside / "secret").write_bytes(SECRET)
    good_store(scratch / "ref")
    shutil.copy(scratch / "ref" / STEP2 / "model.safetensors", outside / "model.safetensors")
    shutil.copy(scratch / "ref" / STEP2 / "manifest.json", outside / "manifest.json")
    shutil.copytree(scratch / "ref" / STEP2, outside / "ckpt-step2")


def _outcome(d: dict[str, Any] | None) -> str:
    if d is None:
        return "-"
    if "step" in d:
        return f"step {d['step']}"
    return f"{d['error']}: \u201c{d['says']}\u201d"


def write_index(out: Path) -> None:
    (out / "index.json").write_text(
        json.dumps({"cases": [c.to_json() for c in CASES]}, indent=1) + "\n"
    )
    lines = [
        "# Adversarial corpus",
        "",
        "Broken and hostile stores, made by `tools/make_adversarial.py` (run it to rebuild",
        "this directory); `tests/test_adversarial.py` checks every outcome below. Each case is",
        "a store: `ckptstore verify tests/adversarial/CASE` checks its newest step. Unless",
        "said otherwise, step 1 is good and step 2 is broken; where a checksum would catch the",
        "damage, the manifest is forged to match, so the check meant for it is the one that",
        "fires. `outside/` is what lies outside every store: links point there, at valid",
        "bytes, and nothing may ever open it.",
        "",
        "| case | what | `ckptstore verify` | restore / load newest | restore step 2 |",
        "|---|---|---|---|---|",
    ]
    for c in CASES:
        v = f"exit {c.verify[0]}: \u201c{c.verify[1]}\u201d"
        lines.append(
            f"| `{c.name}` | {c.what} | {v} | {_outcome(c.restore)} | {_outcome(c.restore_step)} |"
        )
    (out / "README.md").write_text("\n".join(lines) + "\n")


def build(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        build_outside(out / "outside", Path(scratch))
    for c in CASES:
        c.build(out / c.name, out / "outside")
    write_index(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", type=Path, default=REPO / "tests" / "adversarial")
    args = p.parse_args(argv)
    build(args.out)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"{len(CASES)} cases in {args.out} ({total / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

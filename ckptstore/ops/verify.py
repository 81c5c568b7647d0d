"""Verification of checkpoints and of lone files; nothing here unpickles anything.

Quick: the manifest (self-checksum, names, types), presence and sizes of every file, the
safetensors header (bounds, overlaps) and the zip central directory of ``.pt`` files (no
member may be compressed); for a DTensor checkpoint also its chunk index (``dtensors.json``,
validated as hostile input) and that every sharded tensor of ``state.json`` is in it. Deep:
also the CRC32C of every file and the CRC-32 of every zip member; compressed payloads are
inflated (never past what their tensors in the state file can take, nor past what a
safetensors header declares) and checked the same way; for DTensor shard files the CRC32C of
every block of every chunk, computed in the same single read of the file as its CRC32C; and
every state file walked as a restore decodes it, each tensor it references held against its
payload's header (``codec/treecheck.py``): a step that verifies is one that restores.

A file inside a step directory is checked against the manifest beside it (its size and
CRC32C, then its structure); a lone file on its own structure. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import zipfile
from collections.abc import Collection, Mapping
from typing import Any

from .._progress import Progress
from ..codec import payload, strictjson, torchzip, treecheck
from ..codec import safetensors as st
from ..codec.payload import stored_tensors
from ..errors import (
    CkptStoreError,
    ConfigError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    StoreUnreachableError,
)
from ..integrity import VerifyReport, crc32c_of, format_crc
from ..layout import LOCAL_RANKS_NAME, MANIFEST_NAME, STATE_NAME, parse_step_dirname, state_file
from ..manifest import RANK_TABLE_NAME, FileEntry, Manifest
from ..sharded import split_index
from ..sharded.chunks import INDEX_FILE, ChunkIndex
from ..storage.base import Storage, step_gone
from ..tiers import nodes

__all__ = [
    "looks_like_safetensors",
    "verify_checkpoint",
    "verify_file",
    "verify_path",
    "verify_stored_file",
    "verify_unless_deleted",
]

#: First bytes of a pre-1.6 ``torch.save`` file: pickle protocol 2, then its LONG1 magic.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a"


def _check_header(f: Any, size: int, codec: str, where: str, deep: bool) -> st.Header | None:
    """Check a payload's header (a zip's directory and, ``deep``, members); a safetensors one."""
    if codec == "safetensors":
        return st.read_header(f, size, where)
    if codec == "torch":
        f.seek(0)
        torchzip.check_zip(f, where, deep=deep)
    return None


_PAYLOADS = ("safetensors", "torch")


class _Limits:
    """How far each compressed payload of a checkpoint may inflate, from its state files."""

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage = storage
        self.manifest = manifest
        self._tensors: dict[str, dict[str, dict[str, tuple[int, int]]] | None] = {}

    def of(self, name: str, entry: FileEntry) -> int | None:
        """The bound of payload ``name``; None when its state file cannot be read."""
        sname = state_file(entry.rank)
        if sname not in self._tensors:
            self._tensors[sname] = self._read(sname)
        tensors = self._tensors[sname]
        if tensors is None:
            return None
        return payload.max_payload_bytes(tensors.get(payload.group_of(name), {}))

    def _read(self, sname: str) -> dict[str, dict[str, tuple[int, int]]] | None:
        entry = self.manifest.files.get(sname)
        if entry is None:
            return None
        try:
            raw = self.storage.read_file(self.manifest.step, sname, entry)
            doc = strictjson.loads(raw)
        except (CkptStoreError, OSError, UnicodeDecodeError, ValueError, RecursionError):
            return None  # reported as the state file's own problem
        return stored_tensors(doc.get("root") if isinstance(doc, dict) else None)


def verify_checkpoint(storage: Storage, step: int, *, deep: bool = True) -> VerifyReport:
    """Verify one committed checkpoint of ``storage``; problems are collected, not raised."""
    report = VerifyReport(target=storage.describe(step), step=step, deep=deep)
    try:
        manifest = storage.read_manifest(step)
    except ManifestError as e:
        report.add(str(e))
        return report
    if manifest.dtensor:
        # One state.json (written by rank 0) and the chunk index; shards are per rank.
        wanted = [STATE_NAME, INDEX_FILE]
    elif manifest.sharded:
        wanted = [f"state.rank{r:05d}.json" for r in range(manifest.world_size)]
    else:
        wanted = [STATE_NAME]
    for name in wanted:
        if name not in manifest.files:
            report.add(f"{storage.describe(step)}: manifest lists no {name}")
    # A node's copy on node-local roots: the other nodes' ranks' files are checked there.
    report.elsewhere = nodes.elsewhere(manifest, _present(storage, manifest, report))
    away = set(report.elsewhere)
    limits = _Limits(storage, manifest)
    index = _check_index(storage, manifest, report, away) if manifest.dtensor else None
    blocks = _blocks_by_file(index) if deep and index is not None else {}
    headers: dict[str, st.Header] = {}
    states: dict[str, Any] = {}
    for name, entry in sorted(manifest.files.items()):
        if entry.rank in away:
            continue
        _check_entry(storage, manifest, name, entry, report, deep, limits, blocks, headers, states)
    for name in wanted:
        if name in states and name != INDEX_FILE:  # deep, and it parsed
            _check_state(storage, manifest, name, states[name], report, headers)
    # The index and state.json are read before the file loop too: say each problem once.
    report.problems[:] = list(dict.fromkeys(report.problems))
    return report


def _present(storage: Storage, manifest: Manifest, report: VerifyReport) -> list[int] | None:
    """The ranks whose files this copy holds (None: every rank's), from its ``local-ranks``.

    A damaged marker is a problem of the step, and every file is checked (a file of another
    node's rank is then reported missing): it never reduces what is checked.
    """
    try:
        return nodes.local_ranks(storage, manifest.step, manifest)
    except IntegrityError as e:
        report.add(str(e))
        return None


def _check_entry(  # noqa: PLR0917 - private, the body of verify_checkpoint's loop
    storage: Storage,
    manifest: Manifest,
    name: str,
    entry: FileEntry,
    report: VerifyReport,
    deep: bool,
    limits: _Limits,
    blocks: Mapping[str, list[_Block]],
    headers: dict[str, st.Header],
    states: dict[str, Any],
) -> None:
    """Check one file of a checkpoint against its manifest entry; problems go to ``report``.

    A safetensors payload's header, once it checked, goes into ``headers`` (by file name),
    and a JSON file's document, once it parsed (deep), into ``states``: what
    :func:`_check_state` walks, and holds the state's tensor references against.
    """
    step = manifest.step
    where = storage.describe(step, name)
    report.files += 1
    try:
        size = storage.file_size(step, name)
        if size is None:
            report.add(f"{where}: missing or not a regular file")
            return
        if size != entry.bytes:
            report.add(f"{where}: {size} bytes, manifest says {entry.bytes}; truncated or replaced")
            return
        if deep and entry.compression is not None and entry.codec in _PAYLOADS:
            limit = limits.of(name, entry)
            if limit is None:  # its state file is reported broken: the checksums only
                try:
                    storage.stream_file(step, name, entry)
                finally:
                    report.bytes_checked += entry.bytes
                return
            # Streamed once: each block checked (or, without block CRCs, the whole file's
            # checksum at its end), inflated (as far as it may) and its content checked as
            # it goes by; a few frames held, not the file nor its content.
            try:
                header = payload.check_compressed(storage, step, name, entry, limit)
            finally:
                report.bytes_checked += entry.bytes
            if header is not None:
                headers[name] = header
            return
        if deep and name in blocks:
            # One read of the shard file: its CRC32C and every chunk block's at once.
            checker = _BlockChecker(blocks[name], where)
            failed = None
            try:
                # The chunk blocks name the tensor a bad byte belongs to: every one is
                # checked, with the whole-file CRC (not the file's own blocks, which would
                # stop the stream at the first bad one).
                whole = dataclasses.replace(entry, blocks=None)
                storage.stream_file(step, name, whole, checker)
            except IntegrityError as e:
                failed = str(e)
            report.bytes_checked += checker.seen
            for p in checker.finish():
                report.add(p)
            if failed is not None:
                report.add(failed)
                return
        elif deep and entry.blocks is not None:
            # Every block's CRC32C (the file's own CRC is not computed on top: the blocks
            # cover every byte, and the manifest that lists both is self-checksummed).
            try:
                storage.stream_file(step, name, entry)
            except IntegrityError as e:
                report.add(str(e))
                return
            finally:
                report.bytes_checked += entry.bytes
        elif deep:
            got, crc = storage.checksum_file(step, name)
            report.bytes_checked += got
            if got != entry.bytes:
                report.add(f"{where}: read {got} bytes, manifest says {entry.bytes}")
                return
            if crc != entry.crc32c:
                report.add(
                    f"{where}: crc32c {format_crc(crc)} does not match the manifest's "
                    f"{format_crc(entry.crc32c)}; the file is corrupt"
                )
                return
        if entry.compression is None and entry.codec in ("safetensors", "torch"):
            with storage.open_file(step, name) as f:
                header = _check_header(f, size, entry.codec, where, deep)
            if header is not None:
                headers[name] = header
        elif entry.codec == "json" and deep and name == RANK_TABLE_NAME:
            pass  # JSON lines, each parsed and checked when the manifest was read
        elif entry.codec == "json" and deep:
            data = storage.read_file(step, name, entry)
            try:
                doc = strictjson.loads(data)
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                report.add(f"{where}: not valid JSON ({e})")
            else:
                if name == state_file(entry.rank) or name == STATE_NAME:
                    states[name] = doc  # walked by _check_state, not read again
    except (CkptStoreError, OSError) as e:
        if isinstance(e, StoreUnreachableError):
            raise  # the store did not answer: nothing is known of the file (design rule 1)
        report.add(str(e) if isinstance(e, CkptStoreError) else f"{where}: unreadable ({e})")


def _check_state(  # noqa: PLR0917 - private, one call site
    storage: Storage,
    manifest: Manifest,
    sname: str,
    doc: Any,
    report: VerifyReport,
    headers: Mapping[str, st.Header],
) -> None:
    """Check the state file ``sname`` as a restore decodes it (:mod:`ckptstore.codec.treecheck`).

    Every node well formed, every tensor it references in a payload of its group whose
    header holds that key with the dtype and shape the state says (a ``torch.save`` zip's
    tensors, described in its pickle, and a payload whose own check failed are taken on
    trust here). A step that fails here would fail its restore: it must not count as the
    newest good one, for which retention deletes older steps.
    """
    step = manifest.step
    entry = manifest.files[sname]
    rank = entry.rank if manifest.sharded and not manifest.dtensor else None
    # A zip's, or a payload reported already, is unknown (no header kept for it).
    contents = treecheck.group_contents(
        payload.groups_of(manifest, rank), lambda n: headers[n].codes if n in headers else None
    )
    for problem in treecheck.check_state(doc, contents, storage.describe(step, sname)):
        report.add(problem)


def _check_index(
    storage: Storage, manifest: Manifest, report: VerifyReport, away: Collection[int] = ()
) -> ChunkIndex | None:
    """Read and validate the chunk index, and check ``state.json``'s sharded tensors against it.

    Problems go into ``report``; returns the index, or ``None`` when it cannot be used.
    """
    step = manifest.step
    entry = manifest.files.get(INDEX_FILE)
    if entry is None:
        return None  # reported as missing
    where = storage.describe(step, INDEX_FILE)
    try:
        index = split_index.read_index(storage, manifest, where, away)
    except (CkptStoreError, OSError) as e:
        if isinstance(e, StoreUnreachableError):
            raise  # the store did not answer: nothing is known of the index
        report.add(str(e) if isinstance(e, CkptStoreError) else f"{where}: unreadable ({e})")
        return None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        report.add(f"{where}: not a valid chunk index ({type(e).__name__}: {e})")
        return None
    state = manifest.files.get(STATE_NAME)
    if state is None:
        return index
    swhere = storage.describe(step, STATE_NAME)
    try:
        tree = strictjson.loads(storage.read_file(step, STATE_NAME, state))
    except (CkptStoreError, OSError, UnicodeDecodeError, ValueError, RecursionError):
        return index  # reported by the file loop with its cause
    found: list[tuple[str, Any]] = []
    try:
        _dtensor_nodes(tree, found, 0)
    except RecursionError:
        report.add(f"{swhere}: nested too deeply; the file is hostile")
        return index
    for name, shape in found:
        t = index.tensors.get(name)
        if t is None:
            report.add(f"{swhere}: sharded tensor {name!r} is not in {INDEX_FILE}")
        elif list(t.shape) != shape:
            report.add(
                f"{swhere}: sharded tensor {name!r} is {shape}, {INDEX_FILE} says {list(t.shape)}"
            )
    return index


def _dtensor_nodes(node: Any, out: list[tuple[str, Any]], depth: int) -> None:
    """Every ``{"t": "dtensor"}`` node of a ``state.json`` tree: ``(name, shape)``."""
    if depth > 400:
        raise RecursionError
    if isinstance(node, list):
        for x in node:
            _dtensor_nodes(x, out, depth + 1)
    elif isinstance(node, dict):
        if node.get("t") == "dtensor":
            out.append((str(node.get("name")), node.get("shape")))
            return
        for x in node.values():
            _dtensor_nodes(x, out, depth + 1)


@dataclasses.dataclass
class _Block:
    """One CRC block of a chunk, at absolute file offsets ``[start, end)``."""

    start: int
    end: int
    crc: int
    k: int
    tensor: str
    offsets: tuple[int, ...]


def _blocks_by_file(index: ChunkIndex) -> dict[str, list[_Block]]:
    out: dict[str, list[_Block]] = {}
    for name, t in index.tensors.items():
        for c in t.chunks:
            for k, crc in enumerate(c.crcs):
                lo = c.start + k * index.block
                hi = min(c.start + (k + 1) * index.block, c.start + c.nbytes)
                out.setdefault(c.file, []).append(_Block(lo, hi, crc, k, name, c.offsets))
    for blocks in out.values():
        blocks.sort(key=lambda b: (b.start, b.end))
    return out


class _BlockChecker:
    """A stream consumer that checks the CRC32C of every chunk block of one shard file.

    Slices arrive in order; each block's CRC is continued across the slices it spans and
    compared once its last byte has been seen. Blocks may overlap (a hostile index): each
    is checked on its own.
    """

    def __init__(self, blocks: list[_Block], where: str) -> None:
        self.blocks = blocks
        self.where = where
        self.next = 0
        self.active: list[tuple[_Block, int]] = []
        self.problems: list[str] = []
        self.seen = 0

    def __call__(self, offset: int, chunk: memoryview) -> None:
        end = offset + len(chunk)
        self.seen = end
        while self.next < len(self.blocks) and self.blocks[self.next].start < end:
            self.active.append((self.blocks[self.next], 0))
            self.next += 1
        keep = []
        for b, crc in self.active:
            lo, hi = max(b.start, offset), min(b.end, end)
            if hi > lo:
                crc = crc32c_of(chunk[lo - offset : hi - offset], crc)
            if b.end <= end:
                if crc != b.crc:
                    self.problems.append(self._bad(b))
            else:
                keep.append((b, crc))
        self.active = keep

    def _bad(self, b: _Block) -> str:
        return (
            f"{self.where}: block {b.k} of the chunk of tensor {b.tensor!r} at offsets "
            f"{list(b.offsets)} (file bytes {b.start}..{b.end}) does not match its crc32c; "
            "the file is corrupt"
        )

    def finish(self) -> list[str]:
        """The problems found; blocks the stream never completed count as bad."""
        missing = [b for b, _ in self.active] + self.blocks[self.next :]
        if self.seen:
            return self.problems + [self._bad(b) for b in missing]
        return self.problems


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """Whether a file of ``size`` bytes starting with ``head`` (16 bytes) may be safetensors.

    Its first 8 bytes are the length of a JSON header that fits in the file and opens with
    ``{``. Anything else is not worth a complaint about its header.
    """
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= min(size - 8, st.MAX_HEADER_BYTES) and head[8:9] == b"{"


def verify_file(path: str | os.PathLike[str], *, deep: bool = True) -> VerifyReport:
    """Verify a lone ``.pt`` / ``.ckpt`` (zip) or ``.safetensors`` file, never unpickling it.

    For a zip: the central directory, that it is a ``torch.save`` archive, and with ``deep``
    every member's CRC-32 (which ``torch.load`` itself never checks). For safetensors: the
    header, every dtype, shape and offset against the file size. Anything else (random
    bytes) is reported as "not a checkpoint format ckptstore knows", not as a bad header.
    """
    path = os.fspath(path)
    report = VerifyReport(target=path, deep=deep)
    try:
        st_ = os.stat(path)
        if not stat.S_ISREG(st_.st_mode):
            report.add(f"{path}: not a regular file")
            return report
        report.files = 1
        with open(path, "rb") as f:
            magic = f.read(4)
            f.seek(0)
            if magic.startswith(b"PK"):
                torchzip.check_zip(f, path, deep=deep)
            elif magic == _LEGACY_TORCH_MAGIC:
                # torch.save's pre-1.6 format is a bare pickle: no structure to check without
                # unpickling it. Say so instead of misreading it as a bad safetensors header.
                report.add(
                    f"{path}: legacy (non-zip) torch.save format; it cannot be verified "
                    "without unpickling. Re-save it with a current torch (zip format)"
                )
                return report
            elif path.endswith(".safetensors") or looks_like_safetensors(f.read(16), st_.st_size):
                f.seek(0)
                _check_header(f, st_.st_size, "safetensors", path, deep)
            elif zipfile.is_zipfile(path):
                # zipfile finds a central directory behind any prefix; torch.load does not
                # (it reads from byte 0): nothing of it was checked, and it does not load.
                report.add(
                    f"{path}: a zip archive with other data before its first record: not a "
                    "torch.save archive (torch.load cannot read it)"
                )
                return report
            else:
                report.add(
                    f"{path}: not a checkpoint format ckptstore knows (neither a torch.save "
                    "zip archive nor a safetensors file)"
                )
                return report
            if deep:
                report.bytes_checked = st_.st_size
    except IntegrityError as e:
        report.add(str(e))
    except OSError as e:
        report.add(f"{path}: unreadable ({e})")
    return report


def verify_stored_file(
    storage: Storage, step: int, name: str, *, deep: bool = True
) -> VerifyReport:
    """Verify one file of a committed checkpoint against its manifest (size, CRC32C, structure).

    ``manifest.json`` itself is checked as a manifest (its own checksum, names, types).
    """
    report = VerifyReport(target=storage.describe(step, name), deep=deep)
    try:
        manifest = storage.read_manifest(step)
    except ManifestError as e:
        report.add(str(e))
        return report
    if name == MANIFEST_NAME:
        report.files = 1
        return report
    if name == LOCAL_RANKS_NAME:  # checked on its own checksum, against the manifest
        report.files = 1
        _present(storage, manifest, report)
        return report
    entry = manifest.files.get(name)
    if entry is None:
        report.add(
            f"{report.target}: not a file of the checkpoint (its manifest does not list it), "
            "so it cannot be checked against it"
        )
        return report
    index = None
    if deep and manifest.dtensor and name != INDEX_FILE:
        aside = VerifyReport(target=report.target)  # problems of other files than this one
        away = nodes.elsewhere(manifest, _present(storage, manifest, aside))
        index = _check_index(storage, manifest, aside, away)
    blocks = _blocks_by_file(index) if index is not None else {}
    limits = _Limits(storage, manifest)
    _check_entry(storage, manifest, name, entry, report, deep, limits, blocks, {}, {})
    return report


#: How often a verify of the newest step moves on to the new newest one when the step it
#: read was deleted meanwhile (as ``restore``).
_RELISTS = 16


def verify_unless_deleted(storage: Storage, step: int, deep: bool) -> VerifyReport:
    """:func:`verify_checkpoint`, where a step deleted meanwhile is ``deleted``, not failed.

    A running job's retention deletes steps as they are read: what the reads then found
    missing is no problem of the store's.
    """
    report = verify_checkpoint(storage, step, deep=deep)
    if not report.ok and step_gone(storage, step):
        report.problems.clear()
        report.deleted = True
    return report


def verify_path(
    target: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    all_steps: bool = False,
    deep: bool = True,
    progress: Progress | None = None,
) -> list[VerifyReport]:
    """Verify a store (its newest step, ``step``, or every step), a step directory, or a file.

    A file inside a committed step directory is checked against the manifest beside it
    (size and CRC32C, then its structure); any other file on its own (:func:`verify_file`).

    Args:
        target: a store (local directory or fsspec URL), a step directory, or a file.
        storage_options: fsspec options for a URL.
        step: the step to verify (default: the newest).
        all_steps: verify every committed step.
        deep: compute checksums (else sizes, headers and structure only).
        progress: called after each step with ``(done, total, "step N")``.

    Returns:
        One report per checkpoint or file verified.

    Raises:
        NoCheckpointError: nothing at ``target``, no store there, an empty store, or
            ``step`` is not committed.
        ValueError: ``step`` or ``all_steps`` given for a file.
    """
    from .stores import committed_step, is_local, open_store, reaching

    target = os.fspath(target)
    path = target.partition("://")[2] if "://" in target else target
    if is_local(target) and os.path.isfile(path):
        if step is not None or all_steps:
            msg = f"{target} is a file: --step and --all apply to stores only"
            raise ConfigError(msg)
        parent = os.path.dirname(os.path.abspath(path))
        parsed = parse_step_dirname(os.path.basename(parent))
        if parsed is not None and os.path.isfile(os.path.join(parent, MANIFEST_NAME)):
            from ..storage import LocalStorage

            store = LocalStorage(os.path.dirname(parent))
            return [verify_stored_file(store, parsed, os.path.basename(path), deep=deep)]
        return [verify_file(path, deep=deep)]
    if is_local(target) and not os.path.lexists(path):
        raise NoCheckpointError(f"{path}: no such file or directory")
    if is_local(target) and step is None and not all_steps:
        # A step directory given directly (ROOT/step-000000001000): verify that step.
        parsed = parse_step_dirname(os.path.basename(os.path.normpath(path)))
        if parsed is not None and os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            target, step = os.path.dirname(os.path.abspath(path)), parsed
    storage = open_store(target, storage_options)
    with reaching(storage.root):
        if not all_steps:
            for _ in range(_RELISTS):
                s = committed_step(storage, step)
                report = verify_unless_deleted(storage, s, deep)
                if not report.deleted:
                    return [report]
                if step is not None:
                    raise NoCheckpointError(
                        f"{storage.describe(s)} was deleted while it was verified (a running "
                        "job's retention, `ckptstore prune` or `rm`); it was not corrupt"
                    )
                # The newest step went while we read it: the new newest, as restore does.
            return [report]
        steps = storage.list_steps()
        if not steps:
            raise NoCheckpointError(f"{storage.root}: no committed checkpoint")
        reports = []
        for i, s in enumerate(steps):
            if progress is not None:
                progress(i, len(steps), f"step {s}")
            reports.append(verify_unless_deleted(storage, s, deep))
        if progress is not None:
            progress(len(steps), len(steps), "done")
        return reports

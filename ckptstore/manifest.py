"""The manifest: the commit marker of a checkpoint, its file table and its metadata.

A checkpoint exists if and only if its ``manifest.json`` exists and verifies. The manifest
carries a CRC32C of its own canonical body (sorted keys, no whitespace), so a torn or edited
manifest is detected before anything it names is trusted. Everything read from disk is treated
as hostile: sizes are bounded, names are single path components, types are checked one by one.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .codec.strictjson import deeper_than
from .errors import ManifestError
from .integrity import BLOCK, block_count, crc32c_of, format_crc, parse_crc

__all__ = [
    "DTENSOR_FORMAT_VERSION",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "RANKS_FORMAT_VERSION",
    "RANK_TABLE_NAME",
    "SPLIT_FORMAT_VERSION",
    "STRIDED_FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "RankTable",
    "file_entry_from_json",
    "validate_file_name",
    "validate_payload_name",
]

#: The format version written for replicated and per-rank checkpoints.
FORMAT_VERSION = 1
#: The format version of DTensor checkpoints (``dtensors.json``): a format-1 reader would
#: take their rank-0 part for the whole state, so it must refuse them.
DTENSOR_FORMAT_VERSION = 2
#: The format version of DTensor checkpoints with a split chunk index (one part per rank,
#: ``ckptstore.sharded.split_index``): a format-2 reader would find no chunk in
#: ``dtensors.json``, so it must refuse them.
SPLIT_FORMAT_VERSION = 3
#: The format version of split-index DTensor checkpoints whose per-rank files are listed in
#: the rank table (:data:`RANK_TABLE_NAME`, one fixed-width line a rank) instead of in the
#: manifest, so a restoring rank reads the lines of the ranks it reads from, not a row per
#: rank of the job (``ckptstore.ranktable``). A format-3 reader would see no rank's files.
RANKS_FORMAT_VERSION = 4
#: The format version of format-4 checkpoints whose split index spells FSDP2 over tensor
#: parallelism's ``_StridedShard`` placements (``_S(dim, sf)``), whose boxes a format-4
#: reader cannot compute: it must refuse them by version, not as a hostile index.
STRIDED_FORMAT_VERSION = 5
#: The newest format this ckptstore reads.
READ_FORMAT_VERSION = 5
#: The rank table of a format-4 checkpoint, a file of no rank listed in its manifest.
RANK_TABLE_NAME = "_ranks.jsonl"
#: Bounds a manifest puts on its rank table: lines (ranks) and bytes a line (a rank's line
#: holds a CRC32C a 4 MiB block of its files: 16 MiB lists about 6 TB of shards a rank).
MAX_RANKS = 1 << 24
MAX_RANK_LINE = 16 << 20
#: A manifest larger than this is refused unread (a hostile or corrupt file).
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: Levels of lists and objects a manifest may nest (its ``metadata`` two fewer): a deeper one
#: is hostile (``save`` refuses such metadata), and one nested just under the interpreter's
#: recursion limit parsed, then overflowed the stack when its checksum re-encoded it.
MAX_MANIFEST_DEPTH = 64
#: Largest size a manifest may claim for one file (1 PiB): beyond it, it is lying.
MAX_FILE_BYTES = 1 << 50
#: Largest JSON file of a step (``state.json``, the chunk index and its parts): a save
#: refuses to write more, and a reader refuses, unread, a manifest that claims more (a file
#: read whole into memory: a forged size over a sparse file cost gigabytes before its CRC
#: failed).
MAX_JSON_FILE_BYTES = 1 << 30
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
CODECS = ("safetensors", "torch", "json")
COMPRESSIONS = (None, "zstd")


#: Files a step directory holds beside its payloads, written by the store itself (see
#: ``layout.py``): a manifest listing one could make a fetch or a copy plant a marker.
MARKER_NAMES = frozenset({"pinned", "replicated", "local-ranks"})


def validate_payload_name(name: object) -> str:
    """:func:`validate_file_name`, and not the name of a marker the store writes itself.

    Raises:
        ManifestError: an unsafe name, or a marker's (``pinned``, ``replicated``,
            ``local-ranks``).
    """
    validate_file_name(name)
    if name in MARKER_NAMES:
        msg = (
            f"file name {name!r} in manifest is the name of a marker the store writes itself "
            "(pinned, replicated, local-ranks), not a payload; the manifest is corrupt or hostile"
        )
        raise ManifestError(msg)
    return str(name)


def validate_file_name(name: object) -> str:
    """Check that ``name`` is a safe single path component and return it.

    Allowed: ``[A-Za-z0-9._-]``, at most 200 characters, not starting with a dot (so never
    ``.``, ``..`` or a hidden file), never ``manifest.json`` itself.

    Raises:
        ManifestError: for anything else, e.g. ``../x`` or ``/etc/passwd``.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name == "manifest.json":
        msg = (
            f"unsafe file name {name!r} in manifest: names must be one path component of "
            "[A-Za-z0-9._-] not starting with '.'; the manifest is corrupt or hostile"
        )
        raise ManifestError(msg)
    return name


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One row of the file table.

    Attributes:
        bytes: the file's size as stored.
        crc32c: CRC32C of the whole file as stored.
        codec: ``"safetensors"``, ``"torch"`` or ``"json"``.
        compression: ``None`` or ``"zstd"``.
        rank: the rank that wrote it, for per-rank files.
        blocks: CRC32C of each consecutive :data:`~ckptstore.integrity.BLOCK` (4 MiB) of the
            file as stored (compressed bytes for ``.zst`` files), the last one short; so a
            byte range can be checked before it is used (:func:`~ckptstore.integrity.
            check_blocks`). ``None`` for files of one block or less, and in manifests
            written before it existed.
    """

    bytes: int
    crc32c: int
    codec: str
    compression: str | None = None
    rank: int | None = None
    blocks: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form of the row."""
        out: dict[str, Any] = {
            "bytes": self.bytes,
            "crc32c": format_crc(self.crc32c),
            "codec": self.codec,
            "compression": self.compression,
        }
        if self.rank is not None:
            out["rank"] = self.rank
        if self.blocks is not None:
            out["blocks"] = list(self.blocks)
        return out


def _metric_to_json(v: float) -> float | str:
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _metric_from_json(v: object, where: str) -> float:
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ManifestError(f"{where}: metric must be a number, got {type(v).__name__}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class RankTable:
    """Where a format-4 manifest's per-rank files are listed (:data:`RANK_TABLE_NAME`).

    Attributes:
        count: lines in the table, one a rank of the job that saved (its world size).
        width: bytes a line, padding and newline included: rank ``r``'s line starts at
            ``r * width``.
    """

    count: int
    width: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of one checkpoint.

    Attributes:
        step: the training step.
        files: the file table, name -> :class:`FileEntry`.
        created: creation time, ISO 8601 in UTC.
        format: payload format, ``"safetensors"`` or ``"torch"``.
        world_size: ranks in the job that saved it.
        sharded: whether every rank wrote its own files.
        dtensor: whether those files hold DTensor shards described by ``dtensors.json``
            (restorable on any world size), rather than per-rank opaque state.
        metrics: numbers for retention (``KeepBest``) and display.
        metadata: free user metadata (JSON).
        versions: library versions of the writer.
        format_version: the on-disk format version.
        rank_table: format 4: the per-rank files are listed in the rank table, and
            ``manifest.json`` lists only the files of no rank (the table among them).
            :meth:`~ckptstore.storage.Storage.read_manifest` reads the table, so ``files``
            holds every file; a manifest parsed from bytes alone holds the files of no rank
            until :func:`ckptstore.ranktable.expand` adds the table's (``complete`` False).
        complete: whether ``files`` lists every file of the step.
    """

    step: int
    files: Mapping[str, FileEntry]
    created: str = ""
    format: str = "safetensors"
    world_size: int = 1
    sharded: bool = False
    dtensor: bool = False
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    versions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    rank_table: RankTable | None = None
    complete: bool = dataclasses.field(default=True, compare=False)

    def plain_files(self) -> dict[str, FileEntry]:
        """The files of no rank (the state, the chunk index, the rank table), never a rank's.

        Reads nothing: a lazily read table (``files`` of a restore's manifest) stays unread.
        """
        head = getattr(self.files, "head", None)
        if isinstance(head, Mapping):
            return dict(head)
        return {n: e for n, e in self.files.items() if e.rank is None}

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of all payload files."""
        return sum(e.bytes for e in self.files.values())

    @property
    def sharding_kind(self) -> str:
        """``"replicated"``, ``"sharded"`` (per-rank state) or ``"dtensor"``."""
        if self.dtensor:
            return "dtensor"
        return "sharded" if self.sharded else "replicated"

    @property
    def created_datetime(self) -> _dt.datetime | None:
        """``created`` parsed, or ``None`` when absent."""
        try:
            return _dt.datetime.fromisoformat(self.created.replace("Z", "+00:00"))
        except ValueError:
            return None

    def body(self) -> dict[str, Any]:
        """The manifest as a JSON object, without its self-checksum.

        With a rank table only the files of no rank are listed: the table lists the others.
        """
        files = self.files if self.rank_table is None else self.plain_files()
        out = {
            "format_version": self.format_version,
            "step": self.step,
            "created": self.created,
            "format": self.format,
            "versions": dict(self.versions),
            "world_size": self.world_size,
            "sharding": {"kind": self.sharding_kind},
            "files": {n: e.to_json() for n, e in sorted(files.items())},
            "metrics": {k: _metric_to_json(v) for k, v in sorted(self.metrics.items())},
            "metadata": dict(self.metadata),
        }
        if self.rank_table is not None:
            out["rank_table"] = {"count": self.rank_table.count, "width": self.rank_table.width}
        return out

    def to_bytes(self) -> bytes:
        """Serialize: readable JSON with a CRC32C of the canonical body under ``checksum``."""
        body = self.body()
        crc = crc32c_of(_canonical(body))
        doc = dict(body, checksum=format_crc(crc))
        return (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest.json") -> Manifest:
        """Parse and validate a manifest; every defect is a :class:`ManifestError`."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {len(data)} bytes is larger than any real manifest")
        try:
            doc = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except ManifestError as e:
            raise ManifestError(f"{where}: {e}") from None
        except RecursionError:
            raise ManifestError(f"{where}: JSON nested too deeply; the file is hostile") from None
        except (UnicodeDecodeError, ValueError) as e:
            raise ManifestError(
                f"{where}: not valid JSON ({e}); the checkpoint is torn or corrupt"
            ) from None
        return cls.from_json(doc, where=where)

    @staticmethod
    def _check_depth(doc: object, where: str) -> None:
        if deeper_than(doc, MAX_MANIFEST_DEPTH):
            raise ManifestError(
                f"{where}: JSON nested more than {MAX_MANIFEST_DEPTH} levels deep (ckptstore "
                "writes none); the manifest is hostile"
            )

    @classmethod
    def from_json(cls, doc: object, *, where: str = "manifest.json") -> Manifest:
        """Validate a decoded manifest object (see :meth:`from_bytes`)."""
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: a manifest is a JSON object")
        cls._check_depth(doc, where)
        version = doc.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ManifestError(f"{where}: format_version missing or not a positive integer")
        if version > READ_FORMAT_VERSION:
            raise ManifestError(
                f"{where}: written in format version {version} by a newer ckptstore; this one "
                f"reads formats up to {READ_FORMAT_VERSION}. Upgrade ckptstore to read it."
            )
        checksum = doc.get("checksum")
        body = {k: v for k, v in doc.items() if k != "checksum"}
        try:
            expected = parse_crc(checksum)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            raise ManifestError(f"{where}: self-checksum missing or malformed") from None
        try:
            actual = crc32c_of(_canonical(body))
        except ValueError:  # json.loads accepts NaN, Infinity and 1e400; canonical JSON does not
            raise ManifestError(
                f"{where}: non-finite number (NaN, Infinity) in JSON; the manifest is corrupt "
                "or hostile"
            ) from None
        if actual != expected:
            raise ManifestError(
                f"{where}: self-checksum mismatch (stored {format_crc(expected)}, computed "
                f"{format_crc(actual)}); the manifest was edited or corrupted"
            )
        step = _int(doc, "step", where)
        files_raw = doc.get("files")
        if not isinstance(files_raw, dict):
            raise ManifestError(f"{where}: 'files' must be an object")
        files: dict[str, FileEntry] = {}
        for name, row in files_raw.items():
            try:
                validate_payload_name(name)
            except ManifestError as e:  # say which manifest holds the name
                raise ManifestError(f"{where}: {e}") from None
            files[name] = _file_entry(row, f"{where}: file {name!r}")
        fmt = doc.get("format", "safetensors")
        if fmt not in ("safetensors", "torch"):
            raise ManifestError(f"{where}: unknown payload format {fmt!r}")
        sharding = doc.get("sharding", {"kind": "replicated"})
        kind = sharding.get("kind") if isinstance(sharding, dict) else None
        if kind not in ("replicated", "sharded", "dtensor"):
            raise ManifestError(
                f"{where}: 'sharding' must be {{'kind': replicated|sharded|dtensor}}"
            )
        if (kind == "dtensor") != (version >= DTENSOR_FORMAT_VERSION):
            raise ManifestError(f"{where}: sharding kind {kind!r} in format version {version}")
        world_size = _int(doc, "world_size", where, minimum=1)
        metrics_raw = doc.get("metrics", {})
        if not isinstance(metrics_raw, dict):
            raise ManifestError(f"{where}: 'metrics' must be an object")
        metrics = {
            str(k): _metric_from_json(v, f"{where}: metric {k!r}") for k, v in metrics_raw.items()
        }
        metadata = doc.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ManifestError(f"{where}: 'metadata' must be an object")
        versions = doc.get("versions", {})
        if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
            raise ManifestError(f"{where}: 'versions' must map names to strings")
        created = doc.get("created", "")
        if not isinstance(created, str):
            raise ManifestError(f"{where}: 'created' must be a string")
        table = _rank_table(doc, files, version, kind == "dtensor", world_size, where)
        return cls(
            step=step,
            files=files,
            created=created,
            format=fmt,
            world_size=world_size,
            sharded=kind != "replicated",
            dtensor=kind == "dtensor",
            metrics=metrics,
            metadata=metadata,
            versions=versions,
            format_version=version,
            rank_table=table,
            complete=table is None,
        )

    def to_cache(self) -> list[Any]:
        """A compact JSON form for the listing cache (see :meth:`from_cache`)."""
        return [
            self.step,
            {n: [e.bytes, e.crc32c, e.codec, e.compression, e.rank] for n, e in self.files.items()},
            self.created,
            self.format,
            self.world_size,
            self.sharding_kind,
            {k: _metric_to_json(v) for k, v in self.metrics.items()},
            dict(self.metadata),
            dict(self.versions),
            self.format_version,
            None if self.rank_table is None else [self.rank_table.count, self.rank_table.width],
        ]

    @classmethod
    def from_cache(cls, row: list[Any]) -> Manifest:
        """Rebuild a manifest that was validated when it was cached (no checks repeated).

        Only for listings: the cache says what a manifest *was* when its file had a given
        identity; restore and verify always read and validate ``manifest.json`` itself.
        The per-block CRCs (``FileEntry.blocks``) are not cached: listings never use them,
        and they would make the cache about 1 KB per GB of checkpoint per step.
        Malformed rows raise ``ValueError``/``TypeError``/``KeyError``/``IndexError``.
        """
        step, files, created, fmt, world, sharded, metrics, metadata, versions, fv = row[:10]
        table = row[10] if len(row) > 10 else None
        if table is None and int(fv) >= RANKS_FORMAT_VERSION:
            raise ValueError("a cached format-4 manifest without its rank table")
        return cls(
            step=int(step),
            files={
                str(n): FileEntry(int(b), int(c), str(k), z, r)
                for n, (b, c, k, z, r) in files.items()
            },
            created=str(created),
            format=str(fmt),
            world_size=int(world),
            sharded=sharded is True or sharded in ("sharded", "dtensor"),
            dtensor=sharded == "dtensor",
            metrics={str(k): float(v) for k, v in metrics.items()},
            metadata=dict(metadata),
            versions=dict(versions),
            format_version=int(fv),
            rank_table=None if table is None else RankTable(int(table[0]), int(table[1])),
        )


def _rank_table(  # noqa: PLR0917 - a private validator
    doc: Mapping[str, Any],
    files: Mapping[str, FileEntry],
    version: int,
    dtensor: bool,
    world_size: int,
    where: str,
) -> RankTable | None:
    """Validate a manifest's ``rank_table`` against its version and its file table."""
    raw = doc.get("rank_table")
    if raw is None:
        if version >= RANKS_FORMAT_VERSION:
            raise ManifestError(f"{where}: format version {version} without its 'rank_table'")
        return None
    if version < RANKS_FORMAT_VERSION or not dtensor:
        raise ManifestError(f"{where}: a 'rank_table' in a format-{version} manifest")
    if not isinstance(raw, dict) or set(raw) != {"count", "width"}:
        raise ManifestError(f"{where}: 'rank_table' must be {{'count': N, 'width': W}}")
    count, width = raw["count"], raw["width"]
    for key, v, top in (("count", count, MAX_RANKS), ("width", width, MAX_RANK_LINE)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise ManifestError(f"{where}: rank_table {key} must be an integer in [1, {top}]")
    if count != world_size:
        raise ManifestError(
            f"{where}: rank table of {count} ranks in a step saved by {world_size}; the manifest "
            "is corrupt or hostile"
        )
    entry = files.get(RANK_TABLE_NAME)
    if entry is None or entry.rank is not None or entry.bytes != count * width:
        raise ManifestError(
            f"{where}: the rank table {RANK_TABLE_NAME} must be listed, of no rank, with "
            f"{count} x {width} bytes; the manifest is corrupt or hostile"
        )
    ranked = sorted(n for n, e in files.items() if e.rank is not None)
    if ranked:
        raise ManifestError(
            f"{where}: files of a rank ({ranked[:3]}) listed beside a rank table, which lists "
            "them; the manifest is corrupt or hostile"
        )
    return RankTable(count, width)


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ManifestError(f"duplicate key {k!r}; the manifest is corrupt or hostile")
        out[k] = v
    return out


def _int(doc: Mapping[str, Any], key: str, where: str, *, minimum: int = 0) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ManifestError(f"{where}: {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def file_entry_from_json(row: object, where: str) -> FileEntry:
    """Validate one row of a file table (as :meth:`FileEntry.to_json` writes it).

    Raises:
        ManifestError: anything malformed, named with ``where``.
    """
    return _file_entry(row, where)


def _file_entry(row: object, where: str) -> FileEntry:
    if not isinstance(row, dict):
        raise ManifestError(f"{where}: entry must be an object")
    size = row.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
        raise ManifestError(f"{where}: 'bytes' must be an integer in [0, 2**50], got {size!r}")
    try:
        crc = parse_crc(row.get("crc32c"))  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise ManifestError(f"{where}: 'crc32c' must be 8 hex digits") from None
    codec = row.get("codec")
    if codec not in CODECS:
        raise ManifestError(f"{where}: unknown codec {codec!r}")
    compression = row.get("compression")
    if compression not in COMPRESSIONS:
        raise ManifestError(f"{where}: unknown compression {compression!r}")
    rank = row.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ManifestError(f"{where}: 'rank' must be a non-negative integer")
    blocks = _blocks(row.get("blocks"), size, where)
    return FileEntry(
        bytes=size, crc32c=crc, codec=codec, compression=compression, rank=rank, blocks=blocks
    )


_U32 = 0xFFFFFFFF


def _blocks(raw: object, size: int, where: str) -> tuple[int, ...] | None:
    """Validate a row's per-block CRCs: exactly one u32 per :data:`BLOCK` bytes of the file."""
    if raw is None:
        return None
    want = block_count(size, BLOCK)
    # The length is checked before anything is iterated: the work is bounded by the size the
    # row claims, itself bounded (and the manifest by MAX_MANIFEST_BYTES).
    if not isinstance(raw, list) or len(raw) != want:
        got = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise ManifestError(
            f"{where}: 'blocks' must be a list of {want} CRC32Cs (one per {BLOCK} bytes of its "
            f"{size}), got {got}; the manifest is corrupt or hostile"
        )
    for v in raw:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _U32:
            raise ManifestError(f"{where}: 'blocks' must hold integers in [0, 2**32), got {v!r}")
    return tuple(raw)


def utc_now() -> str:
    """The current time as the manifest spells it."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

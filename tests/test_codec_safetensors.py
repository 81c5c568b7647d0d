"""ckptstore.codec.safetensors: our writer makes standard files; our reader trusts nothing."""

from __future__ import annotations

import io
import itertools
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import zstandard

from ckptstore import CheckpointManager, IntegrityError
from ckptstore.codec import safetensors as st

# ---- helpers ------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def write(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    n = st.write_safetensors(buf, tensors, metadata)
    assert n == len(buf.getvalue())
    return buf.getvalue()


def hand_made(header: Any, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    """A safetensors file from a header object (or raw header bytes), unpadded."""
    head = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def entry(dtype: str, shape: list[int], start: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def sample() -> dict[str, torch.Tensor]:
    out = {name: torch.arange(6).to(dt).reshape(2, 3) for dt, name in st.DTYPE_TO_ST.items()}
    out["BOOL"] = torch.tensor([[True, False, True], [False, False, True]])
    out["scalar"] = torch.tensor(-2.5, dtype=torch.float64)
    out["empty"] = torch.zeros(0, 4, dtype=torch.int16)
    return out


# ---- the writer ---------------------------------------------------------------------------


def test_writer_output_is_exactly_the_format() -> None:
    data = write({"b": torch.tensor([7], dtype=torch.uint8), "a": torch.tensor([1.0, -2.0])})
    header = (
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"U8","shape":[1],"data_offsets":[8,9]}}'
    )
    pad = b" " * (-(8 + len(header)) % 8)  # small file: 8-byte aligned, like safetensors
    expected = (
        struct.pack("<Q", len(header + pad))
        + header
        + pad
        + struct.pack("<2f", 1.0, -2.0)
        + bytes([7])
    )
    assert data == expected
    assert (8 + len(header + pad)) % 8 == 0


def test_writer_layout_keeps_big_tensors_aligned() -> None:
    """A 0-d optimizer ``step`` between big tensors must not misalign every later one."""
    from ckptstore.codec.safetensors import build_header

    tensors = {
        "0.exp_avg": torch.zeros(1 << 18),  # 1 MiB: a large file, block layout
        "0.step": torch.tensor(1.0),
        "1.exp_avg": torch.zeros(2048),
        "1.step": torch.tensor(1.0),
        "h": torch.zeros(3, dtype=torch.float16),
        "d": torch.zeros(2, dtype=torch.float64),
    }
    head, order = build_header(tensors)
    assert [n for n, _ in order] == ["0.exp_avg", "1.exp_avg", "d", "0.step", "1.step", "h"]
    pos = len(head)
    for name, t in order:
        assert pos % t.element_size() == 0, name
        if name.endswith("exp_avg"):
            assert pos % 4096 == 0, name
        pos += t.numel() * t.element_size()
    loaded = safetensors.torch.load(write(tensors))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_writer_output_loads_with_the_safetensors_library(tmp_path: Path) -> None:
    tensors = sample()
    data = write(tensors, {"format": "pt", "note": "ü"})
    loaded = safetensors.torch.load(data)
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype, name
        assert loaded[name].shape == t.shape, name
        assert bits(loaded[name]) == bits(t), name
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "ü"}
    # Largest elements first and an 8-byte aligned data start: every tensor is aligned.
    header = st.parse_header(data, len(data), "x")
    assert header.data_start % 8 == 0
    for name, (dtype, _, start, _) in header.entries.items():
        size = torch.empty((), dtype=dtype).element_size()
        assert (header.data_start + start) % size == 0, name


def test_reader_reads_the_safetensors_library_output() -> None:
    tensors = sample()
    data = bytearray(safetensors.torch.save(tensors, metadata={"k": "v"}))
    got = st.read_tensors(data, "x.safetensors")
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype, name
        assert bits(got[name]) == bits(t), name
    assert st.parse_header(data, len(data), "x").metadata == {"k": "v"}
    # Each tensor owns its memory: the file buffer can go.
    data[:] = bytes(len(data))
    assert got["F32"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_misaligned_file_still_reads() -> None:
    # An unpadded 3-byte tensor first puts the F32 data at an odd address.
    floats = struct.pack("<2f", 1.5, -2.0)
    data = hand_made({"b": entry("U8", [3], 0, 3), "a": entry("F32", [2], 3, 11)}, b"abc" + floats)
    header = st.parse_header(data, len(data), "x")
    assert (header.data_start + 3) % 4 != 0
    ref = safetensors.torch.load(data)  # the real library accepts it
    got = st.read_tensors(bytearray(data), "x")
    assert got["a"].tolist() == [1.5, -2.0] == ref["a"].tolist()
    assert got["b"].tolist() == [97, 98, 99] == ref["b"].tolist()


def test_tensor_bytes_and_unsupported_dtypes() -> None:
    t = torch.tensor([1, 2], dtype=torch.int16)
    assert bytes(st.tensor_bytes(t)) == b"\x01\x00\x02\x00"
    assert bytes(st.tensor_bytes(torch.zeros(0))) == b""
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        st.tensor_bytes(torch.zeros(2, 2).t())
    with pytest.raises(ValueError, match=r"dtype torch\.complex128 has no safetensors equivalent"):
        write({"c": torch.zeros(1, dtype=torch.complex128)})


# ---- the reader refuses anything inconsistent ---------------------------------------------

F4 = b"\x00" * 4


@pytest.mark.parametrize(
    ("data", "message", "lib_rejects"),
    [
        pytest.param(
            b"\x01\x00", "2 bytes is shorter than the 8-byte header length", True, id="tiny"
        ),
        pytest.param(
            struct.pack("<Q", 1000) + b"{}",
            "header length 1000 runs past the file (10 bytes)",
            True,
            id="header-past-eof",
        ),
        pytest.param(hand_made(None, raw=b"{nope"), "header is not JSON", True, id="not-json"),
        pytest.param(hand_made(None, raw=b"\xff\xfe{}"), "header is not JSON", True, id="not-utf8"),
        pytest.param(hand_made([1]), "header is not a JSON object", True, id="not-object"),
        pytest.param(
            hand_made({"a": entry("F128", [1], 0, 16)}, bytes(16)),
            "entry 'a' has unknown dtype 'F128'",
            True,
            id="unknown-dtype",
        ),
        pytest.param(
            hand_made({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, F4),
            "entry 'a' has unknown dtype ['F32']",
            True,
            id="unhashable-dtype",
        ),
        pytest.param(
            hand_made({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
            "entry 'b' overlaps the tensor before it",
            True,
            id="overlap",
        ),
        pytest.param(
            hand_made({"a": entry("F32", [2], 0, 8)}, F4),
            "entry 'a': data [0, 8] runs past the file (4 data bytes)",
            True,
            id="past-eof",
        ),
        pytest.param(
            hand_made({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
            "a gap of 4 bytes before entry 'b'",
            True,
            id="gap",
        ),
        pytest.param(
            hand_made({"a": entry("F32", [1], 0, 4)}, bytes(8)),
            "4 bytes after the last tensor",
            True,
            id="trailing",
        ),
        pytest.param(
            hand_made({"a": entry("F32", [3], 0, 8)}, bytes(8)),
            "entry 'a': offsets [0, 8] do not fit shape [3]",
            True,
            id="shape-size-mismatch",
        ),
        pytest.param(
            hand_made({"a": entry("U8", [0], 4, 0)}, F4),
            "entry 'a': offsets [4, 0] do not fit shape [0]",
            True,
            id="end-before-start",
        ),
        pytest.param(
            hand_made(
                None,
                raw=b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
                data=b"\x00",
            ),
            "header is not JSON (duplicate key 'a')",
            False,  # the Rust library lets the last one win; we refuse the ambiguity
            id="duplicate-key",
        ),
        pytest.param(
            hand_made({"a": entry("F32", [-1], 0, 4)}, F4),
            "entry 'a' has a malformed shape [-1]",
            True,
            id="negative-shape",
        ),
        pytest.param(
            hand_made({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\x00"),
            "entry 'a' has a malformed shape [True]",
            True,
            id="bool-shape",
        ),
        pytest.param(
            hand_made({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0.0, 1]}}, b"\x00"),
            "entry 'a' has malformed data_offsets [0.0, 1]",
            True,
            id="float-offset",
        ),
        pytest.param(
            hand_made({"a": "F32"}, F4), "entry 'a' is not an object", True, id="entry-not-object"
        ),
        pytest.param(
            hand_made({"__metadata__": {"k": 1}}),
            "__metadata__ must map strings to strings",
            True,
            id="metadata-not-str",
        ),
        pytest.param(
            hand_made(None, raw=b"[" * 100_000 + b"]" * 100_000),
            "header nested too deeply",
            True,
            id="deep-nesting",
        ),
    ],
)
def test_parse_header_rejects(data: bytes, message: str, lib_rejects: bool) -> None:
    with pytest.raises(IntegrityError) as ei:
        st.parse_header(data, len(data), "f.safetensors")
    assert str(ei.value).startswith("f.safetensors: not a valid safetensors file: ")
    assert message in str(ei.value)
    with pytest.raises(IntegrityError):
        st.read_tensors(bytearray(data), "f.safetensors")
    if lib_rejects:  # the reference implementation agrees the file is invalid
        with pytest.raises(Exception, match=r"."):
            safetensors.torch.load(data)


def test_parse_header_bounds_the_header_length() -> None:
    head = struct.pack("<Q", st.MAX_HEADER_BYTES + 1)
    with pytest.raises(IntegrityError, match=r"header length 100000001 runs past the file"):
        st.parse_header(head, 10**12, "big")
    with pytest.raises(ValueError, match="needs the whole header"):
        st.parse_header(struct.pack("<Q", 10) + b"{}", 100, "partial")


def test_declared_size_is_known_from_the_header_alone() -> None:
    buf = io.BytesIO()
    st.write_safetensors(buf, {"a": torch.arange(10, dtype=torch.int64), "b": torch.ones(3)})
    data = buf.getvalue()
    n = int.from_bytes(data[:8], "little")
    for cut in (0, 7, 8, 8 + n - 1):
        assert st.declared_size(data[:cut], "f") is None, cut  # not all of the header yet
    for cut in (8 + n, len(data) - 1, len(data), len(data) + 5):
        assert st.declared_size(data[:cut] + b"\0" * max(0, cut - len(data)), "f") == len(data)
    with pytest.raises(IntegrityError, match=r"^big: .*header length 100000001 is over the"):
        st.declared_size(struct.pack("<Q", st.MAX_HEADER_BYTES + 1), "big")
    # Entries are checked against the size the header declares: a gap is refused.
    gap = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    raw = json.dumps(gap).encode()
    with pytest.raises(IntegrityError, match="a gap of 4 bytes"):
        st.declared_size(struct.pack("<Q", len(raw)) + raw, "gap")


# ---- payloads written by the manager are standard files -------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_payloads_load_with_plain_safetensors(tmp_path: Path, compression: str | None) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path, compression=compression) as mgr:
        mgr.save(10, {"model": model, "optimizer": opt})
    step_dir = tmp_path / "step-000000000010"
    ext = ".safetensors" + (".zst" if compression else "")
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        ["manifest.json", "state.json", "model" + ext, "optimizer" + ext]
    )

    def load(name: str) -> dict[str, torch.Tensor]:
        raw = (step_dir / (name + ext)).read_bytes()
        if compression:
            raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        return safetensors.torch.load(raw)

    weights = load("model")
    expected = model.state_dict()
    assert sorted(weights) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for k, v in expected.items():
        assert torch.equal(weights[k], v), k
    if not compression:
        direct = safetensors.torch.load_file(step_dir / "model.safetensors")
        assert sorted(direct) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    optim = load("optimizer")
    assert sorted(optim) == sorted(
        f"state.{i}.{k}" for i in range(4) for k in ("exp_avg", "exp_avg_sq", "step")
    )
    for i, p in enumerate(model.parameters()):
        assert torch.equal(optim[f"state.{i}.exp_avg"], opt.state[p]["exp_avg"])


def test_the_device_destination_puts_each_piece_at_its_byte_offset() -> None:
    # _DeviceBytes copies the pieces of a stream into a GPU target (tools/gpu_check.py runs
    # that path on a GPU); its byte arithmetic is the same for any device, so a CPU tensor
    # shows it here. Pieces arrive in any split, including a byte in the middle of a float.
    want = torch.arange(10, dtype=torch.float32)
    data = memoryview(bytearray(want.numpy().tobytes()))
    got = torch.zeros(10)
    dest = st._DeviceBytes(got)
    for a, b in ((0, 7), (7, 8), (8, 33), (33, 33), (33, 40)):
        dest[a:b] = data[a:b]
    assert torch.equal(got, want)
    # Only contiguous tensors of the stored dtype and shape on a GPU are taken in place.
    assert not st.fits_device(got, torch.float32, [10])  # on the CPU: the host path


@pytest.mark.parametrize("readonly", [False, True], ids=["memmove", "read-only-chunks"])
def test_stream_decoder_fills_targets_from_chunks_of_any_split(readonly: bool) -> None:
    """Writable chunks are copied by ``memmove`` (the GIL dropped), read-only ones through
    a view of the destination; either way, each byte lands at its place, in the caller's
    tensor where it fits and in a fresh one otherwise."""
    tensors = {"a": torch.randn(1000), "b": torch.arange(77, dtype=torch.int64), "c": torch.ones(0)}
    buf = io.BytesIO()
    st.write_safetensors(buf, tensors)
    data = buf.getvalue()
    into = {"a": torch.zeros(1000)}
    dec = st.StreamDecoder(len(data), "f", into)
    cuts = [0, 5, 8, 9, 300, 301, 4100, len(data)]
    for x, y in itertools.pairwise(cuts):
        piece = bytes(data[x:y]) if readonly else bytearray(data[x:y])
        dec(x, memoryview(piece))
    out = dec.result()
    assert out["a"] is into["a"]
    for k, t in tensors.items():
        assert torch.equal(out[k], t), k


def test_read_group_faults_targets_in_file_order_and_joins_its_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from ckptstore import _prefault
    from ckptstore.codec import payload
    from ckptstore.storage.local import LocalStorage

    made: list[Any] = []
    real = st.Prefaulter

    def recorded(ranges: Any) -> Any:
        pf = real(ranges)
        made.append(pf)
        return pf

    monkeypatch.setattr(st, "Prefaulter", recorded)
    monkeypatch.setattr(_prefault, "MIN_BYTES", 4096)
    # Over 4 MiB (BLOCK): streamed, not read whole first.
    state = {"w": torch.randn(2048, 1024), "v": torch.randn(512, 1024), "s": torch.tensor(3)}
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(1, {"model": state})
    storage = LocalStorage(str(tmp_path / "s"))
    manifest = storage.read_manifest(1)
    (name,) = [n for n in manifest.files if n.endswith(".safetensors")]
    entry = manifest.files[name]
    into = {"w": torch.empty(2048, 1024)}
    got = payload.read_group(storage, 1, name, entry, into)
    assert torch.equal(got["w"], state["w"])
    assert torch.equal(got["v"], state["v"])
    (pf,) = made
    # The targets of at least 4 KiB, by their place in the file (the caller's "w", a fresh
    # "v"); the thread joined once the stream ended.
    (path,) = (tmp_path / "s").glob(f"*/{name}")
    header = st.parse_header(path.read_bytes(), entry.bytes, "f")
    order = sorted((header.entries[k][2], k) for k in ("w", "v"))
    assert pf.ranges == [(got[k].data_ptr(), got[k].numel() * 4) for _, k in order]
    assert pf._thread is None
    assert not any(t.name == "ckptstore-prefault" for t in threading.enumerate())
    # A corrupt block past the stream's first 32 MiB slice (the slice before it, with the
    # header, was consumed and the thread started): the stream fails, the thread is stopped
    # and joined all the same.
    big = {"x": torch.randn(12 << 20)}  # 48 MiB
    with CheckpointManager(tmp_path / "b") as mgr:
        mgr.save(1, {"model": big})
    storage = LocalStorage(str(tmp_path / "b"))
    entry = storage.read_manifest(1).files[name]
    (path,) = (tmp_path / "b").glob(f"*/{name}")
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="does not match"):
        payload.read_group(storage, 1, name, entry, {"x": torch.empty(12 << 20)})
    assert len(made) == 2
    assert made[1]._thread is None
    assert not any(t.name == "ckptstore-prefault" for t in threading.enumerate())

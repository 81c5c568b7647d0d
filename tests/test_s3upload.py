"""The S3 writer (``ckptstore.storage.s3upload.S3Upload``) against moto's S3 server on loopback.

Every request goes over HTTP to the server (``tests/s3server.py``), whose request log shows
what reached the wire. The one fault that cannot be caused from outside, bytes changed
between the writer's hashing and the server, is made by wrapping the writer's own request
submission (as ``tests/faults.py`` wraps the storage primitives).
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import crc32c
from _helpers import HashCounter, make_state, step_dir
from s3server import S3Endpoint

from ckptstore import CheckpointManager, IntegrityError
from ckptstore.storage import open_storage, s3upload
from ckptstore.storage.remote import FsspecStorage
from ckptstore.storage.s3upload import S3Upload, upload_fs
from ckptstore.tiers.replica import ReplicaError, Replicator

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
PROBE = ".ckptstore-probe"  # the key suffix of the store probe's object


@pytest.fixture
def key(s3: S3Endpoint) -> str:
    return f"{s3.bucket}/{s3.unique_prefix()}/obj"


def write_all(w: S3Upload, data: bytes, chunk: int) -> None:
    for i in range(0, len(data), chunk):
        w.write(memoryview(data)[i : i + chunk])


def upload(w: S3Upload, data: bytes, chunk: int) -> None:
    """Write ``data`` and publish it; on failure abort, as ``Pending.open`` does."""
    try:
        write_all(w, data, chunk)
        w.close()
    except BaseException:
        w.abort()
        raise


def b64crc(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def sent(s3: S3Endpoint) -> list[Any]:
    """The requests the server received, less the store probe's (once per client and bucket)."""
    return [r for r in s3.requests() if not r.path.endswith(PROBE)]


def uploads_of(s3: S3Endpoint, path: str) -> list[str]:
    bucket, _, k = path.partition("/")
    out = s3.client.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=k)
    return [u["UploadId"] for u in out.get("Uploads", [])]


def test_small_object_is_one_put_checked_by_its_crc_and_md5(s3: S3Endpoint, key: str) -> None:
    data = os.urandom(3 * MiB + 5)
    s3.requests.clear()
    w = S3Upload(s3.client, key)
    write_all(w, data, 1 * MiB + 3)
    assert w.nbytes == len(data)
    assert w.crc == crc32c.crc32c(data)
    assert not w.verified
    w.close()
    assert w.verified
    reqs = [(r.method, sorted(r.query)) for r in sent(s3)]
    assert reqs == [("PUT", [])]  # one PutObject, no multipart
    assert s3.client.cat_file(key) == data
    bucket, _, k = key.partition("/")
    head = s3.client.call_s3("head_object", Bucket=bucket, Key=k, ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == b64crc(data)  # the object's CRC32C went with it


def test_large_object_goes_in_parts_with_its_full_object_crc(s3: S3Endpoint, key: str) -> None:
    data = os.urandom(13 * MiB + 7)
    s3.requests.clear()
    w = S3Upload(s3.client, key, part=5 * MiB, single_put=5 * MiB, in_flight=2)
    write_all(w, data, 3 * MiB + 1)  # writes straddle the parts
    w.close()
    assert w.verified
    reqs = [(r.method, "uploads" in r.query, r.query.get("partNumber")) for r in sent(s3)]
    assert reqs[0] == ("POST", True, None)
    assert sorted(p for m, _, p in reqs if m == "PUT") == ["1", "2", "3"]
    assert reqs[-1][0] == "POST"
    assert len(reqs) == 5  # completed once
    assert s3.client.cat_file(key) == data
    bucket, _, k = key.partition("/")
    head = s3.client.call_s3("head_object", Bucket=bucket, Key=k, ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == b64crc(data)  # the manifest's whole-file CRC32C
    assert head["ETag"].strip('"').endswith("-3")


def test_object_outgrowing_one_put_is_sent_as_parts(s3: S3Endpoint, key: str) -> None:
    data = os.urandom(11 * MiB)
    w = S3Upload(s3.client, key, part=5 * MiB, single_put=10 * MiB)
    write_all(w, data, 4 * MiB)  # held for one PUT until 10 MiB, then parts
    w.close()
    assert s3.client.cat_file(key) == data
    assert s3.client.info(key)["ETag"].strip('"').endswith("-3")


class Corrupting:
    """Flips a byte of the body of the ``nth`` request of ``method`` after it was hashed."""

    def __init__(self, method: str, nth: int = 1) -> None:
        self.method = method
        self.nth = nth
        self.seen = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        submit = S3Upload._submit

        def wrapped(w: S3Upload, method: str, **kw: Any) -> Any:
            if method == self.method and not kw["Key"].endswith(PROBE):
                self.seen += 1
                if self.seen == self.nth:
                    sent = kw["Body"]  # a streamed body (s3upload._Body) reads as a file
                    body = bytearray(sent.read() if hasattr(sent, "read") else sent)
                    body[len(body) // 2] ^= 0x10
                    kw["Body"] = body
            return submit(w, method, **kw)

        monkeypatch.setattr(S3Upload, "_submit", wrapped)


def test_a_part_changed_on_the_way_is_caught_and_the_upload_aborted(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    Corrupting("upload_part", nth=2).install(monkeypatch)
    w = S3Upload(s3.client, key, part=5 * MiB, single_put=5 * MiB)
    with pytest.raises(IntegrityError, match=r"part 2.*changed on the way"):
        upload(w, os.urandom(12 * MiB), 2 * MiB)
    assert uploads_of(s3, key) == []  # aborted, nothing billed
    assert not s3.client.exists(key)


def test_a_failing_part_aborts_the_multipart_upload(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    submit = S3Upload._submit

    def refuse_third(w: S3Upload, method: str, **kw: Any) -> Any:
        if method == "upload_part" and kw["PartNumber"] == 3:
            kw["PartNumber"] = 10_001  # past S3's limit: the server refuses it (400)
        return submit(w, method, **kw)

    monkeypatch.setattr(S3Upload, "_submit", refuse_third)
    w = S3Upload(s3.client, key, part=5 * MiB, single_put=5 * MiB)
    with pytest.raises(OSError, match=r"(?i)part.?number"):
        upload(w, os.urandom(16 * MiB), 4 * MiB)
    assert uploads_of(s3, key) == []
    assert not s3.client.exists(key)


def replica_store(s3: S3Endpoint) -> FsspecStorage:
    """A fresh prefix on the module's own client (a client costs a second to make)."""
    prefix = s3.unique_prefix()
    return FsspecStorage(s3.client, f"{s3.bucket}/{prefix}", s3.url(prefix))


def payload_gets(s3: S3Endpoint) -> list[str]:
    return [r.path for r in s3.requests() if r.method == "GET" and r.path.endswith(".safetensors")]


def test_replica_upload_is_checked_without_reading_back(tmp_path: Path, s3: S3Endpoint) -> None:
    root = tmp_path / "a"
    with CheckpointManager(root) as plain:
        plain.save(1, make_state(1))
    local = open_storage(root)
    for read_back, gets in ((None, False), (True, True)):
        replica = replica_store(s3)
        s3.requests.clear()
        assert Replicator(local, replica, read_back=read_back, retention=False).upload_step(1)
        assert bool(payload_gets(s3)) is gets  # the default reads nothing back
        assert replica.list_steps() == [1]
        for name, entry in local.read_manifest(1).files.items():
            assert replica.checksum_file(1, name) == (entry.bytes, entry.crc32c)


def test_replica_upload_changed_on_the_way_leaves_nothing(
    tmp_path: Path, s3: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "a"
    with CheckpointManager(root) as plain:
        plain.save(1, make_state(1))
    replica = replica_store(s3)
    Corrupting("put_object").install(monkeypatch)
    up = Replicator(open_storage(root), replica, retention=False)
    up.recover()
    with pytest.raises(ReplicaError, match="changed on the way"):
        up.wait()
    up.close(wait=False)
    assert s3.client.find(replica.path) == []  # nothing of the step is there
    assert not (root / step_dir(1) / "replicated").exists()


def test_a_store_refusing_checksum_arguments_is_asked_without_them(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.storage import s3upload

    monkeypatch.setattr(s3upload, "_takes_checksums", {})
    monkeypatch.setattr(s3upload, "_store_checks", {})  # a store not probed yet
    call = S3Upload._call
    refused: list[str] = []

    def old_store(w: S3Upload, method: str, **kw: Any) -> Any:
        if any(k.startswith("Checksum") for k in kw):  # what an older S3 clone answers
            refused.append(method)
            raise OSError(f"InvalidArgument: x-amz-checksum-crc32c is not supported ({method})")
        return call(w, method, **kw)

    monkeypatch.setattr(S3Upload, "_call", old_store)
    data = os.urandom(2 * MiB)
    w = S3Upload(s3.client, key)
    upload(w, data, MiB)
    w2 = S3Upload(s3.client, key + "2")
    upload(w2, data, MiB)
    assert refused == ["put_object"]  # asked once, then remembered
    assert w.verified  # Content-MD5 and the ETag still checked it
    assert s3.client.cat_file(key) == s3.client.cat_file(key + "2") == data


def test_parts_grow_so_any_object_fits_the_part_limit(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.storage import s3upload

    monkeypatch.setattr(s3upload, "GROW_EVERY", 2)
    data = os.urandom(31 * MiB)
    s3.requests.clear()
    upload(S3Upload(s3.client, key, part=5 * MiB, single_put=5 * MiB), data, 3 * MiB)
    parts = [r for r in sent(s3) if r.method == "PUT"]
    assert len(parts) == 5  # 5 + 5 MiB, then 10 + 10, then the last 1 MiB (6 at 5 MiB)
    assert s3.client.cat_file(key) == data
    assert s3.client.info(key)["ETag"].strip('"').endswith("-5")


# ---- what the store checks: probed once, then each body checked the cheapest honest way ----


async def not_asking(coro: Any) -> Any:
    """s3upload._asking, less the header: the store is never asked for a CRC32C."""
    return await coro


def test_the_store_is_probed_once_and_moto_answers_the_crc32c_it_computes(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3upload, "_store_checks", {})
    s3.requests.clear()
    data = os.urandom(2 * MiB)
    w = S3Upload(s3.client, key)
    upload(w, data, MiB)
    w2 = S3Upload(s3.client, key + "2", part=5 * MiB, single_put=5 * MiB)
    upload(w2, data * 3, MiB)  # in parts: each part's CRC32C answered by the server
    probes = [r.method for r in s3.requests() if r.path.endswith(PROBE)]
    assert probes == ["PUT", "PUT", "DELETE"]  # a wrong CRC32C taken, then one asked for
    assert s3upload._store_checks == {(upload_fs(s3.client), s3.bucket): s3upload.COMPUTES}
    assert w.verified  # checked by the CRC32Cs the server answered
    assert w2.verified
    assert not s3.client.exists(key + PROBE)
    assert s3.client.cat_file(key) == data
    assert s3.client.cat_file(key + "2") == data * 3


def test_a_part_changed_on_the_way_is_caught_by_the_crc32c_the_server_answers(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3upload, "_store_checks", {})
    Corrupting("upload_part", nth=2).install(monkeypatch)
    w = S3Upload(s3.client, key, part=5 * MiB, single_put=5 * MiB)
    with pytest.raises(IntegrityError, match=r"server's CRC32C of part 2.*changed on the way"):
        upload(w, os.urandom(12 * MiB), 2 * MiB)
    assert uploads_of(s3, key) == []
    assert not s3.client.exists(key)


def test_a_store_that_checks_nothing_is_checked_by_md5_and_etag(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that neither refuses a wrong CRC32C nor computes one: Content-MD5 and ETag."""
    monkeypatch.setattr(s3upload, "_store_checks", {})
    monkeypatch.setattr(s3upload, "_asking", not_asking)  # moto then computes no CRC32C
    data = os.urandom(3 * MiB)
    w = S3Upload(s3.client, key)
    upload(w, data, MiB)
    assert s3upload._store_checks[(upload_fs(s3.client), s3.bucket)] == s3upload.MD5
    assert w.verified
    assert s3.client.cat_file(key) == data
    Corrupting("upload_part", nth=2).install(monkeypatch)
    w2 = S3Upload(s3.client, key + "2", part=5 * MiB, single_put=5 * MiB)
    with pytest.raises(IntegrityError, match=r"ETag of part 2.*changed on the way"):
        upload(w2, os.urandom(12 * MiB), 2 * MiB)
    assert not s3.client.exists(key + "2")


def test_a_reply_without_the_asked_crc32c_leaves_the_file_to_be_read_back(
    tmp_path: Path, s3: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store found to compute CRC32Cs that answers none (a client re-made without the
    hook): nothing checked the bytes on receipt, so the uploader reads them back."""
    root = tmp_path / "a"
    with CheckpointManager(root) as plain:
        plain.save(1, make_state(1))
    monkeypatch.setattr(
        s3upload, "_store_checks", {(upload_fs(s3.client), s3.bucket): s3upload.COMPUTES}
    )
    monkeypatch.setattr(s3upload, "_asking", not_asking)
    replica = replica_store(s3)
    s3.requests.clear()
    assert Replicator(open_storage(root), replica, retention=False).upload_step(1)
    assert payload_gets(s3)  # read back
    for name, entry in open_storage(root).read_manifest(1).files.items():
        assert replica.checksum_file(1, name) == (entry.bytes, entry.crc32c)


class VerifyingStore:
    """S3's own check, which moto lacks: a body whose x-amz-checksum-crc32c is not its CRC32C
    is refused (BadDigest) and nothing stored. Installed where the requests are submitted."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, bool, bool]] = []  # (method, crc32c sent, md5 sent)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        submit = S3Upload._submit

        def checked(w: S3Upload, method: str, **kw: Any) -> Any:
            if method in ("put_object", "upload_part"):
                body = kw["Body"]
                data = body.read() if hasattr(body, "read") else bytes(body)
                if hasattr(body, "seek"):
                    body.seek(0)
                want = kw.get("ChecksumCRC32C")
                if not kw["Key"].endswith(PROBE):
                    self.bodies.append((method, want is not None, "ContentMD5" in kw))
                if want is not None and want != b64crc(data):
                    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
                    fut.set_exception(
                        OSError(
                            "An error occurred (BadDigest): The CRC32C you specified did not "
                            "match the calculated checksum."
                        )
                    )
                    return fut
            return submit(w, method, **kw)

        monkeypatch.setattr(S3Upload, "_submit", checked)


def test_a_store_that_verifies_crc32c_gets_it_instead_of_md5(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3upload, "_store_checks", {})
    store = VerifyingStore()
    store.install(monkeypatch)
    data = os.urandom(12 * MiB)
    w = S3Upload(s3.client, key, part=5 * MiB, single_put=5 * MiB)
    upload(w, data, 2 * MiB)
    assert s3upload._store_checks[(upload_fs(s3.client), s3.bucket)] == s3upload.VERIFIES
    assert w.verified
    assert s3.client.cat_file(key) == data
    # Every body carried its CRC32C for the store to check, and no MD5 was computed.
    assert store.bodies == [("upload_part", True, False)] * 3
    Corrupting("upload_part", nth=2).install(monkeypatch)  # changed after its CRC32C
    w2 = S3Upload(s3.client, key + "2", part=5 * MiB, single_put=5 * MiB)
    with pytest.raises(OSError, match="BadDigest"):
        upload(w2, os.urandom(12 * MiB), 2 * MiB)
    assert uploads_of(s3, key + "2") == []
    assert not s3.client.exists(key + "2")


def test_a_large_put_goes_as_it_is_written_and_a_short_one_leaves_nothing(
    s3: S3Endpoint, key: str
) -> None:
    """Where the store answers the CRC32C it computes, an object said to be large starts its
    PUT at once and its body follows the writes; fewer bytes than said abort it."""
    from ckptstore.tiers.uploadgate import UploadGate

    data = os.urandom(12 * MiB)
    gate = UploadGate()
    w = S3Upload(s3.client, key)
    w.expect(len(data), gate=gate)
    write_all(w, data[: 6 * MiB], MiB)
    deadline = time.monotonic() + 30
    while gate.sent < MiB and time.monotonic() < deadline:
        time.sleep(0.002)
    assert MiB <= gate.sent <= 6 * MiB  # on its way before the rest is written
    write_all(w, data[6 * MiB :], MiB)
    w.close()
    assert w.verified  # by the CRC32C the server answered
    assert s3.client.cat_file(key) == data
    w2 = S3Upload(s3.client, key + "2")
    w2.expect(len(data), gate=UploadGate())
    write_all(w2, data[: 5 * MiB], MiB)
    with pytest.raises(IntegrityError, match="5242880 bytes were written, 12582912 said"):
        w2.close()
    assert not s3.client.exists(key + "2")


@pytest.mark.parametrize("checks", [s3upload.COMPUTES, s3upload.MD5])
def test_each_byte_is_hashed_once_for_the_object_and_every_part(
    s3: S3Endpoint, key: str, monkeypatch: pytest.MonkeyPatch, checks: str
) -> None:
    # The object's CRC32C (the manifest's) and each part's (sent with it, checked by the
    # store) come from one pass over the buffer: held bytes sent as parts when the object
    # outgrows one PUT, parts that straddle the writes, and parts that grow.
    from ckptstore import integrity

    monkeypatch.setattr(s3upload, "GROW_EVERY", 3)
    monkeypatch.setattr(S3Upload, "_store_checks", lambda self: checks)
    part = 5 * MiB + 12_345  # no multiple of the 4 MiB blocks nor of the 1 MiB copies
    data = os.urandom(7 * part + 3 * MiB + 7)
    bodies: list[int] = []
    submit = S3Upload._submit

    def sizes(w: S3Upload, method: str, **kw: Any) -> Any:
        if method == "upload_part":
            bodies.append(len(kw["Body"]))
        return submit(w, method, **kw)

    monkeypatch.setattr(S3Upload, "_submit", sizes)
    counting = HashCounter()
    monkeypatch.setattr(integrity, "_crc32c", counting)
    w = S3Upload(s3.client, key, part=part, single_put=2 * part)
    upload(w, data, 3 * MiB + 1)
    assert counting.hashed == len(data)  # before: twice (the parts hashed again)
    monkeypatch.undo()
    assert w.crc == crc32c.crc32c(data)
    assert w.verified
    # 2 held for one PUT, then the 3rd; parts 4 and 5 twice as large; the tail
    assert bodies == [part, part, part, 2 * part, 2 * part, len(data) - 7 * part]
    assert s3.client.cat_file(key) == data
    bucket, _, k = key.partition("/")
    head = s3.client.call_s3("head_object", Bucket=bucket, Key=k, ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == b64crc(data)
    assert head["ETag"].strip('"').endswith("-6")

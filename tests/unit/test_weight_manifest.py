"""The blob digest (a sha256 tree over 4 MiB leaves) and the manifest checks a puller relies on."""

from __future__ import annotations

import hashlib
import os

import msgspec

from astraflow.weights.manifest import LEAF_BYTES, blob_digest, build_manifest, check_manifest, root_digest


def test_digest_depends_on_the_bytes_only() -> None:
    blob = os.urandom(LEAF_BYTES * 2 + 12345)
    by_leaf = build_manifest("p", 1, blob, LEAF_BYTES)
    by_small = build_manifest("p", 1, blob, 1 << 20)
    assert by_leaf.sha256 == by_small.sha256 == blob_digest(blob)
    leaves = [hashlib.sha256(blob[i : i + LEAF_BYTES]).hexdigest() for i in range(0, len(blob), LEAF_BYTES)]
    assert by_leaf.chunk_sha256 == leaves
    assert by_small.chunk_sha256[1] == hashlib.sha256(blob[1 << 20 : 2 << 20]).hexdigest()
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    assert blob_digest(bytes(flipped)) != by_leaf.sha256
    assert blob_digest(blob[:-1]) != by_leaf.sha256
    assert by_leaf.sha256 != hashlib.sha256(blob).hexdigest()  # tagged: never a plain sha256
    assert blob_digest(b"") == root_digest(0, [])


def test_manifest_whose_chunks_do_not_make_its_digest_is_refused() -> None:
    blob = os.urandom(LEAF_BYTES + 10)
    good = build_manifest("p", 1, blob, LEAF_BYTES)
    assert check_manifest(good, 64 << 20) == ""
    # a server that swaps a chunk's checksum (to serve other bytes) no longer matches the digest
    other = hashlib.sha256(b"other bytes").hexdigest()
    forged = msgspec.structs.replace(good, chunk_sha256=[other, good.chunk_sha256[1]])
    assert "do not make up" in check_manifest(forged, 64 << 20)
    assert "64 hex" in check_manifest(msgspec.structs.replace(good, chunk_sha256=["ab", "cd"]), 64 << 20)
    assert "exceeds" in check_manifest(good, 1 << 20)

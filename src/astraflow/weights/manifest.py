"""Describe a weight blob for transfer: total size, chunk layout, the sha256 of each chunk, and the
blob's digest: a sha256 tree over fixed 4 MiB leaves, so it is computed on several cores at once
and, when the chunks are the leaves, checked by checking the chunks (no second pass over the bytes)."""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from astraflow.protocol.messages import WeightManifest

LEAF_BYTES = 4 << 20
"""Leaf size of the blob digest; also the weight server's default chunk size (chunks = leaves)."""
_TREE_TAG = b"astraflow-weights-tree-v1\x00"
"""Prefix of the root's input, so a root never equals the sha256 of some blob's plain bytes."""
HASH_THREADS = 16
"""At most this many hashing threads a process."""
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def hash_pool() -> ThreadPoolExecutor:
    """The process's hashing threads (hashlib releases the GIL on large buffers, so they run in
    parallel): one a core up to HASH_THREADS. A pull checks each chunk as it lands, so these threads
    bound a fast link's pull (about 1.1 GB/s of sha256 a thread on an H100 host's cores)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max(1, min(HASH_THREADS, os.cpu_count() or 1)), thread_name_prefix="astraflow-sha"
            )
        return _pool


def _sha(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def span_digests(view: memoryview, size: int) -> list[str]:
    """Hex sha256 of each `size`-byte piece of `view` (the last one shorter), hashed in parallel."""
    view = view.cast("B") if view.format != "B" else view
    pieces = [view[i : i + size] for i in range(0, len(view), size)]
    if len(pieces) <= 1:
        return [_sha(p) for p in pieces]
    return list(hash_pool().map(_sha, pieces))


def root_digest(nbytes: int, leaves: list[str]) -> str:
    """The blob digest from its leaves' hex sha256s (LEAF_BYTES each, the last one shorter)."""
    h = hashlib.sha256(_TREE_TAG + nbytes.to_bytes(8, "little"))
    for leaf in leaves:
        h.update(bytes.fromhex(leaf))
    return h.hexdigest()


def blob_digest(blob: bytes | memoryview) -> str:
    """The digest of a whole blob (what a version's `sha256` is): a tree over its 4 MiB leaves."""
    view = memoryview(blob).cast("B")
    return root_digest(len(view), span_digests(view, LEAF_BYTES))


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """How many chunks a blob of nbytes splits into (0 for an empty blob)."""
    return -(-nbytes // chunk_bytes)


def chunk_span(manifest: WeightManifest, index: int) -> tuple[int, int]:
    """The [start, end) byte range of chunk `index`."""
    start = index * manifest.chunk_bytes
    return start, min(start + manifest.chunk_bytes, manifest.nbytes)


def build_manifest(
    policy: str,
    version: int,
    blob: bytes | memoryview,
    chunk_bytes: int,
    *,
    kind: str = "full",
    format: str = "safetensors",
) -> WeightManifest:
    """Chunk a blob and checksum it; the manifest is what a client verifies against. With chunks of
    LEAF_BYTES (the default) the bytes are hashed once; other chunk sizes hash them twice."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    view = memoryview(blob).cast("B")
    chunks = span_digests(view, chunk_bytes)
    leaves = chunks if chunk_bytes == LEAF_BYTES else span_digests(view, LEAF_BYTES)
    return WeightManifest(
        policy=policy,
        version=version,
        kind=kind,
        format=format,
        nbytes=len(view),
        chunk_bytes=chunk_bytes,
        chunk_sha256=chunks,
        sha256=root_digest(len(view), leaves),
    )


def check_manifest(manifest: WeightManifest, max_chunk_bytes: int) -> str:
    """Why a manifest is not self-consistent or exceeds our limits ("" when it is fine)."""
    if manifest.nbytes < 0 or manifest.chunk_bytes <= 0:
        return f"bad sizes nbytes={manifest.nbytes} chunk_bytes={manifest.chunk_bytes}"
    if manifest.chunk_bytes > max_chunk_bytes:
        return f"chunk_bytes {manifest.chunk_bytes} exceeds this client's limit {max_chunk_bytes}"
    if len(manifest.chunk_sha256) != chunk_count(manifest.nbytes, manifest.chunk_bytes):
        return f"{len(manifest.chunk_sha256)} chunk checksums for {manifest.nbytes} bytes"
    if any(len(c) != 64 for c in manifest.chunk_sha256):
        return "a chunk checksum is not 64 hex digits"
    if manifest.chunk_bytes == LEAF_BYTES:
        try:
            root = root_digest(manifest.nbytes, manifest.chunk_sha256)
        except ValueError:
            return "a chunk checksum is not hex"
        if root != manifest.sha256:
            return "the chunk checksums do not make up the blob's digest"
    return ""

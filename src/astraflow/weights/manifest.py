"""Describe a weight blob for transfer: total size, chunk layout, sha256 of the whole and each chunk."""

from __future__ import annotations

import hashlib

from astraflow.protocol.messages import WeightManifest


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
    """Chunk a blob and checksum it; the manifest is what a client verifies against."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    view = memoryview(blob).cast("B")
    chunks = [hashlib.sha256(view[i : i + chunk_bytes]).hexdigest() for i in range(0, len(view), chunk_bytes)]
    return WeightManifest(
        policy=policy,
        version=version,
        kind=kind,
        format=format,
        nbytes=len(view),
        chunk_bytes=chunk_bytes,
        chunk_sha256=chunks,
        sha256=hashlib.sha256(view).hexdigest(),
    )


def check_manifest(manifest: WeightManifest, max_chunk_bytes: int) -> str:
    """Why a manifest is not self-consistent or exceeds our limits ("" when it is fine)."""
    if manifest.nbytes < 0 or manifest.chunk_bytes <= 0:
        return f"bad sizes nbytes={manifest.nbytes} chunk_bytes={manifest.chunk_bytes}"
    if manifest.chunk_bytes > max_chunk_bytes:
        return f"chunk_bytes {manifest.chunk_bytes} exceeds this client's limit {max_chunk_bytes}"
    if len(manifest.chunk_sha256) != chunk_count(manifest.nbytes, manifest.chunk_bytes):
        return f"{len(manifest.chunk_sha256)} chunk checksums for {manifest.nbytes} bytes"
    return ""

"""The embedded torch engine's options, in a module without torch: `astraflow up` checks a recipe's
engine options before any process starts without importing torch (pyproject: astraflow.options)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TorchEngineConfig(BaseModel):
    """Options of the embedded torch engine (recipe: policy.engine_options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_batch: int = Field(64, ge=1)
    """Most sequences decoded together (KV-cache slots)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype; sampling always runs in float32."""
    batch_wait_s: float = Field(0.002, ge=0)
    """When idle, how long the decode thread waits for more requests before starting a batch that is
    not full (requests arriving later join the running batch at its next step)."""
    max_seq_len: int = Field(2048, ge=2)
    """Longest prompt plus completion of one sequence; the KV cache holds max_batch slots this long."""
    cuda_graphs: bool = True
    """On a GPU, replay each decode step as a CUDA graph (one per batch-size bucket)."""
    kernels: Literal["auto", "triton", "torch"] = "auto"
    """Decode-step kernels on a GPU: Triton when it is installed (auto), Triton, or plain PyTorch."""
    decode_loop: Literal["sync", "overlap"] = "sync"
    """How the decode thread steps (docs/engine.md): `sync` reads each step's tokens back before it
    builds the next step; `overlap` launches step N+1 from step N's tokens kept on the device and does
    step N's host work while it runs (a finished row costs one discarded extra step)."""
    admit_min_free: int = Field(16, ge=0)
    """While rows decode, admit queued requests only once this many slots are free (capped at
    max_batch) or everything queued fits, taking whole same-prompt groups in queue order and skipping
    one that does not fit (engines/slot_admission.py, docs/engine.md). 0: admit into every free slot
    at every step, in queue order, splitting groups."""
    admit_max_wait: int = Field(32, ge=0)
    """Decode steps with free slots that the request at the front of the queue may be passed over
    (held back under admit_min_free, or its group not fitting); then the front of the queue is admitted
    into whatever is free, splitting its group if need be."""
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    """A version applied while rows are decoding (docs/engine.md): `recompute` rebuilds the running
    rows' KV under it, so each token's logprob is exactly that of the version it is tagged with (a
    prefill of every running row); `keep` leaves the KV the earlier versions wrote, so later tokens are
    sampled by the new weights over it: each logprob is still exactly the distribution its token was
    sampled from, but not one version's alone."""

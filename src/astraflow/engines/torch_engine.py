"""The embedded rollout engine: a transformers causal LM behind our own batched decode loop.

One background thread owns the model. Coroutines enqueue requests; the thread takes up to
`max_batch` of them, decodes them together (left-padded, with a KV cache) and resolves each
caller's future. New weights are staged by `load_weights` and copied into the parameters between
two decode steps, so an in-flight sequence carries on under the new version and every token records
the version that produced it; the KV cache is then recomputed under the new weights, so every
behaviour logprob is exactly that of the version it is tagged with. What this does not do: requests that arrive while a batch is decoding
wait for that batch to finish (no continuous batching).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from astraflow import log
from astraflow.engines.base import Completion, GenerationRequest, RolloutEngine
from astraflow.engines.device import resolve_device
from astraflow.engines.sampling import processed_logprobs
from astraflow.errors import AstraflowError

_log = log.get("engines.torch")


class TorchEngineConfig(BaseModel):
    """Options of the embedded torch engine (recipe: policy.engine_options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_batch: int = Field(64, ge=1)
    """Most sequences decoded together in one batch."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype; sampling always runs in float32."""
    batch_wait_s: float = Field(0.002, ge=0)
    """How long the decode thread waits for more requests before starting a batch that is not full."""


@dataclass
class _Pending:
    """One queued request and where to deliver its completion."""

    request: GenerationRequest
    future: asyncio.Future[Completion]
    loop: asyncio.AbstractEventLoop


@dataclass
class _Row:
    """Decode state of one sequence of the running batch."""

    pending: _Pending
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    top_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF; return (tokens, logprob under the processed
    distribution of engines/sampling.py: temperature, top-k, top-p, renormalised).
    logits [B, V] float32; temperature, top_p, uniforms, top_k [B]."""
    logp = processed_logprobs(logits, temperature, top_p, 0 if top_k is None else top_k)
    filtered = bool((top_p < 1.0).any()) or (top_k is not None and bool((top_k > 0).any()))
    if filtered:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    else:
        sorted_logp, order = logp, None
    cdf = sorted_logp.exp().cumsum(dim=-1)
    # Scale by the total so float rounding in the cumsum can never push u past the last bucket.
    u = (uniforms.clamp_min(1e-12) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, u).clamp_max(cdf.shape[-1] - 1)
    chosen_logp = sorted_logp.gather(-1, idx).squeeze(-1)
    tokens = idx.squeeze(-1) if order is None else order.gather(-1, idx).squeeze(-1)
    return tokens, chosen_logp


class TorchEngine(RolloutEngine):
    """Batched sampling with per-token logprobs and versions, and in-place weight updates."""

    Config = TorchEngineConfig

    def __init__(
        self,
        model_path: str,
        config: TorchEngineConfig | None = None,
        *,
        seed: int = 0,
        device: str = "auto",
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config if config is not None else TorchEngineConfig()
        self.device = torch.device(resolve_device(device))
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=getattr(torch, self.config.dtype)
            )
        except OSError as exc:
            raise AstraflowError(
                f"cannot load model from {model_path!r}: {exc}",
                hint="create one with `astraflow model init --arch qwen3 --preset tiny --out DIR`",
            ) from exc
        # transformers wraps PreTrainedModel.to with functools.wraps, which hides the bound signature
        self.model.to(self.device).eval()  # type: ignore[arg-type]
        self.model.requires_grad_(False)
        self._params = self.model.state_dict()
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        pad = self.model.config.pad_token_id
        self._pad_id = int(pad) if pad is not None else 0
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._version = 0
        self._queue: deque[_Pending] = deque()
        self._staged: tuple[int, Mapping[str, Any]] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._applied = threading.Condition(threading.Lock())
        self._thread = threading.Thread(target=self._worker, name="torch-engine", daemon=True)
        self._thread.start()

    # ----- the contract -------------------------------------------------------------------------

    async def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request; requests of concurrent callers are decoded in one batch."""
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.extend(_Pending(r, f, loop) for r, f in zip(requests, futures, strict=True))
            self._cond.notify()
        return list(await asyncio.gather(*futures))

    def load_weights(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Stage new weights; the decode thread copies them in before its next step."""
        unknown = [k for k in state_dict if k not in self._params]
        if unknown:
            raise KeyError(f"weights for unknown parameters: {unknown[:5]}")
        with self._cond:
            if self._staged is not None:
                # A newer version supersedes one not yet applied; merge so partial updates compose.
                merged = dict(self._staged[1])
                merged.update(state_dict)
                state_dict = merged
            self._staged = (version, state_dict)
            self._cond.notify()

    @property
    def version(self) -> int:
        """The weight version decode steps currently use."""
        return self._version

    def capacity(self) -> int:
        """Most sequences decoded together."""
        return self.config.max_batch

    def close(self) -> None:
        """Stop the decode thread; queued requests fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ----- extras -------------------------------------------------------------------------------

    def wait_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until weights of `version` (or newer) are in use; False on timeout."""
        with self._applied:
            return self._applied.wait_for(lambda: self._version >= version, timeout=timeout)

    # ----- the decode thread --------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._queue or self._staged is not None)
                if self._queue and not self._closed:
                    # Concurrent callers enqueue within a moment of each other; gather them into one batch.
                    deadline = time.monotonic() + self.config.batch_wait_s
                    while len(self._queue) < self.config.max_batch and not self._closed:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                if self._closed:
                    failed = list(self._queue)
                    self._queue.clear()
                    break
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.config.max_batch))]
            self._apply_staged()
            if batch:
                try:
                    self._decode(batch)
                except Exception as exc:  # deliver the failure to the callers instead of killing the thread
                    _log.exception("decode failed")
                    for p in batch:
                        _resolve(p, exc=exc)
        for p in failed:
            _resolve(p, exc=RuntimeError("engine closed"))

    def _apply_staged(self) -> bool:
        """Copy staged weights into the parameters; True when something was applied."""
        with self._cond:
            staged, self._staged = self._staged, None
        if staged is None:
            return False
        version, state_dict = staged
        with torch.no_grad():
            for name, value in state_dict.items():
                self._params[name].copy_(torch.as_tensor(value), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with self._applied:
            self._version = version
            self._applied.notify_all()
        return True

    @torch.no_grad()
    def _decode(self, batch: list[_Pending]) -> None:
        for p in [p for p in batch if p.request.max_new_tokens <= 0]:
            _resolve(p, Completion([], [], [], "length"))
        batch = [p for p in batch if p.request.max_new_tokens > 0]
        if not batch:
            return
        rows = []
        for p in batch:
            gen = None
            if p.request.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.request.seed)
            rows.append(_Row(p, gen))
        lengths = [len(p.request.prompt_ids) for p in batch]
        if min(lengths) == 0:
            raise ValueError("a generation request needs at least one prompt token")
        width = max(lengths)
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - lengths[i] :] = torch.tensor(p.request.prompt_ids, dtype=torch.long)
            mask[i, width - lengths[i] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        temperature = torch.tensor([p.request.temperature for p in batch], device=self.device)
        top_p = torch.tensor([p.request.top_p for p in batch], device=self.device)
        top_k = torch.tensor([p.request.top_k for p in batch], device=self.device)
        cache = None
        active = list(range(len(rows)))
        seq = ids
        step_ids, step_pos = ids, positions
        while active:
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: cache},
            )
            cache = getattr(out, self._cache_kw)
            logits = out.logits[:, -1, :].float()
            uniforms = torch.rand(len(active), generator=self._generator, device=self.device)
            for j, r in enumerate(active):
                gen = rows[r].generator
                if gen is not None:
                    uniforms[j] = torch.rand(1, generator=gen, device=self.device)[0]
            tokens, logps = sample_tokens(logits, temperature, top_p, uniforms, top_k)
            version = self._version
            keep: list[int] = []
            for j, (tok, lp) in enumerate(zip(tokens.tolist(), logps.tolist(), strict=True)):
                row = rows[active[j]]
                row.tokens.append(tok)
                row.logprobs.append(lp)
                row.versions.append(version)
                req = row.pending.request
                if tok in req.stop_ids:
                    row.finish_reason = "stop"
                elif len(row.tokens) >= req.max_new_tokens:
                    row.finish_reason = "length"
                else:
                    keep.append(j)
                    continue
                _resolve(row.pending, Completion(row.tokens, row.logprobs, row.versions, row.finish_reason))
            if not keep:
                break
            if len(keep) < len(active):
                # Drop finished rows from the batch and the KV cache so they cost nothing further.
                sel = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(sel)
                tokens, mask, seq, step_pos = tokens[sel], mask[sel], seq[sel], step_pos[sel]
                temperature, top_p, top_k = temperature[sel], top_p[sel], top_k[sel]
                active = [active[j] for j in keep]
            seq = torch.cat([seq, tokens.unsqueeze(-1)], dim=-1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            step_ids, step_pos = tokens.unsqueeze(-1), step_pos[:, -1:] + 1
            # Safe point: every row has taken the same number of steps. When new weights land here,
            # the cache is rebuilt under them, so later logprobs are exactly the new model's.
            if self._apply_staged():
                cache = None
                step_ids, step_pos = seq, (mask.cumsum(-1) - 1).clamp_min(0)


def _resolve(p: _Pending, completion: Completion | None = None, exc: BaseException | None = None) -> None:
    """Hand a result (or failure) to the caller's event loop."""

    def deliver() -> None:
        if p.future.done():
            return
        if exc is not None:
            p.future.set_exception(exc)
        else:
            p.future.set_result(completion)  # type: ignore[arg-type]

    try:
        p.loop.call_soon_threadsafe(deliver)
    except RuntimeError:
        _log.debug("caller's event loop closed before its completion arrived")

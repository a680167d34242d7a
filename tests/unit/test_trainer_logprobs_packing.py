"""Chunked logprobs equal the full computation (values and gradients, per-row sampling settings), and
packed micro-batches give the same loss and gradients as padded ones."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import random
from pathlib import Path

import pytest
import torch

from astraflow.config.recipe import OptimizerConfig, PolicyConfig
from astraflow.engines.sampling import processed_logprobs
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams, TrainSample
from astraflow.trainers import packing
from astraflow.trainers.logprobs import chunked_token_logprobs, full_token_logprobs
from astraflow.trainers.torch_trainer import TorchTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("packing") / "tiny", seed=0)


def _settings(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top-p and top-k, mixing filters on and off."""
    temp = torch.rand(n, generator=gen) + 0.5
    top_p = torch.where(
        torch.rand(n, generator=gen) < 0.5, torch.full((n,), 1.0), torch.rand(n, generator=gen)
    )
    top_k = torch.randint(0, 40, (n,), generator=gen)
    return temp, top_p, top_k


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("filters", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_logprobs_equal_full_values_and_grads(chunk: int, filters: bool, recompute: bool) -> None:
    gen = torch.Generator().manual_seed(chunk)
    n, h, v = 37, 16, 50
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)
    temp, top_p, top_k = _settings(n, gen)
    if not filters:  # the closed-form path: tempered softmax only
        top_p, top_k = torch.ones(n), torch.zeros(n, dtype=torch.long)
    # Targets inside each row's kept set, as sampled tokens are (outside it the logprob is -inf).
    logits = hidden @ weight.t()
    lp_ref = processed_logprobs(logits, temp, top_p, top_k)
    targets = torch.stack([torch.multinomial(row.exp(), 1, generator=gen)[0] for row in lp_ref])
    upstream = torch.randn(n, generator=gen)

    def run(fn: object, **kw: int) -> tuple[torch.Tensor, ...]:
        hh = hidden.clone().requires_grad_(True)
        ww = weight.clone().requires_grad_(True)
        logp, ent = fn(hh, ww, targets, temp, top_p, top_k, **kw)  # type: ignore[operator]
        (logp * upstream).sum().backward()
        assert hh.grad is not None and ww.grad is not None
        return logp, ent, hh.grad, ww.grad

    full = run(full_token_logprobs)
    # recompute=False keeps the forward pass's gradient factor (the closed-form path only).
    chunked = run(chunked_token_logprobs, chunk=chunk, recompute=recompute)
    # The reference is the engine's own distribution function.
    assert torch.allclose(full[0], lp_ref.gather(-1, targets[:, None]).squeeze(-1), atol=1e-5)
    for a, b in zip(full, chunked, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert float(full[2].abs().max()) > 1e-3  # the gradient is not trivially zero


def _samples(seed: int, n: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(4, 19) for _ in range(rng.randrange(2, 6))]
        gen = [rng.randrange(4, 19) for _ in range(rng.randrange(1, 7))]
        out.append(
            TrainSample(
                traj_id=i,
                tokens=prompt + gen,
                loss_mask=[0] * len(prompt) + [1] * len(gen),
                logprobs=[0.0] * len(prompt) + [-2.5] * len(gen),
                versions=[-1] * len(prompt) + [0] * len(gen),
                reward=rng.random(),
                advantage=rng.uniform(-1, 1),
                sampling=SamplingParams(
                    temperature=rng.choice([1.0, 0.7, 1.3]),
                    top_p=rng.choice([1.0, 0.9]),
                    top_k=rng.choice([0, 12]),
                ),
            )
        )
    return out


def test_token_balanced_plan() -> None:
    lengths = [30, 5, 5, 5, 5, 20, 10, 10]
    groups = packing.balance(lengths, 3)
    loads = sorted(sum(lengths[i] for i in g) for g in groups)
    assert loads == [30, 30, 30]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    samples = _samples(0, 9)
    # Two ranks get the same number of micro-batches, and together every sample exactly once.
    per_rank = [packing.plan(samples, micro_batch=4, micro_batch_tokens=20, world=2, rank=r) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) > 1
    assert sorted(i for r in per_rank for g in r for i in g) == list(range(9))


def test_count_plan_groups_sequences_of_like_length() -> None:
    samples = _samples(3, 12)
    lengths = [s.length for s in samples]
    groups = packing.plan(samples, micro_batch=4, micro_batch_tokens=0)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert sorted(i for g in groups for i in g) == list(range(12))
    assert all(g == sorted(g) for g in groups)
    # each micro-batch's lengths lie below the next one's: the shortest four, then the next four
    spans = [(min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in groups]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    # so padded rows waste less than in arrival order
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    arrival = sum(4 * max(lengths[i : i + 4]) for i in range(0, 12, 4))
    assert padded <= arrival and len(set(lengths)) > 3


def test_packed_rows_have_no_padding_and_reset_positions() -> None:
    samples = _samples(1, 5)
    mb = packing.build(samples, pack=True, row_tokens=0, pad_id=0, device=torch.device("cpu"))
    assert mb.input_ids.shape == (1, sum(s.length for s in samples))
    assert mb.attention_mask is None
    starts = (mb.position_ids[0] == 0).nonzero().squeeze(-1).tolist()
    assert starts == [0, *torch.tensor([s.length for s in samples]).cumsum(0)[:-1].tolist()]
    assert int(mb.src.numel()) == sum(sum(s.loss_mask[1:]) for s in samples)


def _policy(model_dir: Path, **options: object) -> PolicyConfig:
    return PolicyConfig(
        model=str(model_dir),
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        trainer_options=options,
    )


def test_packed_and_padded_batches_give_the_same_loss_and_grads(model_dir: Path) -> None:
    batch = _samples(2, 10)
    padded = TorchTrainer(_policy(model_dir, micro_batch=3))
    packed = TorchTrainer(_policy(model_dir, pack=True, micro_batch_tokens=40, pack_row_tokens=24))
    plans = packing.plan(batch, micro_batch=3, micro_batch_tokens=40)
    assert len(plans) > 1  # several token-balanced micro-batches, several rows each
    # Padded rows take plain causal attention (no mask built), packed rows the document mask: the
    # equalities below check one against the other.
    assert all(m.one_per_row for m in padded._micro_batches(batch))
    assert not any(m.one_per_row for m in packed._micro_batches(batch))
    l1, g1 = padded.batch_gradients(batch)
    l2, g2 = packed.batch_gradients(batch)
    assert l1 == pytest.approx(l2, abs=1e-5)
    assert g1.keys() == g2.keys()
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6, rtol=1e-4), name
    assert any(float(g.abs().max()) > 1e-3 for g in g1.values())
    # And a whole step agrees on its metrics.
    m1, m2 = padded.step(batch), packed.step(batch)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-5)
    assert m1["entropy"] == pytest.approx(m2["entropy"], abs=1e-5)


def test_sequences_do_not_attend_across_a_packed_boundary(model_dir: Path) -> None:
    a, b = _samples(3, 2)
    trainer = TorchTrainer(_policy(model_dir, pack=True))
    alone = packing.build([b], pack=True, row_tokens=0, pad_id=0, device=torch.device("cpu"))
    both = packing.build([a, b], pack=True, row_tokens=0, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        lp_alone = trainer.policy_lm(alone)[0][0]
        lp_both = trainer.policy_lm(both)[0][1]
    n = b.length - 1
    assert torch.allclose(lp_alone[:n], lp_both[:n], atol=1e-5)


@pytest.mark.parametrize("pack", [False, True])
def test_rows_widened_to_a_multiple_give_the_same_logprobs(model_dir: Path, pack: bool) -> None:
    # A compiled trainer widens its rows to a multiple of 8 (torch_trainer._COMPILED_WIDTH_MULTIPLE):
    # the padding lies after each row's last sequence, so no real token's logprob moves.
    samples = _samples(4, 5)
    trainer = TorchTrainer(_policy(model_dir, pack=pack))
    cpu = torch.device("cpu")
    plain = packing.build(samples, pack=pack, row_tokens=0, pad_id=0, device=cpu)
    wide = packing.build(samples, pack=pack, row_tokens=0, pad_id=0, device=cpu, width_multiple=8)
    assert plain.input_ids.shape[1] % 8 != 0  # else this case tests nothing
    assert wide.input_ids.shape[1] % 8 == 0 and wide.input_ids.shape[1] > plain.input_ids.shape[1]
    assert wide.input_ids.shape[0] == plain.input_ids.shape[0]
    assert torch.equal(wide.targets, plain.targets) and torch.equal(wide.dst, plain.dst)
    with torch.no_grad():
        lp_plain, ent_plain = trainer.policy_lm(plain)
        lp_wide, ent_wide = trainer.policy_lm(wide)
    assert torch.allclose(lp_plain, lp_wide, atol=1e-5)
    assert torch.allclose(ent_plain, ent_wide, atol=1e-5)
    assert float(lp_plain.abs().sum()) > 0


def test_a_compiled_trainer_builds_aligned_rows(model_dir: Path) -> None:
    # Building micro-batches runs no layer, so nothing compiles here: only the rows' width is checked.
    batch = _samples(5, 9)
    compiled = TorchTrainer(_policy(model_dir, micro_batch=3, compile=True))
    eager = TorchTrainer(_policy(model_dir, micro_batch=3))
    widths = [m.input_ids.shape[1] for m in compiled._micro_batches(batch)]
    plain = [m.input_ids.shape[1] for m in eager._micro_batches(batch)]
    assert all(w % 8 == 0 for w in widths)
    assert any(w % 8 for w in plain)
    assert [-(-w // 8) * 8 for w in plain] == widths

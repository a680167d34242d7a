"""LoRA: only adapters (and also_train parameters) train, and the merged export is the trained model."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_batches import batch  # noqa: E402

from astraflow.config.recipe import OptimizerConfig, PolicyConfig  # noqa: E402
from astraflow.models.init import init_model  # noqa: E402
from astraflow.trainers.torch_trainer import TorchTrainer, token_logprobs  # noqa: E402

torch.set_num_threads(1)


def test_lora_trains_adapters_and_exports_merged_weights(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model_dir = init_model("qwen3", "tiny", tmp_path / "tiny", seed=0)
    pol = PolicyConfig(
        model=str(model_dir),
        optimizer=OptimizerConfig(lr=5e-2, weight_decay=0.0),
        trainer_options={"lora": {"rank": 4, "also_train": ["norm"]}},
    )
    trainer = TorchTrainer(pol)
    before = trainer.export_weights()
    for _ in range(2):
        trainer.step(batch(0))
    after = trainer.export_weights()
    assert before.keys() == after.keys() and not any(".lora_" in k or "base_layer" in k for k in after)
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.norm.weight" in changed
    assert "model.embed_tokens.weight" not in changed  # frozen: neither adapted nor in also_train
    # A plain model loaded with the merged weights computes what the adapted model computes.
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    plain.load_state_dict(after)
    s = batch(1)[0]
    tokens = torch.tensor([s.token_list()])
    attn = torch.ones_like(tokens)
    with torch.no_grad():
        merged = token_logprobs(plain, tokens, attn)
        adapted = token_logprobs(trainer.model, tokens, attn)
        base = token_logprobs(AutoModelForCausalLM.from_pretrained(str(model_dir)), tokens, attn)
    assert torch.allclose(merged, adapted, atol=1e-5)
    assert not torch.allclose(merged, base, atol=1e-3)

"""The PyTorch trainer's options, in a module without torch: `astraflow up` checks a recipe's trainer
options before any process starts without importing torch (pyproject: astraflow.options)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.trainers.lora import LoraOptions


class TorchTrainerConfig(BaseModel):
    """Options of the PyTorch trainer (recipe: policy.trainer_options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and optimizer-state dtype (float32 with compute_dtype bfloat16 = fp32 master weights)."""
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    """Forward/backward dtype; None = dtype. Autocast on one process, FSDP2 mixed precision on several."""
    micro_batch: int = Field(64, ge=1)
    """Sequences per forward/backward pass (gradient accumulation inside one update), taken in order of
    length so that a padded row's sequences are of like length."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Tokens per forward/backward pass instead of micro_batch: sequences balanced by tokens; 0 = off."""
    pack: bool = False
    """Pack several sequences per row without padding (document masking through position ids)."""
    pack_row_tokens: int = Field(0, ge=0)
    """Longest packed row in tokens (first-fit decreasing); 0 = one row per micro-batch."""
    logprob_chunk: int = Field(2048, ge=1)
    """Tokens whose logits exist at once in the logprob computation (forward and recomputed backward)."""
    logprob_recompute: bool = True
    """Recompute the logits in the backward pass; False keeps a [trained tokens x vocab] gradient factor
    (2 bytes each in bf16) from the forward pass instead: one vocabulary GEMM fewer (no top-p/top-k only)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass to save memory."""
    compile: bool = False
    """torch.compile the decoder and the logprob arithmetic over the vocabulary (first steps compile)."""
    compile_scope: Literal["layers", "model"] = "layers"
    """What one compiled graph covers: each decoder layer (layers) or the whole backbone (model: fewer
    host-side calls per step, a longer first compile); one process only."""
    lora: LoraOptions | None = None
    """Train LoRA adapters (peft) instead of every weight; engines get merged dense weights."""

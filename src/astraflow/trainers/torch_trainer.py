"""The PyTorch trainer: one policy's model, AdamW and objective; one optimizer step per batch.

A batch is split into `policy.minibatches` optimizer updates; each update accumulates gradients
over micro-batches of `micro_batch` sequences, and every micro-batch loss is divided by the trained
tokens of its whole update, so the update's gradient is that of one token-mean. Logprobs are
taken under each row's own sampling settings (temperature, top-k, top-p), like the engine's behaviour logprobs.
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from astraflow import log, plugins
from astraflow.config.recipe import PolicyConfig
from astraflow.engines.device import resolve_device
from astraflow.errors import AstraflowError
from astraflow.losses.base import Loss, LossInputs
from astraflow.protocol.messages import TrainSample
from astraflow.trainers.base import Trainer

_log = log.get("trainers.torch")

_MODEL_FILE = "model.safetensors"
_OPTIM_FILE = "optimizer.pt"
_RNG_FILE = "rng.pt"
_STATE_FILE = "trainer_state.json"


class TorchTrainerConfig(BaseModel):
    """Options of the PyTorch trainer (recipe: policy.trainer_options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and optimizer-state dtype."""
    micro_batch: int = Field(64, ge=1)
    """Sequences per forward/backward pass (gradient accumulation inside one update)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""


def token_logprobs(
    model: Any,
    tokens: torch.Tensor,
    attn: torch.Tensor,
    *,
    temperature: torch.Tensor | float = 1.0,
    top_p: torch.Tensor | float = 1.0,
    top_k: torch.Tensor | int = 0,
    entropy: bool = False,
) -> Any:
    """Logprob of each token given its prefix under the processed sampling distribution of
    engines/sampling.py (temperature, top-k, top-p; scalars or per row [B]), [B, T-1] (position t-1
    holds token t's logprob); with entropy=True also the per-position entropy (no grad)."""
    from astraflow.engines.sampling import processed_logprobs

    logits = model(input_ids=tokens, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    b, t, v = logits.shape

    def per_position(x: torch.Tensor | float) -> torch.Tensor:
        # one setting per row, repeated over its positions (a scalar applies to every row)
        x = torch.as_tensor(x, device=logits.device)
        return x.reshape(-1, 1).expand(b, t).reshape(-1) if x.dim() > 0 else x.expand(b * t)

    logp_all = processed_logprobs(
        logits.reshape(b * t, v), per_position(temperature), per_position(top_p), per_position(top_k)
    ).reshape(b, t, v)
    targets = tokens[:, 1:].unsqueeze(-1)
    logp = logp_all.gather(-1, targets).squeeze(-1)
    if not entropy:
        return logp
    with torch.no_grad():
        probs = logp_all.exp()
        ent = -(probs * logp_all.masked_fill(probs == 0, 0.0)).sum(-1)
    return logp, ent


class TorchTrainer(Trainer):
    """Trains one policy with AdamW and a plug-in objective on CPU or one GPU."""

    Config = TorchTrainerConfig

    def __init__(self, policy: PolicyConfig, *, seed: int = 0, device: str = "auto") -> None:
        from transformers import AutoModelForCausalLM

        self.policy = policy
        self.config = TorchTrainerConfig.model_validate(policy.trainer_options)
        self.device = torch.device(resolve_device(device))
        self.seed = seed
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                policy.model, dtype=getattr(torch, self.config.dtype)
            )
        except OSError as exc:
            raise AstraflowError(
                f"cannot load model from {policy.model!r}: {exc}",
                hint="create one with `astraflow model init --arch qwen3 --preset tiny --out DIR`",
            ) from exc
        # transformers wraps PreTrainedModel.to with functools.wraps, which hides the bound signature
        self.model.to(self.device).train()  # type: ignore[arg-type]
        if self.config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        loss_cls = plugins.load("losses", policy.loss)
        self.loss: Loss = loss_cls(loss_cls.Config.model_validate(policy.loss_options))
        self.ref_model: Any = None
        if self.loss.needs_ref:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        opt = policy.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )
        pad = self.model.config.pad_token_id
        self._pad_id = int(pad) if pad is not None else 0
        self._step = 0

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return self._step

    # ----- one step -----------------------------------------------------------------------------

    def _pad(self, samples: list[TrainSample]) -> dict[str, torch.Tensor]:
        """Right-pad samples into [B, T] tensors (predicted-token views are sliced later)."""
        width = max(len(s.tokens) for s in samples)
        b = len(samples)
        tokens = torch.full((b, width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.float32)
        blogp = torch.zeros((b, width), dtype=torch.float32)
        for i, s in enumerate(samples):
            n = len(s.tokens)
            if not (len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n):
                raise ValueError(
                    f"sample {s.traj_id}: tokens, loss_mask, logprobs and versions differ in length"
                )
            tokens[i, :n] = torch.tensor(s.tokens, dtype=torch.long)
            attn[i, :n] = 1
            mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            blogp[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        dev = self.device
        return {
            # each row's sampling settings: its logprobs are recomputed under the distribution it was drawn from
            "temperature": torch.tensor([s.temperature for s in samples], dtype=torch.float32).to(dev),
            "top_p": torch.tensor([s.top_p for s in samples], dtype=torch.float32).to(dev),
            "top_k": torch.tensor([s.top_k for s in samples], dtype=torch.long).to(dev),
            "tokens": tokens.to(dev),
            "attn": attn.to(dev),
            # The first token is never predicted, so the loss views start at position 1.
            "mask": mask[:, 1:].to(dev),
            "behaviour": blogp[:, 1:].to(dev),
            "adv": adv.to(dev),
        }

    def _micro_batches(self, samples: list[TrainSample]) -> list[dict[str, torch.Tensor]]:
        mb = self.config.micro_batch
        return [self._pad(samples[i : i + mb]) for i in range(0, len(samples), mb)]

    def _inputs(
        self,
        m: dict[str, torch.Tensor],
        logp: torch.Tensor,
        ent: torch.Tensor | None,
        tokens: float,
        seqs: float,
    ) -> LossInputs:
        """LossInputs of micro-batch `m`, normalised by `tokens` trained tokens and `seqs` sequences."""
        return LossInputs(
            logp=logp,
            behaviour_logp=m["behaviour"],
            mask=m["mask"],
            advantages=m["adv"],
            ref_logp=m.get("ref"),
            prox_logp=m.get("prox") if self.loss.needs_prox else None,
            entropy=ent,
            total_tokens=max(tokens, 1.0),
            total_sequences=seqs,
        )

    def _set_lr(self) -> float:
        opt = self.policy.optimizer
        scale = min(1.0, (self._step + 1) / opt.warmup_steps) if opt.warmup_steps > 0 else 1.0
        lr = opt.lr * scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self, batch: list[TrainSample]) -> dict[str, float]:
        """One optimizer step over `batch` (policy.minibatches updates); returns metrics."""
        if not batch:
            raise ValueError("empty batch")
        k = min(self.policy.minibatches, len(batch))
        size = math.ceil(len(batch) / k)
        updates = [self._micro_batches(batch[i : i + size]) for i in range(0, len(batch), size)]
        micros_all = [m for u in updates for m in u]
        wants_prepare = type(self.loss).prepare is not Loss.prepare
        if self.loss.needs_prox or wants_prepare:
            # Logprobs under the parameters before this step's first update.
            with torch.no_grad():
                for m in micros_all:
                    m["prox"] = token_logprobs(
                        self.model,
                        m["tokens"],
                        m["attn"],
                        temperature=m["temperature"],
                        top_p=m["top_p"],
                        top_k=m["top_k"],
                    )
        if self.ref_model is not None:
            with torch.no_grad():
                for m in micros_all:
                    m["ref"] = token_logprobs(
                        self.ref_model,
                        m["tokens"],
                        m["attn"],
                        temperature=m["temperature"],
                        top_p=m["top_p"],
                        top_k=m["top_k"],
                    )
        if wants_prepare:
            batch_tokens = float(sum(float(m["mask"].sum()) for m in micros_all))
            self.loss.prepare(
                [self._inputs(m, m["prox"], None, batch_tokens, float(len(batch))) for m in micros_all]
            )
        lr = self._set_lr()
        losses: list[float] = []
        grad_norms: list[float] = []
        loss_metrics: dict[str, list[float]] = {}
        ent_sum, ent_tokens = 0.0, 0.0
        for micros in updates:
            total = float(sum(float(m["mask"].sum()) for m in micros))
            n_seqs = float(sum(m["tokens"].shape[0] for m in micros))
            self.optimizer.zero_grad(set_to_none=True)
            update_loss = 0.0
            for m in micros:
                logp, ent = token_logprobs(
                    self.model,
                    m["tokens"],
                    m["attn"],
                    entropy=True,
                    temperature=m["temperature"],
                    top_p=m["top_p"],
                    top_k=m["top_k"],
                )
                inputs = self._inputs(m, logp, ent, total, n_seqs)
                loss, metrics = self.loss(inputs)
                loss.backward()
                update_loss += float(loss.detach())
                ent_sum += float((ent * m["mask"]).sum())
                ent_tokens += float(m["mask"].sum())
                for name, value in metrics.items():
                    loss_metrics.setdefault(name, []).append(float(value))
            clip = self.policy.optimizer.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
            self.optimizer.step()
            losses.append(update_loss)
            grad_norms.append(float(norm))
        self._step += 1
        out = self._batch_metrics(batch)
        out.update(
            loss=sum(losses) / len(losses),
            grad_norm=sum(grad_norms) / len(grad_norms),
            entropy=ent_sum / max(ent_tokens, 1.0),
            lr=lr,
        )
        for name, values in loss_metrics.items():
            out[name] = sum(values) / len(values)
        return out

    def _batch_metrics(self, batch: list[TrainSample]) -> dict[str, float]:
        """Rewards, advantages, sizes and staleness of a batch (version before the step = step - 1)."""
        rewards = [s.reward for s in batch]
        advs = [s.advantage for s in batch]
        version = self._step - 1
        stale = []
        for s in batch:
            trained = [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m and v >= 0]
            stale.append(version - min(trained) if trained else 0)
        tokens = sum(sum(s.loss_mask) for s in batch)
        return {
            "reward_mean": _mean(rewards),
            "reward_std": _std(rewards),
            "adv_mean": _mean(advs),
            "adv_std": _std(advs),
            "adv_abs_mean": _mean([abs(a) for a in advs]),
            "staleness_mean": _mean([float(x) for x in stale]),
            "staleness_max": float(max(stale)),
            "tokens": float(tokens),
            "sequences": float(len(batch)),
            "replayed": float(sum(1 for s in batch if s.replay)),
        }

    # ----- weights and checkpoints --------------------------------------------------------------

    def export_weights(self) -> dict[str, Any]:
        """The current weights: name -> detached CPU tensor, a copy later steps do not touch."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: Path) -> None:
        """Write model (safetensors), optimizer, RNG states and step count to directory `path`."""
        from safetensors.torch import save_model

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_model(self.model, str(path / _MODEL_FILE))
        torch.save(self.optimizer.state_dict(), path / _OPTIM_FILE)
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        torch.save(rng, path / _RNG_FILE)
        py_version, py_state, py_gauss = random.getstate()
        state = {"step": self._step, "seed": self.seed, "python_rng": [py_version, list(py_state), py_gauss]}
        # The state file is written last: its presence marks a complete checkpoint.
        (path / _STATE_FILE).write_text(json.dumps(state))

    def load_checkpoint(self, path: Path) -> None:
        """Restore everything save_checkpoint wrote."""
        from safetensors.torch import load_model

        path = Path(path)
        if not (path / _STATE_FILE).exists():
            raise AstraflowError(
                f"no complete trainer checkpoint in {path}", hint="point at a checkpoint directory"
            )
        load_model(self.model, str(path / _MODEL_FILE), device=str(self.device))
        self.optimizer.load_state_dict(
            torch.load(path / _OPTIM_FILE, map_location=self.device, weights_only=True)
        )
        rng = torch.load(path / _RNG_FILE, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(rng["cuda"]))
        state = json.loads((path / _STATE_FILE).read_text())
        py_version, py_state, py_gauss = state["python_rng"]
        random.setstate((py_version, tuple(py_state), py_gauss))
        self._step = int(state["step"])


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

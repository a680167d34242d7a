"""The value model of `advantage = "gae"`: a separate critic trained beside the policy.

The critic is a second copy of the policy's starting model (same config, same initial weights, so it
reads the text as the policy does from the first step) whose output embedding is unused: a linear head
(zero-initialised, so every first value is 0) maps each final hidden state to a value. It is a separate
model, not a head on the policy's own hidden state, so the value loss never moves the weights the
engines sample from, and it has its own AdamW and learning rate (critics usually want a larger one).
It costs a second model's memory and one more forward/backward per micro-batch.

Per step: `prepare` takes the values of every micro-batch before any update (the "old" values), turns
them into per-token GAE advantages and returns (losses/value.py) and puts the advantages into the
micro-batches; `update` takes one clipped-value-loss AdamW step per policy update. One process only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from astraflow.dataflow.estimators import GAEConfig
from astraflow.losses import value as value_loss
from astraflow.trainers.packing import MicroBatch
from astraflow.trainers.policy_lm import PolicyLM, causal_lm

_WEIGHTS = "critic.safetensors"
_OPTIM = "critic_optimizer.pt"


class Critic:
    """A value model over micro-batches: values, GAE advantages and its own optimizer steps."""

    def __init__(
        self,
        model: Any,
        config: GAEConfig,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        grad_clip: float,
        autocast: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        lm = causal_lm(model)
        self.config = config
        self.grad_clip = grad_clip
        self._autocast = autocast
        self.lm = PolicyLM(lm)
        self.backbone: nn.Module = getattr(lm, lm.base_model_prefix)
        param = next(self.backbone.parameters())
        self.head = nn.Linear(lm.config.hidden_size, 1).to(device=param.device, dtype=param.dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self._params = [*self.backbone.parameters(), *self.head.parameters()]
        fused = {"fused": True} if param.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            self._params, lr=lr, betas=betas, weight_decay=weight_decay, **fused
        )
        self._state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """Values of the trained positions as a [B, L] view (zero elsewhere); position j is the state
        before token j+1, where the policy's logprob of that token is taken."""
        with self._autocast():
            h = self.lm.hidden(mb.input_ids, mb.position_ids, mb.attention_mask, causal_only=mb.one_per_row)
            flat = h.reshape(-1, h.shape[-1]).index_select(0, mb.src)
            v = self.head(flat).squeeze(-1).float()
        b, length = mb.view_shape
        at = (mb.dst // length, mb.dst % length)
        return torch.zeros(b, length, dtype=torch.float32, device=v.device).index_put(at, v)

    def prepare(self, micros: list[MicroBatch]) -> dict[str, float]:
        """Old values, GAE advantages (whitened over the step when configured) and returns of every
        micro-batch; each micro-batch's `adv` becomes its [B, L] per-token advantages. Returns metrics."""
        cfg = self.config
        real = [m for m in micros if m.sequences > 0]
        olds: list[torch.Tensor] = []
        advs: list[torch.Tensor] = []
        rets: list[torch.Tensor] = []
        with torch.no_grad():
            for m in real:
                assert m.rewards is not None
                old = self.values(m)
                adv, ret = value_loss.gae(old, m.rewards, m.mask, cfg.gamma, cfg.lam)
                olds.append(old)
                advs.append(adv)
                rets.append(ret)
        raw = advs
        if cfg.whiten and real:
            advs = value_loss.whiten(advs, [m.mask for m in real])
        self._state = {}
        for m, old, adv, ret in zip(real, olds, advs, rets, strict=True):
            m.adv = adv
            self._state[id(m)] = (old, ret)
        if not real:
            return {}
        masks = torch.cat([m.mask.reshape(-1) for m in real]) > 0
        flat_raw = torch.cat([a.reshape(-1) for a in raw])[masks]
        flat_old = torch.cat([o.reshape(-1) for o in olds])[masks]
        flat_ret = torch.cat([r.reshape(-1) for r in rets])[masks]
        return {
            "gae_adv_mean": float(flat_raw.mean()) if flat_raw.numel() else 0.0,
            "gae_adv_std": float(flat_raw.std(unbiased=False)) if flat_raw.numel() else 0.0,
            "gae_adv_abs_mean": float(flat_raw.abs().mean()) if flat_raw.numel() else 0.0,
            "returns_mean": float(flat_ret.mean()) if flat_ret.numel() else 0.0,
            "values_mean": float(flat_old.mean()) if flat_old.numel() else 0.0,
            "value_explained_var": value_loss.explained_variance(
                flat_old, flat_ret, torch.ones_like(flat_ret)
            ),
        }

    def update(self, micros: list[MicroBatch]) -> dict[str, float]:
        """One AdamW step of the clipped value loss over one policy update's micro-batches (token mean
        over the update); an update whose loss or gradient norm is not finite is skipped."""
        real = [m for m in micros if m.sequences > 0 and id(m) in self._state]
        if not real:
            return {}
        total = float(sum(float(m.mask.sum()) for m in real))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=real[0].mask.device)
        clip_fracs: list[float] = []
        for m in real:
            old, ret = self._state[id(m)]
            loss, metrics = value_loss.clipped_value_loss(
                self.values(m), old, ret, m.mask, self.config.value_clip, total
            )
            loss.backward()
            loss_sum += loss.detach()
            clip_fracs.append(metrics["value_clip_frac"])
        norm = torch.nn.utils.clip_grad_norm_(
            self._params, self.grad_clip if self.grad_clip > 0 else float("inf")
        )
        skipped = not (bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(norm)))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        return {
            "value_loss": float(loss_sum),
            "value_grad_norm": float(norm),
            "value_clip_frac": sum(clip_fracs) / len(clip_fracs),
            "value_skipped_updates": float(skipped),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The critic's weights: the backbone's under `backbone.`, the head's under `head.`."""
        out = {f"backbone.{k}": v for k, v in self.backbone.state_dict().items()}
        out.update({f"head.{k}": v for k, v in self.head.state_dict().items()})
        return out

    def save(self, path: Path) -> None:
        """Write the critic's weights (safetensors) and optimizer state into directory `path`."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path / _WEIGHTS)
        )
        torch.save(self.optimizer.state_dict(), path / _OPTIM)

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        from safetensors.torch import load_file

        device = next(self.backbone.parameters()).device
        weights = load_file(str(path / _WEIGHTS), device=str(device))
        self.backbone.load_state_dict({k[9:]: v for k, v in weights.items() if k.startswith("backbone.")})
        self.head.load_state_dict({k[5:]: v for k, v in weights.items() if k.startswith("head.")})
        self.optimizer.load_state_dict(torch.load(path / _OPTIM, map_location=device, weights_only=True))

    @staticmethod
    def present(path: Path) -> bool:
        """Whether checkpoint directory `path` holds a critic."""
        return (path / _WEIGHTS).is_file() and (path / _OPTIM).is_file()

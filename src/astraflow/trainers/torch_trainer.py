"""The PyTorch trainer: one policy's model, AdamW and objective; one optimizer step per batch.

A batch is split into `policy.minibatches` optimizer updates; each update accumulates gradients
over micro-batches of `micro_batch` sequences, and every micro-batch loss is divided by the trained
tokens of its whole update, so the update's gradient is that of one token-mean. An update whose loss
or gradient norm is not finite (on any rank) is skipped: gradients zeroed, no optimizer step
(`skipped_updates` in the step's metrics; the trainer role counts such steps). Logprobs are
taken under each sequence's own sampling settings (temperature, top-p, top-k), like the engine's
behaviour logprobs, from hidden states a chunk of tokens at a time (trainers/logprobs.py). Micro-batches
are padded or packed (trainers/packing.py); under torchrun the model is sharded with FSDP2
(trainers/distributed.py); with `lora` only peft adapters train (trainers/lora.py). With
`advantage = "gae"` a value model trains beside the policy and gives per-token advantages
(trainers/critic.py).

Over 400 lines because it is one class, the trainer's step, whose parts (updates, micro-batches,
the skip rule, checkpoints) share the model's and the optimizer's state; logprobs, packing, LoRA,
the critic and the distributed setup are in their own modules beside it.
"""

from __future__ import annotations

import copy
import json
import math
import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from astraflow import log, plugins
from astraflow.config.recipe import PolicyConfig
from astraflow.engines.device import resolve_device
from astraflow.errors import AstraflowError
from astraflow.losses.base import Loss, LossInputs
from astraflow.protocol.messages import TrainSample
from astraflow.trainers import distributed as dist
from astraflow.trainers import lora, mismatch, packing
from astraflow.trainers.base import Trainer
from astraflow.trainers.critic import Critic
from astraflow.trainers.logprobs import chunked_token_logprobs
from astraflow.trainers.packing import MicroBatch
from astraflow.trainers.policy_lm import PolicyLM, causal_lm, decoder_layers
from astraflow.trainers.torch_trainer_config import TorchTrainerConfig

_log = log.get("trainers.torch")

_MODEL_FILE = "model.safetensors"
_OPTIM_FILE = "optimizer.pt"
_RNG_FILE = "rng.pt"
_STATE_FILE = "trainer_state.json"
_DCP_DIR = "dcp"
_COMPILED_WIDTH_MULTIPLE = 8
"""A compiled trainer pads its rows' width to a multiple of this: inductor specialises its kernels to
an aligned width (a guard on width % 8), so an unaligned step would compile again."""
_CRITIC_DIR = "critic"


def token_logprobs(
    model: Any,
    tokens: torch.Tensor,
    attn: torch.Tensor,
    *,
    temperature: torch.Tensor | float = 1.0,
    top_p: torch.Tensor | float = 1.0,
    top_k: torch.Tensor | int = 0,
    entropy: bool = False,
    chunk: int = 2048,
) -> Any:
    """Logprob of each token given its prefix under the processed sampling distribution, [B, T-1]
    (position t-1 holds token t's logprob); settings are scalars or one per row [B]. With
    entropy=True also the per-position entropy (no grad). Logits are taken `chunk` tokens at a time."""
    b, t = tokens.shape
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    lm = PolicyLM(model, chunk=chunk)
    h = lm.hidden(tokens, pos, attn)[:, :-1].reshape(b * (t - 1), -1)

    def rows(x: torch.Tensor | float | int, dtype: torch.dtype) -> torch.Tensor:
        v = torch.as_tensor(x, dtype=dtype, device=tokens.device).reshape(-1)
        return v.expand(b).repeat_interleave(t - 1)

    weight = causal_lm(model).get_output_embeddings().weight
    logp, ent = chunked_token_logprobs(
        h,
        weight,
        tokens[:, 1:].reshape(-1),
        rows(temperature, torch.float32),
        rows(top_p, torch.float32),
        rows(top_k, torch.long),
        chunk=chunk,
    )
    logp = logp.reshape(b, t - 1)
    return (logp, ent.reshape(b, t - 1)) if entropy else logp


class TorchTrainer(Trainer):
    """Trains one policy with AdamW and a plug-in objective on CPU, one GPU, or FSDP2 over ranks."""

    Config = TorchTrainerConfig

    def __init__(self, policy: PolicyConfig, *, seed: int = 0, device: str = "auto") -> None:
        from transformers import AutoModelForCausalLM

        self.policy = policy
        self.config = cfg = TorchTrainerConfig.model_validate(policy.trainer_options)
        self.sharded = dist.active()
        self.device = dist.init_from_env(device) if self.sharded else torch.device(resolve_device(device))
        self.seed = seed
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            model = AutoModelForCausalLM.from_pretrained(policy.model, dtype=getattr(torch, cfg.dtype))
        except OSError as exc:
            raise AstraflowError(
                f"cannot load model from {policy.model!r}: {exc}",
                hint="create one with `astraflow model init --arch qwen3 --preset tiny --out DIR`",
            ) from exc
        # transformers wraps PreTrainedModel.to with functools.wraps, which hides the bound signature
        model.to(self.device).train()  # type: ignore[arg-type]
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.compile and cfg.compile_scope == "model" and dist.active():
            raise AstraflowError(
                "compile_scope = 'model' does not run on several ranks yet",
                hint="use compile_scope = 'layers' or one trainer process",
            )
        if cfg.compile and cfg.compile_scope == "model":
            getattr(model, model.base_model_prefix).compile()
        elif cfg.compile:
            # Compiled with dynamic shapes from the first step: a micro-batch's rows and width change
            # from step to step, and a layer specialised to the first step's shape would compile again
            # (10-15 s each for a 0.6B model on an H200) when the next step's differs (docs/benchmarks.md,
            # "The trainer's padding on long-tailed lengths"). Not for the whole backbone: not measured.
            for layer in decoder_layers(model):
                layer.compile(dynamic=True)
        loss_cls = plugins.load("losses", policy.loss)
        self.loss: Loss = loss_cls(loss_cls.Config.model_validate(policy.loss_options))
        self._wants_prepare = type(self.loss).prepare is not Loss.prepare
        if self.sharded and (cfg.lora is not None or self._wants_prepare):
            raise AstraflowError(
                "LoRA and objectives that see the whole batch first (prepare) do not run on several ranks yet",
                hint="train with one process (trainer_nproc = 1)",
            )
        compute = getattr(torch, cfg.compute_dtype or cfg.dtype)
        self._autocast = not self.sharded and compute != getattr(torch, cfg.dtype)
        self._compute = compute
        self.ref_model: Any = None
        self._ref_lm: PolicyLM | None = None
        # With plain LoRA the reference is the same model with its adapters off; parameters trained in
        # full (also_train) would move it, so then a frozen copy is kept instead.
        if self.loss.needs_ref and (cfg.lora is None or cfg.lora.also_train):
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
            self._ref_lm = PolicyLM(self.ref_model, chunk=cfg.logprob_chunk)
            if self.sharded:
                dist.shard(self._ref_lm, decoder_layers(self.ref_model), compute)
        if cfg.lora is not None:
            model = lora.wrap(model, cfg.lora, seed=seed)
        self.model: Any = model
        self.policy_lm = PolicyLM(
            model, chunk=cfg.logprob_chunk, fused=cfg.compile, recompute=cfg.logprob_recompute
        )
        if self.sharded:
            dist.shard(self.policy_lm, decoder_layers(model), compute)
        self._params = [p for p in self.policy_lm.parameters() if p.requires_grad]
        if cfg.lora is not None:
            total = sum(p.numel() for p in self.policy_lm.parameters())
            _log.info(
                "LoRA adapters: training %d of %d parameters", sum(p.numel() for p in self._params), total
            )
        opt = policy.optimizer
        # The fused CUDA kernel: one launch per step instead of several per parameter group (FSDP2's
        # sharded parameters are DTensors, which the fused kernel also takes, shard by shard).
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            self._params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay, **fused
        )
        pad = causal_lm(model).config.pad_token_id
        self._pad_id = int(pad) if pad is not None else 0
        self._step = 0
        self.critic = self._make_critic() if policy.advantage == "gae" else None

    def _make_critic(self) -> Critic:
        """The value model of `advantage = "gae"`: a second copy of the starting model (trainers/critic.py)."""
        from transformers import AutoModelForCausalLM

        from astraflow.dataflow.estimators import GAEConfig, make_estimator

        if self.sharded:
            raise AstraflowError(
                'advantage = "gae" (a value model) does not run on several trainer ranks yet',
                hint="train with one process (trainer_nproc = 1), or pick another estimator",
            )
        gae = make_estimator("gae", self.policy.advantage_options).config
        assert isinstance(gae, GAEConfig)
        model = AutoModelForCausalLM.from_pretrained(
            self.policy.model, dtype=getattr(torch, self.config.dtype)
        )
        model.to(self.device).train()  # type: ignore[arg-type]
        opt = self.policy.optimizer
        return Critic(
            model,
            gae,
            lr=gae.critic_lr if gae.critic_lr is not None else opt.lr,
            betas=opt.betas,
            weight_decay=opt.weight_decay,
            grad_clip=opt.grad_clip,
            autocast=self._autocast_ctx,
        )

    def _autocast_ctx(self) -> Any:
        """Autocast to compute_dtype when it differs from the parameters' dtype, else nothing."""
        return torch.autocast(self.device.type, dtype=self._compute) if self._autocast else nullcontext()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return self._step

    # ----- one step -----------------------------------------------------------------------------

    def _micro_batches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        """This rank's micro-batches of one update's samples."""
        cfg = self.config
        groups = packing.plan(
            samples,
            micro_batch=cfg.micro_batch,
            micro_batch_tokens=cfg.micro_batch_tokens,
            world=dist.world(),
            rank=dist.rank(),
        )
        return [
            packing.build(
                [samples[i] for i in g],
                pack=cfg.pack,
                row_tokens=cfg.pack_row_tokens,
                pad_id=self._pad_id,
                device=self.device,
                width_multiple=_COMPILED_WIDTH_MULTIPLE if cfg.compile else 1,
            )
            for g in groups
        ]

    def _forward(self, lm: PolicyLM, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, entropy) views of one micro-batch, under autocast when compute_dtype asks for it."""
        ctx = torch.autocast(self.device.type, dtype=self._compute) if self._autocast else nullcontext()
        with ctx:
            return lm(mb)

    def _inputs(
        self,
        m: MicroBatch,
        extra: dict[str, torch.Tensor],
        logp: torch.Tensor,
        ent: torch.Tensor | None,
        tokens: float,
        seqs: float,
    ) -> LossInputs:
        """LossInputs of micro-batch `m`, normalised by `tokens` trained tokens and `seqs` sequences."""
        return LossInputs(
            logp=logp,
            behaviour_logp=m.behaviour,
            mask=m.mask,
            advantages=m.adv,
            ref_logp=extra.get("ref"),
            prox_logp=extra.get("prox") if self.loss.needs_prox else None,
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

    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Reference-policy logprobs: the frozen copy, or the base model with the adapters off (LoRA)."""
        if self._ref_lm is not None:
            return self._forward(self._ref_lm, mb)[0]
        with self.model.disable_adapter():
            return self._forward(self.policy_lm, mb)[0]

    def _extras(self, micros: list[MicroBatch], batch_size: int) -> dict[int, dict[str, torch.Tensor]]:
        """Prox and ref logprobs of every micro-batch (before the first update), and loss.prepare."""
        extras: dict[int, dict[str, torch.Tensor]] = {id(m): {} for m in micros}
        with torch.no_grad():
            if self.loss.needs_prox or self._wants_prepare:
                for m in micros:
                    extras[id(m)]["prox"] = self._forward(self.policy_lm, m)[0]
            if self.loss.needs_ref:
                for m in micros:
                    extras[id(m)]["ref"] = self._ref_logprobs(m)
        if self._wants_prepare:
            tokens = float(sum(float(m.mask.sum()) for m in micros))
            self.loss.prepare(
                [
                    self._inputs(m, extras[id(m)], extras[id(m)]["prox"], None, tokens, float(batch_size))
                    for m in micros
                ]
            )
        return extras

    def _accumulate(
        self,
        part: list[TrainSample],
        micros: list[MicroBatch],
        extras: dict[int, dict[str, torch.Tensor]],
        acc: dict[str, list[Any]],
        mismatch_sums: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward/backward of one update's micro-batches into .grad; returns this rank's loss sum (on
        the device: metrics stay there until the step's one host transfer). With `mismatch_sums`, the
        mismatch sums of these logprobs (taken before this update's optimizer step) are appended."""
        # Every rank knows the whole update, so the normalisers are global without a collective.
        total = float(sum(sum(s.loss_mask[1:]) for s in part))
        n_seqs = float(len(part))
        world = dist.world()
        update_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for j, m in enumerate(micros):
            if self.sharded:
                dist.set_grad_sync(self.policy_lm, j == len(micros) - 1)
            logp, ent = self._forward(self.policy_lm, m)
            if m.sequences == 0:
                logp.sum().backward()  # a filler: zero gradients, but the collectives run
                continue
            loss, metrics = self.loss(self._inputs(m, extras[id(m)], logp, ent, total, n_seqs))
            # FSDP averages gradients over ranks; each rank's loss is a part of one global sum.
            (loss * world if world > 1 else loss).backward()
            update_loss += loss.detach().float()
            if mismatch_sums is not None:
                mismatch_sums.append(self._mismatch_sums(m, logp))
            acc.setdefault("_ent_sum", []).append((ent.detach() * m.mask).sum())
            acc.setdefault("_ent_tokens", []).append(m.mask.sum())
            for name, value in metrics.items():
                acc.setdefault(name, []).append(value)
        return update_loss

    def step(self, batch: list[TrainSample]) -> dict[str, float]:
        """One optimizer step over `batch` (policy.minibatches updates); returns metrics."""
        if not batch:
            raise ValueError("empty batch")
        k = min(self.policy.minibatches, len(batch))
        size = math.ceil(len(batch) / k)
        parts = [batch[i : i + size] for i in range(0, len(batch), size)]
        updates = [(part, self._micro_batches(part)) for part in parts]
        extras = self._extras([m for _, ms in updates for m in ms], len(batch))
        # GAE: per-token advantages from the value model's values before any update of this step
        value_metrics = self.critic.prepare([m for _, ms in updates for m in ms]) if self.critic else {}
        value_acc: dict[str, list[float]] = {}
        lr = self._set_lr()
        losses_dev: list[torch.Tensor] = []
        norms_dev: list[torch.Tensor] = []
        acc: dict[str, list[Any]] = {}
        # Mismatch over logprobs of the weights held at the step's start: the prox pass when there is
        # one, else the first update's own forward (later updates see moved weights).
        has_prox = any("prox" in e for e in extras.values())
        mm_dev = [
            self._mismatch_sums(m, extras[id(m)]["prox"])
            for _, ms in updates
            for m in ms
            if has_prox and m.sequences > 0
        ]
        skipped = 0
        for u, (part, micros) in enumerate(updates):
            self.optimizer.zero_grad(set_to_none=True)
            first = mm_dev if u == 0 and not has_prox else None
            losses_dev.append(self._accumulate(part, micros, extras, acc, first))
            norms_dev.append(dist.grad_norm(self._params, self.policy.optimizer.grad_clip))
            if not self._finite(losses_dev[-1], norms_dev[-1]):
                # a NaN or inf would reach every weight through the optimizer: this update is skipped
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
            else:
                self.optimizer.step()
            if self.critic is not None:
                for name, v in self.critic.update(micros).items():
                    value_acc.setdefault(name, []).append(v)
        self._step += 1
        # Host-side metrics first: they overlap the device's last kernels.
        out = self._batch_metrics(batch)
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        ent_dev = [torch.stack(acc.pop(k, [zero])).sum() for k in ("_ent_sum", "_ent_tokens")]
        mm_sum = torch.stack(mm_dev).sum(0) if mm_dev else torch.zeros(6, device=self.device)
        # The step's one device-to-host transfer (the objective's own metrics may have synced already).
        host = torch.cat(
            [torch.stack([t.float() for t in (*losses_dev, *norms_dev, *ent_dev)]), mm_sum]
        ).tolist()
        k_up = len(losses_dev)
        grad_norms = host[k_up : 2 * k_up]
        sums = dist.all_sum([*host[:k_up], *host[2 * k_up :]], self.device)
        update_losses, (ent_sum, ent_tokens), mm_host = sums[:k_up], sums[k_up : k_up + 2], sums[k_up + 2 :]
        acc = {name: [float(v) for v in values] for name, values in acc.items()}
        if self.sharded:
            merged: dict[str, list[float]] = {}
            for d in dist.gather_objects(acc):
                for name, values in d.items():
                    merged.setdefault(name, []).extend(values)
            acc = merged
        for name, values in acc.items():
            out[name] = sum(values) / len(values)
        # After the objective's metrics: its entropy is a mean of micro-batch means; this one is the
        # token mean over the whole batch, the same whatever the micro-batch layout.
        out.update(
            loss=sum(update_losses) / len(update_losses),
            grad_norm=sum(grad_norms) / len(grad_norms),
            entropy=ent_sum / max(ent_tokens, 1.0),
            lr=lr,
            skipped_updates=float(skipped),
        )
        out.update(mismatch.metrics(mm_host))
        if self.critic is not None:
            # adv_* over the per-token advantages before whitening (the per-sequence values are the rewards)
            for name in ("adv_mean", "adv_std", "adv_abs_mean"):
                out[name] = value_metrics.pop(f"gae_{name}", 0.0)
            out.update(value_metrics)
            out.update({name: sum(vs) / len(vs) for name, vs in value_acc.items()})
        return out

    def _mismatch_sums(self, m: MicroBatch, logp: torch.Tensor) -> torch.Tensor:
        """Engine-vs-trainer sums of one micro-batch (trainers/mismatch.py); the trainer holds version
        step - 1 until this step's optimizer updates end."""
        assert m.versions is not None
        return mismatch.token_sums(logp, m.behaviour, m.mask, m.versions, self._step)

    def _finite(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """Whether an update's loss and gradient norm are finite on every rank (one host sync)."""
        bad = float((~torch.isfinite(loss.detach()) | ~torch.isfinite(norm.detach())).any())
        return dist.all_sum([bad], self.device)[0] == 0.0

    def batch_gradients(self, batch: list[TrainSample]) -> tuple[float, dict[str, torch.Tensor]]:
        """(loss, gradients) of `batch` taken as one update at the current parameters, without stepping;
        gradients are full CPU tensors on rank 0 ({} elsewhere). For checking layouts and sharding."""
        micros = self._micro_batches(batch)
        extras = self._extras(micros, len(batch))
        if self.critic is not None:
            self.critic.prepare(micros)
        self.optimizer.zero_grad(set_to_none=True)
        loss = dist.all_sum([float(self._accumulate(batch, micros, extras, {}))], self.device)[0]
        grads: dict[str, torch.Tensor] = {}
        for name, p in causal_lm(self.model).named_parameters():
            if p.grad is None:
                continue
            g = p.grad
            full = g.full_tensor() if hasattr(g, "full_tensor") else g
            if dist.rank() == 0:
                grads[name] = full.detach().to("cpu", copy=True)
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grads

    def _batch_metrics(self, batch: list[TrainSample]) -> dict[str, float]:
        """Rewards, advantages, sizes and staleness of a batch (version before the step = step - 1)."""
        rewards = [s.reward for s in batch]
        advs = [s.advantage for s in batch]
        version = self._step - 1
        stale = []
        for s in batch:
            trained = [v for v, m in zip(s.version_list(), s.loss_mask, strict=True) if m and v >= 0]
            stale.append(version - min(trained) if trained else 0)
        tokens = sum(sum(s.loss_mask) for s in batch)
        return {
            "trainer/reward_mean": _mean(rewards),
            "reward_std": _std(rewards),
            "adv_mean": _mean(advs),
            "adv_std": _std(advs),
            "adv_abs_mean": _mean([abs(a) for a in advs]),
            "trainer/staleness_mean": _mean([float(x) for x in stale]),
            "trainer/staleness_max": float(max(stale)),
            "tokens": float(tokens),
            "sequences": float(len(batch)),
            "replayed": float(sum(1 for s in batch if s.replay)),
        }

    # ----- weights and checkpoints --------------------------------------------------------------

    def export_weights(self) -> dict[str, Any]:
        """The current dense weights: name -> detached CPU tensor, a copy later steps do not touch.

        LoRA: base + adapter deltas merged. Several ranks: every rank must call this; the weights are
        gathered a tensor at a time and returned on rank 0 ({} on the others).
        """
        if self.sharded:
            return dist.full_state_dict(self.model)
        if self.config.lora is not None:
            return lora.merged_state_dict(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    @property
    def snapshots_on_device(self) -> bool:
        """Whether `weights_snapshot` copies on the GPU (one process, dense, CUDA)."""
        return not self.sharded and self.config.lora is None and self.device.type == "cuda"

    def weights_snapshot(self) -> dict[str, Any]:
        """The current dense weights as a copy on the training device (fast: no host transfer), for a
        background publisher to copy to the host while the next step runs; export_weights otherwise."""
        if not self.snapshots_on_device:
            return self.export_weights()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _rng_state(self) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        return rng

    def save_checkpoint(self, path: Path) -> None:
        """Write model, optimizer, RNG states and step count to directory `path`: one safetensors file
        and optimizer.pt on one process; under several ranks every rank writes its shards (dcp/) and
        its RNG state (every rank must call this)."""
        from safetensors.torch import save_model

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.sharded:
            dist.save_sharded(self.policy_lm, self.optimizer, path / _DCP_DIR)
            torch.save(self._rng_state(), path / f"rng-{dist.rank()}.pt")
            dist.barrier()
            if dist.rank() != 0:
                return
        else:
            save_model(self.model, str(path / _MODEL_FILE))
            torch.save(self.optimizer.state_dict(), path / _OPTIM_FILE)
            torch.save(self._rng_state(), path / _RNG_FILE)
            if self.critic is not None:
                self.critic.save(path / _CRITIC_DIR)
        py_version, py_state, py_gauss = random.getstate()
        state = {
            "step": self._step,
            "seed": self.seed,
            "python_rng": [py_version, list(py_state), py_gauss],
            "ranks": dist.world(),
        }
        # The state file is written last: its presence marks a complete checkpoint.
        (path / _STATE_FILE).write_text(json.dumps(state))

    def load_checkpoint(self, path: Path) -> None:
        """Restore everything save_checkpoint wrote (every rank must call this under several ranks)."""
        from safetensors.torch import load_model

        path = Path(path)
        if not (path / _STATE_FILE).exists():
            raise AstraflowError(
                f"no complete trainer checkpoint in {path}", hint="point at a checkpoint directory"
            )
        state = json.loads((path / _STATE_FILE).read_text())
        ranks = int(state.get("ranks", 1))
        if self.sharded != (path / _DCP_DIR).is_dir() or (self.sharded and ranks != dist.world()):
            raise AstraflowError(
                f"checkpoint {path} was written by {ranks} rank(s); this trainer runs {dist.world()}",
                hint="resume with the same number of trainer processes (changing it is not supported yet)",
            )
        if self.sharded:
            dist.load_sharded(self.policy_lm, self.optimizer, path / _DCP_DIR)
            rng = torch.load(path / f"rng-{dist.rank()}.pt", weights_only=True)
        else:
            load_model(self.model, str(path / _MODEL_FILE), device=str(self.device))
            self.optimizer.load_state_dict(
                torch.load(path / _OPTIM_FILE, map_location=self.device, weights_only=True)
            )
            rng = torch.load(path / _RNG_FILE, weights_only=True)
            if self.critic is not None:
                if not Critic.present(path / _CRITIC_DIR):
                    raise AstraflowError(
                        f'checkpoint {path} has no value model, and this policy\'s advantage = "gae" needs one',
                        hint="resume with the estimator the run was started with",
                    )
                self.critic.load(path / _CRITIC_DIR)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(rng["cuda"]))
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

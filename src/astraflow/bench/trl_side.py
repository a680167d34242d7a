"""The TRL side of `astraflow bench trl`, run as its own process: `python -m astraflow.bench.trl_side SPEC OUT`.

It trains the recipe's model with TRL's GRPOTrainer on the quickstart task (the same prompts, the
same partial-credit reward computed from the completion's token ids, the same group size, prompts
per step, new tokens, temperature, AdamW settings and steps), on the CPU or the GPU (`device`), saving
weights every `save_steps` steps when asked, and writes one JSON object to OUT:
each step's mean reward and finish time, and the time TRL took to build. TRL is imported only here,
from the directory `astraflow bench trl` installed it into (on PYTHONPATH); astraflow never depends on it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train as `spec` says; returns the measurements (see the module docstring)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from astraflow.workflows.quickstart.workflow import QuickstartConfig, QuickstartWorkflow, score

    tok = AutoTokenizer.from_pretrained(spec["model"])
    wf = QuickstartWorkflow(QuickstartConfig.model_validate(spec["workflow_options"]))
    rows = list(wf.dataset(int(spec["seed"]), int(spec["dataset_size"])))
    # The RaaS encodes prompts with the tokenizer's special tokens (a BOS here); TRL tokenizes the
    # prompt text without them, so the BOS is written into the text to give TRL the same ids.
    prefix = ""
    plain = tok(rows[0]["prompt"], add_special_tokens=False)["input_ids"]
    encoded = tok.encode(rows[0]["prompt"])
    if encoded != plain and tok.bos_token and encoded[1:] == plain:
        prefix = tok.bos_token
    data = Dataset.from_list([{"prompt": prefix + r["prompt"], "answer": r["answer"]} for r in rows])
    eos = tok.eos_token_id
    exact = wf.config.reward == "exact"

    def reward(completion_ids: list[list[int]], answer: list[str], **_: Any) -> list[float]:
        """The quickstart's partial-credit reward, from token ids as the RaaS scores them."""
        out = []
        for ids, ans in zip(completion_ids, answer, strict=True):
            ids = list(ids)
            stopped = eos is not None and eos in ids
            text = str(tok.decode(ids[: ids.index(eos)] if stopped else ids, skip_special_tokens=True))
            words = text.split()
            out.append(score(words, stopped, str(ans).split(), exact=exact))
        return out

    step_times: list[float] = []
    step_clock: list[float] = []

    class Clock(TrainerCallback):
        """Stamps the end of every optimizer step (and its wall clock, for the parent's start-up and
        shutdown times)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_times.append(time.perf_counter())
            step_clock.append(time.time())

    on_cpu = str(spec.get("device", "cpu")) == "cpu"
    save_steps = int(spec.get("save_steps", 0))
    group = int(spec["group_size"])
    per_step = int(spec["batch_prompts"]) * group
    config = trl.GRPOConfig(
        output_dir=spec["output_dir"],
        max_steps=int(spec["steps"]),
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        num_generations=group,
        max_completion_length=int(spec["max_new_tokens"]),
        temperature=float(spec["temperature"]),
        top_p=1.0,
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=float(spec["betas"][0]),
        adam_beta2=float(spec["betas"][1]),
        weight_decay=float(spec["weight_decay"]),
        max_grad_norm=float(spec["grad_clip"]),
        beta=0.0,
        epsilon=float(spec["clip"]),
        loss_type="dapo",
        num_iterations=1,
        seed=int(spec["seed"]),
        use_cpu=on_cpu,
        bf16=False,
        fp16=False,
        logging_steps=1,
        # checkpoints (weights only) for the held-out evaluation, which runs after training
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        save_only_model=True,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    t_train = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()
    rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    return {
        "trl_version": trl.__version__,
        "threads": torch.get_num_threads(),
        "setup_s": t_train - t_start,
        "train_s": t_end - t_train,
        "step_times": [t - t_train for t in step_times],
        "step_clock": step_clock,
        "rewards": rewards,
        "bos_prefixed": bool(prefix),
    }


def main(argv: list[str]) -> int:
    """Entry point: SPEC (a JSON file) and OUT (where the result JSON goes)."""
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Held-out accuracy of saved policies, for `astraflow bench trl --heldout N`: the same evaluator for
every checkpoint of both systems, and the arithmetic corpus its GPU script pre-trains on.

The quickstart workflow generates the tasks (`add 4 7 + 1 5 =` -> `6 2`); the split is by seed: the SFT
corpus, the RL prompts and the held-out set come from three different seeds (identical problems across
them are possible, rare: 3-digit addends give 10^6 pairs). A checkpoint answers each held-out prompt
greedily; it is right when the words before its first <eos> equal the answer (the workflow's `correct`).

    python -m astraflow.bench.heldout corpus --task add --length 3 --rows 20000 --seed 1000 > arith.jsonl
    python -m astraflow.bench.heldout pretrain --model M --data arith.jsonl --out M-sft --target 0.3

`pretrain` runs `astraflow sft` (trainers/sft.py) one epoch at a time and stops once the model answers
`target` of a validation set (seed VALIDATION_SEED, not the held-out one) exactly: a warm start that
partly solves the task, whatever the hardware's speed. Each epoch starts a fresh AdamW.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from astraflow.workflows.quickstart.workflow import QuickstartConfig, QuickstartWorkflow

CORPUS_SEED = 1000
"""Default seed of the pre-training corpus (the RL prompts use run.seed, the held-out set HELDOUT_SEED)."""
HELDOUT_SEED = 2000
"""Default seed of the held-out set."""
VALIDATION_SEED = 3000
"""Seed of the set `pretrain` stops on."""


def samples(options: dict[str, Any], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` quickstart task instances (prompt, answer) for workflow `options`, generated from `seed`."""
    wf = QuickstartWorkflow(QuickstartConfig.model_validate(options))
    return list(wf.dataset(seed, n))


def corpus_rows(options: dict[str, Any], n: int, seed: int = CORPUS_SEED) -> list[dict[str, str]]:
    """`astraflow sft` rows {prompt, completion} of `n` task instances."""
    return [{"prompt": s["prompt"], "completion": s["answer"]} for s in samples(options, n, seed)]


def checkpoint_dirs(run_dir: Path, side: str) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint a side saved, by step: astraflow's
    checkpoints/<policy>/step-N/ and TRL's checkpoint-N/."""
    found: list[tuple[int, Path]] = []
    pattern = "checkpoints/*/step-*" if side == "astraflow" else "checkpoint-*"
    for d in run_dir.glob(pattern):
        tail = d.name.rsplit("-", 1)[-1]
        if tail.isdigit() and (d / "model.safetensors").is_file():
            found.append((int(tail), d))
    return sorted(found)


class Evaluator:
    """Greedy held-out accuracy of checkpoints that share one base model (config and tokenizer)."""

    def __init__(
        self, base: Path, heldout: list[dict[str, Any]], *, max_new_tokens: int, device: str = "auto"
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from astraflow.engines.device import resolve_device

        self.device = torch.device(resolve_device(device))
        self.tok = AutoTokenizer.from_pretrained(str(base))
        model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        self.model = model.to(self.device).eval()
        self.heldout = heldout
        self.max_new_tokens = max_new_tokens

    def load(self, checkpoint: Path) -> None:
        """Put a checkpoint's weights into the evaluation model."""
        from safetensors.torch import load_model

        missing, unexpected = load_model(
            self.model, str(checkpoint / "model.safetensors"), strict=False, device=str(self.device)
        )
        # a tied output embedding may be left out of a file; anything else means other weights
        if unexpected or set(missing) - {"lm_head.weight"}:
            from astraflow.errors import AstraflowError

            raise AstraflowError(
                f"{checkpoint} does not hold this model's weights (missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]})",
                hint="the checkpoints must come from the model the bench started from",
            )

    def accuracy(self, batch: int = 512) -> float:
        """Fraction of the held-out set the current weights answer exactly (greedy)."""
        import torch

        eos = self.tok.eos_token_id
        right = 0
        # prompts of one task and length have one token count, so a batch needs no padding
        by_len: dict[int, list[tuple[list[int], list[str]]]] = {}
        for s in self.heldout:
            ids = list(self.tok.encode(s["prompt"]))
            by_len.setdefault(len(ids), []).append((ids, str(s["answer"]).split()))
        with torch.no_grad():
            for items in by_len.values():
                for i in range(0, len(items), batch):
                    part = items[i : i + batch]
                    prompts = torch.tensor([p for p, _ in part], device=self.device)
                    out = self.model.generate(
                        input_ids=prompts,
                        attention_mask=torch.ones_like(prompts),
                        max_new_tokens=self.max_new_tokens,
                        do_sample=False,
                        eos_token_id=eos,
                        pad_token_id=eos,
                    )
                    for row, (_, answer) in zip(out[:, prompts.shape[1] :].tolist(), part, strict=True):
                        stopped = eos in row
                        text = str(
                            self.tok.decode(
                                row[: row.index(eos)] if stopped else row, skip_special_tokens=True
                            )
                        )
                        right += int(stopped and text.split() == answer)
        return right / max(len(self.heldout), 1)


def pretrain(
    model: Path,
    data: Path,
    out: Path,
    *,
    options: dict[str, Any],
    target: float,
    max_epochs: int,
    lr: float,
    batch_size: int,
    device: str,
    validation: int = 256,
    rows_per_round: int = 0,
    say: Any = print,
) -> float:
    """SFT `model` on `data` one round at a time until the validation accuracy reaches `target` (or
    `max_epochs` rounds); writes the last round's model to `out`; returns its validation accuracy.

    A round is one epoch over the whole file, or with `rows_per_round` the next slice of that many rows
    (wrapping around), so that training stops close to its target: a small model can go from 15% to
    99% of the sums in one epoch of 20,000."""
    import shutil

    from astraflow.trainers.sft import run_sft

    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty")
    valid = samples(options, validation, VALIDATION_SEED)
    work = out.with_name(out.name + ".epochs")
    shutil.rmtree(work, ignore_errors=True)
    prev, acc = model, 0.0
    rows = data.read_text().splitlines() if rows_per_round > 0 else []
    if rows_per_round > 0 and len(rows) < rows_per_round:
        raise SystemExit(f"{data} has {len(rows)} rows, fewer than --rows-per-round {rows_per_round}")
    for epoch in range(1, max_epochs + 1):
        nxt = work / f"epoch-{epoch}"
        part = data
        if rows_per_round > 0:
            first = (epoch - 1) * rows_per_round
            part = work / f"round-{epoch}.jsonl"
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_text("\n".join(rows[(first + i) % len(rows)] for i in range(rows_per_round)) + "\n")
        rep = run_sft(prev, part, nxt, epochs=1, lr=lr, batch_size=batch_size, seed=epoch, device=device)
        ev = Evaluator(nxt, valid, max_new_tokens=len(str(valid[0]["answer"]).split()) + 2, device=device)
        acc = ev.accuracy()
        say(
            f"sft {'round' if rows_per_round > 0 else 'epoch'} {epoch}: loss {rep.epoch_loss[-1]:.4f}, token accuracy {rep.epoch_token_accuracy[-1]:.3f}, "
            f"validation accuracy {acc:.3f} ({rep.seconds:.1f}s)"
        )
        if prev != model:
            shutil.rmtree(prev, ignore_errors=True)
        prev = nxt
        if acc >= target:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.move(str(prev), str(out))
    shutil.rmtree(work, ignore_errors=True)
    return acc


def main(argv: list[str]) -> int:
    """`corpus`: print SFT rows of generated tasks as JSONL; `pretrain`: SFT until a validation accuracy."""
    parser = argparse.ArgumentParser(prog="python -m astraflow.bench.heldout")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="print {prompt, completion} rows of generated quickstart tasks")
    c.add_argument("--task", default="add", choices=("copy", "reverse", "add"))
    c.add_argument("--length", type=int, default=3)
    c.add_argument("--rows", type=int, default=20000)
    c.add_argument("--seed", type=int, default=CORPUS_SEED)
    p = sub.add_parser("pretrain", help="astraflow sft an epoch at a time until a validation accuracy")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--task", default="add", choices=("copy", "reverse", "add"))
    p.add_argument("--length", type=int, default=3)
    p.add_argument("--target", type=float, default=0.3)
    p.add_argument("--max-epochs", type=int, default=20, help="at most this many rounds")
    p.add_argument(
        "--rows-per-round",
        type=int,
        default=0,
        help="rows of the corpus a round trains on (0: the whole file)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    if args.cmd == "pretrain":
        pretrain(
            args.model,
            args.data,
            args.out,
            options={"task": args.task, "length": args.length},
            target=args.target,
            max_epochs=args.max_epochs,
            lr=args.lr,
            batch_size=args.batch_size,
            device=args.device,
            rows_per_round=args.rows_per_round,
        )
        return 0
    for row in corpus_rows({"task": args.task, "length": args.length}, args.rows, args.seed):
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""`astraflow sft`: a supervised warm start of a local model on a local JSONL, before RL."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def sft(
    model: Annotated[Path, typer.Argument(help="Model directory to start from (e.g. from `model init`).")],
    data: Annotated[Path, typer.Argument(help="JSONL of {prompt, completion} or {messages, tools?} rows.")],
    out: Annotated[Path, typer.Option("--out", help="New model directory to write.")],
    epochs: Annotated[int, typer.Option("--epochs", min=1, help="Passes over the data.")] = 3,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="AdamW learning rate.")] = 1e-3,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Rows per optimizer step.")] = 16,
    max_length: Annotated[int, typer.Option("--max-length", min=2, help="Tokens kept per row.")] = 512,
    seed: Annotated[int, typer.Option("--seed", help="Shuffling and initialisation seed.")] = 0,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch CPU threads.")] = 1,
    until_loss: Annotated[
        float,
        typer.Option(
            "--until-loss",
            min=0.0,
            help="Stop after the first epoch whose mean loss is at most this (0: off).",
        ),
    ] = 0.0,
    device: Annotated[
        str, typer.Option("--device", help="cpu, cuda, cuda:N, or auto (a GPU when one is visible).")
    ] = "auto",
) -> None:
    """Fine-tune MODEL on DATA (loss on completion / assistant tokens only, tool calls included; tool
    results are context) and write OUT for a recipe's policy.model."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from astraflow.trainers.sft import run_sft

    report = run_sft(
        model,
        data,
        out,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        max_length=max_length,
        seed=seed,
        threads=threads,
        until_loss=until_loss,
        device=device,
    )
    for i, (loss, acc) in enumerate(zip(report.epoch_loss, report.epoch_token_accuracy, strict=True), 1):
        typer.echo(f"epoch {i}/{report.epochs}: loss {loss:.4f}  token accuracy {acc:.3f}")
    if len(report.epoch_loss) < report.epochs:
        typer.echo(f"stopped after epoch {len(report.epoch_loss)}: loss <= --until-loss {until_loss}")
    typer.echo(
        f"trained {report.examples} rows ({report.trained_tokens} completion tokens, {report.steps} steps) "
        f"in {report.seconds:.1f}s; wrote {out}"
    )

"""`astraflow model init`: a random-init transformers model and a locally built tokenizer, offline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Create models offline.", no_args_is_help=True)


@app.command("init")
def init(
    out: Annotated[Path, typer.Option("--out", help="Directory to create.")],
    arch: Annotated[str, typer.Option("--arch", help="Architecture (qwen3).")] = "qwen3",
    preset: Annotated[str, typer.Option("--preset", help="Size preset (tiny, small, ...).")] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Initialisation seed.")] = 0,
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", help="words (quickstart digits) or bpe (byte-level, from --corpus).")
    ] = "words",
    corpus: Annotated[
        Path | None, typer.Option("--corpus", help="UTF-8 text file the bpe tokenizer is trained on.")
    ] = None,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Tokens of the bpe tokenizer.")] = 4096,
    device: Annotated[
        str,
        typer.Option("--device", help="cpu or cuda: where the weights are initialised (cuda: large shapes)."),
    ] = "cpu",
) -> None:
    """Write a random-init model directory (config, weights, tokenizer); downloads nothing."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from astraflow.models.init import init_model

    if device not in ("cpu", "cuda"):
        from astraflow.errors import AstraflowError

        raise AstraflowError(f"unknown --device {device!r}", hint="choose cpu or cuda")
    path = init_model(
        arch, preset, out, seed, tokenizer=tokenizer, corpus=corpus, vocab_size=vocab_size, device=device
    )
    typer.echo(f"wrote {arch}/{preset} model to {path}")

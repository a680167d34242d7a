"""One policy's trainer over several ranks (torchrun): rank 0 leads, the others follow.

Only rank 0 talks to the controller and serves weights. Every collective trainer call it makes (step,
checkpoint save and load, weight export) is first announced to the followers by a broadcast, so all
ranks enter the same collectives in the same order. `Leader` wraps rank 0's trainer to do that; the
followers run `follow` until rank 0 says stop.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.trainers import distributed as dist

_log = log.get("trainer.ranks")


def without_nproc(args: list[str]) -> list[str]:
    """Command-line arguments with `--nproc N` / `--nproc=N` removed (the ranks must not re-launch)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def torchrun_argv(nproc: int, args: list[str]) -> list[str]:
    """The command that starts `astraflow ARGS` as `nproc` ranks on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "astraflow",
        *args,
    ]


def exec_torchrun(nproc: int) -> None:
    """Replace this process with torchrun running this same command line as `nproc` ranks (never
    returns); every option given is passed on as it was, except --nproc."""
    argv = torchrun_argv(nproc, without_nproc(sys.argv[1:]))
    _log.info("starting %d trainer ranks: %s", nproc, shlex.join(argv))
    os.execv(argv[0], argv)


def world_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class Leader:
    """Rank 0's trainer: announces every collective call to the followers before making it."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.trainer.step_count)

    def step(self, batch: list[Any]) -> dict[str, float]:
        """One optimizer step on every rank."""
        dist.broadcast(("step", batch))
        return dict(self.trainer.step(batch))

    def export_weights(self) -> dict[str, Any]:
        """Full weights on rank 0 (gathered from every rank's shards)."""
        dist.broadcast(("export", None))
        return dict(self.trainer.export_weights())

    def save_checkpoint(self, path: Path) -> None:
        """Every rank writes its shards into `path` (rank 0 created it)."""
        dist.broadcast(("save", str(path)))
        self.trainer.save_checkpoint(path)

    def load_checkpoint(self, path: Path) -> None:
        """Every rank restores its shards from `path`."""
        dist.broadcast(("load", str(path)))
        self.trainer.load_checkpoint(path)

    def stop(self) -> None:
        """Release the followers."""
        dist.broadcast(("stop", None))


def follow(trainer: Any) -> int:
    """A follower rank: do what rank 0 announces until it says stop; returns the exit code."""
    while True:
        op, arg = dist.broadcast(None)
        if op == "step":
            trainer.step(arg)
        elif op == "export":
            trainer.export_weights()
        elif op == "save":
            trainer.save_checkpoint(Path(arg))
        elif op == "load":
            trainer.load_checkpoint(Path(arg))
        elif op == "stop":
            return 0
        else:
            raise RuntimeError(f"unknown trainer op {op!r} from rank 0")

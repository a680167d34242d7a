"""Several ranks, one policy: FSDP2 sharding, collectives the trainer needs, sharded checkpoints.

Under torchrun (torch.distributed initialised) the trainer shards every decoder layer and then the
root (embedding, final norm, output embedding) with `fully_shard`; parameters stay in their storage
dtype (float32 = fp32 master weights) and compute runs in `compute_dtype` through FSDP2's mixed
precision, gradients reduced in float32. Checkpoints go through torch.distributed.checkpoint, each
rank writing its own shards. Weights for the engines are gathered a tensor at a time and kept on
rank 0 only (no sharded publishing yet).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from astraflow import log

_log = log.get("trainers.distributed")


def active() -> bool:
    """Whether this process is one rank of an initialised process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world() -> int:
    """Number of ranks (1 without a process group)."""
    return torch.distributed.get_world_size() if active() else 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return torch.distributed.get_rank() if active() else 0


def init_from_env(device: str) -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...); returns this rank's device.

    NCCL on CUDA (one GPU per local rank), gloo on CPU.
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local)
    if not active():
        from datetime import timedelta

        # Followers wait in a broadcast while rank 0 waits for the controller's next batch.
        torch.distributed.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=timedelta(minutes=60)
        )
    return torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")


def shard(root: torch.nn.Module, layers: list[torch.nn.Module], compute_dtype: torch.dtype) -> None:
    """FSDP2: each layer its own unit, the rest in the root's unit; compute in compute_dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    # The root's parameters (embeddings, final norm) are the first needed again by the backward pass:
    # keeping them gathered after the forward pass saves one all-gather per micro-batch.
    fully_shard(root, mp_policy=mp, reshard_after_forward=False)


def set_grad_sync(root: torch.nn.Module, sync: bool) -> None:
    """Turn gradient reduce-scatter on (last micro-batch of an update) or off (accumulating)."""
    setter = getattr(root, "set_requires_gradient_sync", None)
    if callable(setter):
        setter(sync)


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of `values` over ranks (the values themselves without a process group)."""
    if not active():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return [float(x) for x in t.tolist()]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if active():
        torch.distributed.barrier()


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """Unsharded weights as CPU tensors on rank 0 ({} elsewhere), gathered one tensor at a time.

    Every rank must call this (each sharded tensor is an all-gather).
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    keep = rank() == 0
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


def grad_norm(params: list[torch.nn.Parameter], clip: float) -> torch.Tensor:
    """Clip gradients to total norm `clip` (no clipping when <= 0); returns the norm before clipping, a
    0-dim tensor on the device (no host sync)."""
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def save_sharded(root: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Model and optimizer state, each rank its own shards, under path/ (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(root, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def load_sharded(root: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Restore what save_sharded wrote (resharding to this run's ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(root, optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(root, optimizer, model_state_dict=msd, optim_state_dict=osd)

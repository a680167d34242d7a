"""One rank of the FSDP2 test (started by torchrun from test_fsdp.py; not a test module itself).

argv: MODEL_DIR OUT_DIR. Rank 0 writes OUT_DIR/result.pt: the loss and full gradients of batch A as one
update, the weights after steps A then B, and the weights after resuming from the sharded checkpoint
taken after A and stepping B again.
"""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_batches import batch, policy  # noqa: E402

from astraflow.trainers import distributed as dist  # noqa: E402
from astraflow.trainers.torch_trainer import TorchTrainer  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_from_env("cpu")
    pol = policy(model_dir)
    trainer = TorchTrainer(pol, seed=3)
    loss, grads = trainer.batch_gradients(batch(0))
    metrics_a = trainer.step(batch(0))
    trainer.save_checkpoint(out / "ckpt")
    trainer.step(batch(1))
    straight = trainer.export_weights()
    resumed = TorchTrainer(pol, seed=3)
    resumed.load_checkpoint(out / "ckpt")
    assert resumed.step_count == 1
    resumed.step(batch(1))
    again = resumed.export_weights()
    if dist.rank() == 0:
        torch.save(
            {
                "loss": loss,
                "grads": grads,
                "metrics_a": metrics_a,
                "straight": straight,
                "resumed": again,
                "world": dist.world(),
            },
            out / "result.pt",
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

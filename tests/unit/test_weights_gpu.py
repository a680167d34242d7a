"""The CUDA paths of the weight transports (run on a GPU machine): a packed device buffer handed to
another process by CUDA IPC arrives with the same digest, and the bench covers every CUDA path."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_cuda_ipc_and_every_cuda_path_of_the_bench(tiny_model: Path) -> None:
    from astraflow.bench.weights import run
    from astraflow.weights import packed

    res = run(tiny_model, "cuda", repeats=2)
    paths = {r["path"]: r for r in res["paths"]}
    # the receiving process checked each version's digest before copying it (a mismatch raises there)
    assert "same GPU: CUDA IPC" in paths and paths["same GPU: CUDA IPC"]["seconds"] > 0
    if torch.cuda.device_count() >= 2:
        assert "GPU to GPU, one host: CUDA IPC" in paths
    buf = torch.arange(1000, device="cuda", dtype=torch.int32).view(torch.uint8)
    assert packed.digest(buf) == packed.digest(buf.cpu())  # the device digest is the host one

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
    assert res["delta"]["path"] == "device" and res["delta"]["same_bytes"] is True


def test_a_delta_encoded_on_the_gpu_is_the_host_encoders_bytes_and_never_holds_a_publish() -> None:
    from astraflow.weights.delta import assemble, encode_delta
    from astraflow.weights.delta_device import device_parts
    from astraflow.weights.publisher import BackgroundPublisher
    from astraflow.weights.server import WeightServer

    torch.manual_seed(0)
    base = {"w": torch.randn(1000, 333).to(torch.bfloat16), "b": torch.randn(333), "s": torch.randn(8)}
    target = {k: v.clone() for k, v in base.items()}
    target["w"].view(-1)[torch.rand(333000) < 0.01] += 1
    target["s"] += 1
    head = {"base_version": 1, "target_version": 2, "base_sha256": "", "target_sha256": ""}
    host, _ = encode_delta(base, target, **head)
    on_gpu = [{k: v.cuda() for k, v in sd.items()} for sd in (base, target)]
    for chunk in (4096, 1 << 22):
        dev, _ = assemble(device_parts(on_gpu[0], on_gpu[1], chunk=chunk), **head)
        assert bytes(memoryview(dev)) == bytes(memoryview(host))
    # the trainer's path: GPU snapshots, the delta encoded on the device after each version is served
    server = WeightServer(keep_deltas=4)
    try:
        pub = BackgroundPublisher(server, "p", delta=True)
        for v, sd in enumerate(on_gpu, start=1):
            pub.start(v, {k: t.clone() for k, t in sd.items()}, {})
            pub.result(timeout_s=60)
        assert pub.deltas is not None and pub.deltas.wait_idle(60)
        (manifest, metrics), *_ = pub.deltas.take_late()
        assert manifest.version == 2 and metrics["weights_delta_on_device"] == 1.0
        first = server.manifest("p", 1)
        assert first is not None
        same, _ = encode_delta(
            base,
            target,
            base_version=1,
            target_version=2,
            base_sha256=first.sha256,
            target_sha256=manifest.sha256,
        )
        assert bytes(server.blob("p", 2, "delta") or b"") == bytes(memoryview(same))
    finally:
        server.close()

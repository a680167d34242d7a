"""The CUDA IPC payload of the SGLang plugin on a GPU machine: a trainer's packed device buffer, named
to SGLang by `/update_weights_from_tensor`'s pickle, rebuilds in another process into the trainer's
tensors, byte for byte. The rebuild follows SGLang's reduction patch as read in its source (the GPU
named by UUID); no SGLang runs here either. Passed on 2 x H200 (2026-11-27)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

_RECEIVER = r"""
import base64, hashlib, io, json, pickle, sys
import msgspec, torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from astraflow.protocol.messages import VersionInfo, WeightOffer
from astraflow.weights.transport import SharedTransport
from astraflow_sglang.tensor_payload import from_slot

offer = msgspec.json.decode(sys.stdin.readline(), type=WeightOffer)
raas = SharedTransport(torch.device("cuda"))
got = raas.receive(VersionInfo(policy="p", version=1, weights_addr="", offers=[offer]), offer)
payload = from_slot(got.slot)

def by_uuid(*args):
    # SGLang's patched rebuild: argument 6 names the GPU by UUID; map it to this process's index
    args = list(args)
    if isinstance(args[6], str):
        n = torch.cuda.device_count()
        args[6] = next(i for i in range(n) if str(torch.cuda.get_device_properties(i).uuid) == args[6])
    return rebuild_cuda_tensor(*args)

class Reader(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return by_uuid
        return super().find_class(module, name)

named = Reader(io.BytesIO(base64.b64decode(payload.serialized))).load()
out = {
    n: [str(t.device.type), hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()]
    for n, t in named
}
got.release()
print(json.dumps(out))
"""


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def test_sglang_cuda_ipc_payload_rebuilds_the_trainers_tensors_in_another_process() -> None:
    pytest.importorskip("astraflow_sglang.tensor_payload", reason="astraflow-sglang is not installed")
    import msgspec

    from astraflow.weights.transport import SharedTransport

    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(300, 64, device="cuda", generator=gen),
        "model.norm.weight": torch.randn(64, device="cuda", generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(300, 64, device="cuda", generator=gen),
    }
    trainer = SharedTransport(torch.device("cuda"), policy="p")
    try:
        offer = trainer.publish(1, weights)
        assert offer is not None and offer.kind == "cuda_ipc"
        proc = subprocess.run(
            [sys.executable, "-c", _RECEIVER],
            input=msgspec.json.encode(offer).decode() + "\n",
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got == {k: ["cuda", _sha(v)] for k, v in weights.items()}
    finally:
        trainer.close()

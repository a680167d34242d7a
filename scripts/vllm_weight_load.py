"""How long a new version takes to reach vLLM's decoding by each way the vLLM plugin loads it, measured
in one run on one engine: the same-host slot handed over by reference (the worker maps it) against
the safetensors blob sent through `collective_rpc` (the baseline), with the bytes each sent through
`collective_rpc`. Needs vLLM (scripts/ci_vllm.sh installs the CPU build) and the astraflow-vllm plugin.

    python scripts/vllm_weight_load.py MODEL_DIR [--repeats 5] [--dtype auto]

Times are from the engine's load call until vLLM decodes with the version (`wait_version`); the
RaaS's own receive of the slot (mapping it and checking its digest) is printed apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def main() -> None:
    """Load alternating versions by both ways and print seconds, the ratio and the RPC bytes."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import torch
    from astraflow_vllm.engine import VllmEngine, VllmEngineConfig
    from safetensors.torch import load_file

    from astraflow.protocol.messages import VersionInfo
    from astraflow.weights.transport import SharedTransport

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    base = {}
    for f in sorted(os.listdir(args.model)):
        if f.endswith(".safetensors"):
            base.update(load_file(os.path.join(args.model, f)))
    versions = [base, {k: (v * 1.01 if v.is_floating_point() else v) for k, v in base.items()}]
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    cfg = VllmEngineConfig(
        max_num_seqs=4,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        dtype=args.dtype,
        enforce_eager=True,
    )
    eng = VllmEngine(args.model, cfg)
    sent: list[tuple[str, int]] = []
    real = eng._engine.collective_rpc

    def recording(method: Any, *a: Any, **kw: Any) -> Any:
        payload = kw.get("args", a[1] if len(a) > 1 else ())
        sent.append((str(method), sum(len(x) for x in payload if isinstance(x, bytes | bytearray))))
        return real(method, *a, **kw)

    eng._engine.collective_rpc = recording
    trainer = SharedTransport(torch.device("cpu"), policy="bench")
    raas = SharedTransport(torch.device("cpu"))
    blob_s: list[float] = []
    slot_s: list[float] = []
    receive_s: list[float] = []
    v = 0
    try:
        for r in range(args.repeats):
            v += 1
            t0 = time.perf_counter()
            eng.load_weights(v, versions[v % 2])
            assert eng.wait_version(v, timeout=600)
            blob_s.append(time.perf_counter() - t0)
            v += 1
            offer = trainer.publish(v, versions[v % 2])
            assert offer is not None
            t0 = time.perf_counter()
            got = raas.receive(VersionInfo(policy="bench", version=v, weights_addr="", offers=[offer]), offer)
            t1 = time.perf_counter()
            assert got.slot is not None and eng.load_slot(v, got.slot)
            assert eng.wait_version(v, timeout=600), eng.last_error
            slot_s.append(time.perf_counter() - t1)
            receive_s.append(t1 - t0)
            got.release()
            print(
                f"round {r}: blob {blob_s[-1]:.3f}s  slot {slot_s[-1]:.3f}s  (receive {receive_s[-1]:.3f}s)"
            )
    finally:
        trainer.close()
        eng.close()
    rpc = {m: n for m, n in sent}
    blob, slot, recv = (statistics.median(x) for x in (blob_s, slot_s, receive_s))
    print(f"model {args.model}: {len(base)} tensors, {nbytes / 1e6:.1f} MB")
    print(
        f"blob through collective_rpc (baseline): {blob:.3f} s median, {rpc.get('astraflow_reload_weights', 0)} bytes sent"
    )
    print(
        f"slot by reference:                      {slot:.3f} s median, {rpc.get('astraflow_load_slot', 0)} bytes sent"
    )
    print(f"  the RaaS's receive of the slot (map + digest): {recv:.3f} s median")
    print(f"ratio blob / slot: {blob / slot:.2f}x;  blob / (receive + slot): {blob / (recv + slot):.2f}x")


if __name__ == "__main__":
    main()

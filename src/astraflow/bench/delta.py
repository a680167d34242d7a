"""How big a version's delta is on a real training run: `astraflow bench delta RECIPE`.

Runs the recipe through `astraflow up` with `weights.mode = "delta"` and reads back, per version, the
share of elements whose bits changed and the delta's size as a share of the full version (the trainer's
metrics `weights_delta_changed` / `weights_delta_bytes`, in the late rows of metrics.jsonl), the encode
time and the path it took (on the device, or on the host), and how the workers pulled (their counters in
logs/raas-<i>.stats.jsonl).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DELTA_SETS = ['weights.mode="delta"']
"""Overrides that turn deltas on (added after the user's own). The recipe's transports stay: a delta's
metrics reach metrics.jsonl whichever path announced its version first (the controller adds them to the
step's row when they come); `--set 'weights.transports=["zmq"]'` makes the workers pull by delta too."""


def delta_report(run_dir: Path) -> dict[str, Any]:
    """Per-version delta sizes of a finished run, their median, and the workers' pulls by way."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "weights_delta_bytes" in r]
    if not steps:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no delta metrics: was weights.mode delta?")
    resolved = json.loads((run_dir / "recipe.resolved.json").read_text())
    dtypes = {p["name"]: (p.get("trainer_options") or {}).get("dtype", "float32") for p in resolved["policy"]}
    pulls: dict[str, int] = {}
    for path in sorted((run_dir / "logs").glob("raas-*.stats.jsonl")):
        lines = path.read_text().splitlines()
        if lines:
            for k, v in json.loads(lines[-1]).get("weight_pulls", {}).items():
                pulls[k] = pulls.get(k, 0) + int(v)

    def median(key: str) -> float:
        xs = sorted(float(r[key]) for r in steps)
        return xs[len(xs) // 2]

    waits = sorted(
        float(r["trainer_publish_wait_s"]) for r in rows if "kind" not in r and "trainer_publish_wait_s" in r
    )

    return {
        "run_dir": str(run_dir),
        "trainer_dtype": dtypes,
        "versions": [
            {
                "policy": r.get("policy", ""),
                "version": r.get("version", r.get("step")),
                "changed": r["weights_delta_changed"],
                "bytes": r["weights_delta_bytes"],
                "encode_s": r["weights_delta_encode_s"],
                "path": "device" if r.get("weights_delta_on_device") else "host",
                "ready_s": r.get("weights_delta_ready_s"),
            }
            for r in steps
        ],
        "median_changed": median("weights_delta_changed"),
        "median_bytes": median("weights_delta_bytes"),
        "median_encode_s": median("weights_delta_encode_s"),
        "encode_paths": sorted({"device" if r.get("weights_delta_on_device") else "host" for r in steps}),
        "skipped": max(int(r.get("weights_delta_skipped", 0)) for r in steps),
        "publish_wait_s": {
            "steps": len(waits),
            "median": waits[len(waits) // 2] if waits else 0.0,
            "max": waits[-1] if waits else 0.0,
            "steps_waiting": sum(w > 0.05 for w in waits),
        },
        "pulls": pulls,
    }


def format_delta_report(rep: dict[str, Any]) -> str:
    """The report as a few plain lines."""
    lines = [f"trainer dtype: {rep['trainer_dtype']}"]
    lines += [
        f"  {v['policy']}@{v['version']}: changed {v['changed']:.2%} of elements, delta {v['bytes']:.2%}"
        f" of the full version, encoded in {v['encode_s'] * 1000:.1f} ms on the {v['path']}"
        for v in rep["versions"]
    ]
    lines.append(
        f"median over {len(rep['versions'])} versions: changed {rep['median_changed']:.2%}, "
        f"delta {rep['median_bytes']:.2%} of the full version, encode {rep['median_encode_s'] * 1000:.1f} ms"
        f" on the {'/'.join(rep['encode_paths'])}; versions without a delta (encoder busy): {rep['skipped']}"
    )
    w = rep["publish_wait_s"]
    lines.append(
        f"trainer waited on the previous publish (trainer_publish_wait_s): median {w['median'] * 1000:.1f} ms,"
        f" max {w['max'] * 1000:.1f} ms; over 50 ms in {w['steps_waiting']} of {w['steps']} steps"
    )
    lines.append(f"worker pulls by way: {rep['pulls']}")
    return "\n".join(lines)


def delta_speed(gb: float, changed: float = 0.01, seed: int = 0) -> dict[str, float]:
    """Seconds to encode (on the host; with CUDA, on the device too, checked to give the same bytes),
    copy-and-apply and hash a delta of a bf16 version of about `gb` GB in which a
    share `changed` of the elements (at random places) differ, beside a plain copy of the version (the
    baseline, measured in the same call). Sizes of random changes say nothing about real runs: see
    `delta_report` for those."""
    import hashlib
    import mmap
    import time

    import torch

    from astraflow.weights.delta import apply_delta, encode_delta
    from astraflow.weights.snapshot import bytes_to_state_dict, state_dict_to_bytes

    gen = torch.Generator().manual_seed(seed)
    rows = max(1, int(gb * 1e9 / 2 / 1024 / 16))
    base = {f"t{i}": torch.randn(rows, 1024, generator=gen).to(torch.bfloat16) for i in range(16)}
    target = {}
    for k, v in base.items():
        t = v.clone()
        t[torch.rand(v.shape, generator=gen) < changed] += 1.0
        target[k] = t
    base_blob, target_blob = state_dict_to_bytes(base), state_dict_to_bytes(target)
    full = len(memoryview(target_blob))
    t0 = time.perf_counter()
    head: dict[str, Any] = {"base_version": 0, "target_version": 1, "base_sha256": "", "target_sha256": ""}
    delta, stats = encode_delta(bytes_to_state_dict(base_blob), bytes_to_state_dict(target_blob), **head)
    t1 = time.perf_counter()
    buf = mmap.mmap(-1, full)
    view = memoryview(buf)[:full]
    view[:] = memoryview(base_blob)
    t2 = time.perf_counter()
    apply_delta(bytes_to_state_dict(view), delta)
    t3 = time.perf_counter()
    digest = hashlib.sha256(view).hexdigest()
    t4 = time.perf_counter()
    if digest != hashlib.sha256(target_blob).hexdigest():
        raise AssertionError("the patched version is not the target")
    out = {}
    if torch.cuda.is_available():  # the trainer's path for a GPU snapshot: the same pair on the device
        from astraflow.weights.delta import assemble
        from astraflow.weights.delta_device import device_parts

        on_dev = [{k: v.cuda() for k, v in sd.items()} for sd in (base, target)]
        for _ in range(2):  # the first call pays for the kernels' first launch
            torch.cuda.synchronize()
            t5 = time.perf_counter()
            blob, _ = assemble(device_parts(on_dev[0], on_dev[1]), **head)
        out["device_encode_s"] = time.perf_counter() - t5
        if bytes(memoryview(blob)) != bytes(memoryview(delta)):
            raise AssertionError("the device encoder made other bytes than the host encoder")
    return {
        **out,
        "full_gb": full / 1e9,
        "delta_fraction": stats.nbytes / full,
        "encode_s": t1 - t0,
        "copy_s": t2 - t1,
        "apply_s": t3 - t2,
        "sha256_s": t4 - t3,
        "encode_vs_copy": (t1 - t0) / max(1e-9, t2 - t1),
    }

"""The end-to-end benchmark: one recipe through `astraflow up`, read back as throughput, busy fractions and
weight-sync times.

Everything is measured over the run's steady window, from the first step any policy finished to the
last (process start-up, model loading and the first step's compilation are left out):

- samples/s: trajectories stored from tasks whose results came in during the window (state.db; with
  their generated tokens), and sequences the trainers consumed (`batch_size`), per second of the window.
  The run's final checkpoint is written before its last step is recorded, so its time is taken off the
  window's end and off each trainer's span.
- trainer busy: the policy's summed `trainer_compute_s` (its steps' own work, each ended by a device
  synchronisation; `trainer_sleep_s` excluded) over the time between its first and last step.
- engine busy: per RaaS worker and policy, the growth of the engine's `busy_s` (wall time of its decode
  thread's weight applications, prefills and decode steps, each ended by a device synchronisation)
  between the worker's last stats line before the window and its first after it (metrics/role_stats.py;
  a line every INTERVAL_S, so this span exceeds a short window by up to that much), over that span's
  length. Two engines in one worker run concurrently, so their fractions can add up to more than 1.
  Beside the prefill share: prefill forwards per admitted row over the same span (engines/slot_admission.py
  decides how many admissions there are; a GRPO group admitted whole is one prompt of one forward).
- GPU utilisation (GPU runs only): the share of NVML's sample periods in which a kernel ran on each GPU,
  sampled by this process every SAMPLE_S seconds, averaged over the window. A coarse cross-check: a GPU
  counts as busy for a whole period even when one small kernel ran.
- weight sync per step: the trainer's `trainer_publish_s` (its critical-path share: snapshot + wait), the
  worker's fetch (transfer and digest check) and load (bytes to tensors, shape check, staging) per version
  staged inside the window (each pull is listed with its time), and the engine's apply (copy into the parameters and the running rows' KV recomputed); lag is
  the time from the controller recording a version to an engine decoding with it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from astraflow.metrics.role_stats import RECENT, read_stats
from astraflow.state import trajectories
from astraflow.state.store import Store

SAMPLE_S = 0.2
"""Seconds between two GPU utilisation samples."""


class GpuSampler:
    """Samples every GPU's utilisation through NVML in a thread; does nothing where NVML is missing."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[float], list[float]]] = []
        """(time, utilisation per GPU in [0, 1], memory used per GPU in GiB)."""
        self.names: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self.names = [str(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._nvml = pynvml
        except Exception:  # no NVML library, no driver or no GPU: a CPU run has nothing to sample
            self._handles = []

    @property
    def available(self) -> bool:
        """Whether there is a GPU to sample."""
        return bool(self._handles)

    def start(self) -> GpuSampler:
        """Start sampling (no-op without a GPU)."""
        if self.available:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.wait(SAMPLE_S):
            try:
                util = [nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0 for h in self._handles]
                mem = [nv.nvmlDeviceGetMemoryInfo(h).used / 2**30 for h in self._handles]
            except Exception:  # a transient NVML error costs one sample
                continue
            self.samples.append((time.time(), util, mem))

    def window(self, t0: float, t1: float) -> dict[str, Any] | None:
        """Mean utilisation and peak memory of each GPU between t0 and t1 (None without samples)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return None
        n = len(inside[0][1])
        return {
            "names": self.names,
            "samples": len(inside),
            "util_mean": [sum(s[1][i] for s in inside) / len(inside) for i in range(n)],
            "mem_peak_gib": [max(s[2][i] for s in inside) for i in range(n)],
        }


def _at(lines: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """The newest stats line written at or before t (the first line if none is)."""
    best = lines[0]
    for ln in lines:
        if float(ln["time"]) <= t:
            best = ln
        else:
            break
    return best


def _after(lines: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """The oldest stats line written at or after t (the last line if none is): with `_at(lines, t0)` it
    spans the window [t0, t] from outside, so a worker that wrote seldom (a loaded machine, a window
    shorter than INTERVAL_S) still has two distinct lines around it."""
    for ln in lines:
        if float(ln["time"]) >= t:
            return ln
    return lines[-1]


def _pulls_in(pa: dict[str, Any], pb: dict[str, Any], t0: float, t1: float) -> tuple[int, dict[str, float]]:
    """The pulls staged in [t0, t1] and their summed fetch_s, load_s and bytes: from the later line's list
    of recent pulls where it reaches back to t0, else the cumulative counters' growth between the lines."""
    recent = pb.get("recent")
    if recent is not None and (len(recent) < RECENT or (recent and float(recent[0][0]) <= t0)):
        inside = [x for x in recent if t0 <= float(x[0]) <= t1]
        sums = {k: sum(float(x[i]) for x in inside) for i, k in ((1, "fetch_s"), (2, "load_s"), (3, "bytes"))}
        return len(inside), sums
    n = int(pb.get("pulls", 0)) - int(pa.get("pulls", 0))
    return n, {k: float(pb.get(k, 0.0)) - float(pa.get(k, 0.0)) for k in ("fetch_s", "load_s", "bytes")}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def generated_in(run_dir: Path, t0: float, t1: float) -> dict[str, tuple[int, int]]:
    """Per policy, (trajectories, their generated tokens) stored from tasks whose result came in [t0, t1]."""
    store = Store.open_readonly(run_dir / "state.db")
    try:
        return trajectories.generated_between(store, t0, t1)
    finally:
        store.close()


def read_policies(
    rows: dict[str, list[dict[str, Any]]], generated: dict[str, tuple[int, int]], t0: float, t1: float
) -> dict[str, Any]:
    """Per policy: pace, samples/s, reward, trainer busy fraction and publish time, from metrics rows."""
    out: dict[str, Any] = {}
    window = t1 - t0
    for pol, recs in rows.items():
        # the step's own end (a background publish may announce its version a step later)
        ts = [float(r.get("trainer_done_at", r["time"])) for r in recs]
        steady = recs[1:]
        # a checkpoint is disk time, not the pipeline's pace: take out those inside the span. A step's
        # checkpoint comes after its trainer_done_at (so the last step's is outside the span, the first
        # step's inside) but before its row's `time`
        ckpt = [float(r.get("trainer_checkpoint_s", 0.0)) for r in recs]
        inside = ckpt[:-1] if "trainer_done_at" in recs[-1] else ckpt[1:]
        span = ts[-1] - ts[0] - sum(inside)
        compute = sum(float(r.get("trainer_compute_s", 0.0)) for r in steady)
        out[pol] = {
            "steps": len(recs),
            "s_per_step": span / (len(recs) - 1) if len(recs) > 1 else None,
            "generated_per_s": generated.get(pol, (0, 0))[0] / window if window > 0 else None,
            "generated_tokens_per_s": generated.get(pol, (0, 0))[1] / window if window > 0 else None,
            "trained_per_s": sum(float(r.get("batch_size", 0.0)) for r in steady) / window
            if window > 0
            else None,
            "reward_first": float(recs[0].get("reward_mean", 0.0)),
            "reward_last": float(recs[-1].get("reward_mean", 0.0)),
            "reward_mean": sum(float(r.get("reward_mean", 0.0)) for r in recs) / len(recs),
            "trainer_busy": compute / span if span > 0 else None,
            "trainer_compute_s": _mean([float(r.get("trainer_compute_s", 0.0)) for r in steady]),
            "trainer_wait_s": _mean([float(r.get("trainer_wait_s", 0.0)) for r in steady]),
            "publish_s": _mean([float(r["trainer_publish_s"]) for r in recs if "trainer_publish_s" in r]),
            "staleness_mean": sum(float(r.get("staleness_mean", 0.0)) for r in recs) / len(recs),
        }
    return out


def read_workers(
    run_dir: Path, published: dict[tuple[str, int], float], t0: float, t1: float
) -> dict[str, Any]:
    """Per RaaS worker (its stats file): each engine's busy fraction over the window, and weight pulls."""
    out: dict[str, Any] = {}
    for path in sorted((run_dir / "logs").glob("raas-*.stats.jsonl")):
        lines = read_stats(path)
        if not lines:
            continue
        a, b = _at(lines, t0), _after(lines, t1)
        dt = float(b["time"]) - float(a["time"])
        engines: dict[str, Any] = {}
        for name, eb in b["engines"].items():
            ea = a["engines"].get(name, {})
            if "busy_s" not in eb:
                engines[name] = {"version": eb.get("version")}
                continue

            def grown(key: str, eb: dict[str, Any] = eb, ea: dict[str, Any] = ea) -> float:
                return float(eb.get(key, 0.0)) - float(ea.get(key, 0.0))

            n, sums = _pulls_in(ea.get("pulls", {}), eb.get("pulls", {}), t0, t1)

            def per_pull(key: str, sums: dict[str, float] = sums, n: int = n) -> float | None:
                return sums[key] / n if n > 0 else None

            applies = [x for x in eb.get("applies", []) if t0 <= float(x[1]) <= t1]
            lags = [
                float(x[1]) - published[(name, int(x[0]))] for x in applies if (name, int(x[0])) in published
            ]
            engines[name] = {
                "busy": grown("busy_s") / dt if dt > 0 else None,
                "decode_share": grown("decode_s") / dt if dt > 0 else None,
                "prefill_share": grown("prefill_s") / dt if dt > 0 else None,
                # prefill forwards per admitted row (absent in stats files of older engines)
                "prefill_per_row": grown("prefill_forwards") / grown("admitted_rows")
                if grown("admitted_rows") > 0
                else None,
                "weight_share": grown("weight_s") / dt if dt > 0 else None,
                # waiting for requests with nothing to decode (absent in stats files of older engines)
                "starved_share": grown("starved_s") / dt if dt > 0 and "starved_s" in eb else None,
                "decode_rows_per_s": grown("row_steps") / dt if dt > 0 else None,
                "mean_batch": grown("row_steps") / grown("decode_steps")
                if grown("decode_steps") > 0
                else None,
                "pulls": n,
                "fetch_s": per_pull("fetch_s"),
                "load_s": per_pull("load_s"),
                "mb_per_pull": (per_pull("bytes") or 0.0) / 1e6 if n > 0 else None,
                "applied": len(applies),
                "apply_s": _mean([float(x[2]) for x in applies]),
                # of which the running rows' KV recompute (absent in stats files of older engines)
                "kv_recompute_s": _mean([float(x[3]) for x in applies if len(x) > 3]),
                "lag_s": _mean(lags),
            }
        out[path.name.removesuffix(".stats.jsonl")] = {"window_s": dt, "engines": engines}
    return out


def read_e2e(run_dir: Path, gpus: GpuSampler | None = None) -> dict[str, Any]:
    """The report of one finished run directory (see the module docstring)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "policy" in rec and "step" in rec and "kind" not in rec:  # eval and late rows are not steps
                rows.setdefault(str(rec["policy"]), []).append(rec)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no step rows")
    for recs in rows.values():
        recs.sort(key=lambda r: r["step"])
    t0 = min(float(r[0]["time"]) for r in rows.values())
    last = max((r[-1] for r in rows.values()), key=lambda r: float(r["time"]))
    # the run's last step ends with the final checkpoint's write: leave it out of the window
    t1 = float(last["time"]) - float(last.get("trainer_checkpoint_s", 0.0))
    published = {(p, int(r["version"])): float(r["time"]) for p, recs in rows.items() for r in recs}
    policies = read_policies(rows, generated_in(run_dir, t0, t1), t0, t1)
    workers = read_workers(run_dir, published, t0, t1)
    for name, p in policies.items():
        parts = [e for w in workers.values() for n, e in w["engines"].items() if n == name and e.get("pulls")]
        fetch = _mean([e["fetch_s"] for e in parts])
        load = _mean([e["load_s"] for e in parts])
        apply = _mean([e["apply_s"] for e in parts if e.get("apply_s") is not None])
        recompute = _mean([e["kv_recompute_s"] for e in parts if e.get("kv_recompute_s") is not None])
        known = [v for v in (p["publish_s"], fetch, load, apply) if v is not None]
        p["weight_sync"] = {
            "publish_s": p["publish_s"],
            "fetch_s": fetch,
            "load_s": load,
            "apply_s": apply,
            "kv_recompute_s": recompute,
            "total_s": sum(known) if len(known) == 4 else None,
            "lag_s": _mean([e["lag_s"] for e in parts if e.get("lag_s") is not None]),
        }
    gen = sum(p["generated_per_s"] or 0.0 for p in policies.values())
    trained = sum(p["trained_per_s"] or 0.0 for p in policies.values())
    return {
        "run_dir": str(run_dir),
        "window_s": t1 - t0,
        "generated_per_s": gen if t1 > t0 else None,
        "trained_per_s": trained if t1 > t0 else None,
        "policies": policies,
        "workers": workers,
        "gpus": gpus.window(t0, t1) if gpus is not None else None,
    }


def format_report(rep: dict[str, Any]) -> str:
    """A plain-text report of read_e2e's result."""

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"steady window {rep['window_s']:.1f}s: samples/s generated {f(rep['generated_per_s'], '.1f')}, "
        f"trained {f(rep['trained_per_s'], '.1f')}",
        f"{'policy':<12} {'steps':>5} {'s/step':>7} {'gen/s':>8} {'train/s':>8} {'reward first>last':>18} "
        f"{'trainer busy':>12} {'compute s':>9} {'wait s':>7} {'publish s':>9}",
    ]
    for name, p in rep["policies"].items():
        lines.append(
            f"{name:<12} {p['steps']:>5} {f(p['s_per_step'], '.2f'):>7} {f(p['generated_per_s'], '.1f'):>8} "
            f"{f(p['trained_per_s'], '.1f'):>8} {p['reward_first']:>8.3f} > {p['reward_last']:<7.3f} "
            f"{f(p['trainer_busy'], '.0%'):>12} {f(p['trainer_compute_s'], '.2f'):>9} "
            f"{f(p['trainer_wait_s'], '.2f'):>7} {f(p['publish_s'], '.2f'):>9}"
        )
    for name, p in rep["policies"].items():
        w = p["weight_sync"]
        lines.append(
            f"{name}: weight sync per step {f(w['total_s'], '.2f')}s = publish {f(w['publish_s'], '.2f')} + "
            f"fetch {f(w['fetch_s'], '.2f')} + load {f(w['load_s'], '.2f')} + apply {f(w['apply_s'], '.2f')} "
            f"(of which the running rows' KV recompute {f(w.get('kv_recompute_s'), '.2f')}); "
            f"recorded -> decoding lag {f(w['lag_s'], '.2f')}s"
        )
    for wname, w in rep["workers"].items():
        lines.append(f"{wname}:")
        for ename, e in w["engines"].items():
            if "busy" not in e:
                lines.append(f"  engine {ename}: no stats (engine without stats())")
                continue
            lines.append(
                f"  engine {ename}: busy {f(e['busy'], '.0%')} (decode {f(e['decode_share'], '.0%')}, prefill "
                f"{f(e['prefill_share'], '.0%')} at {f(e.get('prefill_per_row'), '.3f')} forwards/row, weights {f(e['weight_share'], '.0%')}; "
                f"starved {f(e.get('starved_share'), '.0%')}), "
                f"{f(e['decode_rows_per_s'], '.0f')} tokens/s in decode, mean batch {f(e['mean_batch'], '.0f')}, "
                f"{e['pulls']} pulls of {f(e['mb_per_pull'], '.0f')} MB, {e['applied']} versions applied"
            )
    g = rep.get("gpus")
    if g:
        for i, u in enumerate(g["util_mean"]):
            name = g["names"][i] if i < len(g["names"]) else "?"
            lines.append(
                f"GPU {i} ({name}): NVML utilisation {u:.0%}, peak memory {g['mem_peak_gib'][i]:.1f} GiB"
            )
    return "\n".join(lines)

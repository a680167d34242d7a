"""One metric of several runs on one figure, written as a PNG (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from astraflow.errors import AstraflowError


def plot_runs(
    run_dirs: list[Path], metric: str, out: Path, policy: str | None = None, smooth: int = 1
) -> list[str]:
    """Plot `metric` against step for each run (and policy); returns the labels of the curves drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise AstraflowError(
            "astraflow plot needs matplotlib", hint="pip install 'astraflow[plot]'"
        ) from None
    from astraflow.metrics.export import metric_rows

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    labels: list[str] = []
    for run_dir in run_dirs:
        by_policy: dict[str, list[tuple[int, float]]] = {}
        for r in metric_rows(run_dir):
            pol = str(r.get("policy", "?"))
            if (policy is None or pol == policy) and isinstance(r.get(metric), int | float):
                by_policy.setdefault(pol, []).append((int(r["step"]), float(r[metric])))
        for pol, pts in sorted(by_policy.items()):
            pts.sort()
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            if smooth > 1:
                ys = [
                    sum(ys[max(0, i - smooth + 1) : i + 1]) / len(ys[max(0, i - smooth + 1) : i + 1])
                    for i in range(len(ys))
                ]
            label = run_dir.name if len(by_policy) == 1 else f"{run_dir.name}/{pol}"
            ax.plot(xs, ys, label=label, linewidth=1.4)
            labels.append(label)
    if not labels:
        plt.close(fig)
        raise AstraflowError(
            f"no run has metric {metric!r}", hint="docs/metrics.md lists the names (e.g. reward_mean)"
        )
    ax.set_xlabel("step")
    ax.set_ylabel(metric + (f" (mean of {smooth})" if smooth > 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return labels

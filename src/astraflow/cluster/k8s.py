"""`astraflow launch k8s`: a kustomize base (plain YAML manifests) for one run on Kubernetes.

What it writes: the resolved recipe as a ConfigMap; the key store made here as Secrets (the
controller's store, one Secret per trainer, one for the RaaS workers' keys); the controller as a
one-replica StatefulSet whose volume holds state.db, behind a Service, ready when `astraflow status`
answers; each trainer as an indexed Job with a volume for its checkpoints (a restarted pod resumes
from them); the RaaS workers as a StatefulSet.

Why RaaS is a StatefulSet and not a Deployment: the controller admits a worker only under the member
id its key was registered with, and a Deployment's pods have random names. A StatefulSet's pods are
raas-0, raas-1, ...: each takes the key of its ordinal, and `kubectl scale` works up to the number of
worker keys made (--raas-max).

Over 400 lines because one run's manifests are built together: they name each other's services,
labels, secrets and volumes.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.cluster.plan import Plan
from astraflow.config.recipe import AutoscaleConfig

PORT = 7600
"""The controller's port in its pod and on its Service."""
METRICS_PORT = 9600
"""The metrics sidecar's port (Prometheus text on /metrics)."""


@dataclass(frozen=True)
class K8sOptions:
    """How the manifests are shaped; everything else comes from the recipe."""

    name: str
    """Prefix of every object's name (a DNS label)."""
    image: str
    """Container image with astraflow (and the recipe's plugins) installed."""
    namespace: str = ""
    """Namespace of every object; empty: the one kubectl applies to."""
    gpus_per_raas: int = 0
    """nvidia.com/gpu per RaaS pod (0: CPU)."""
    trainer_gpus: bool = False
    """Give each trainer pod one nvidia.com/gpu per rank."""
    storage: str = "10Gi"
    """Size of the controller's and each trainer's volume."""
    models_claim: str = ""
    """A PersistentVolumeClaim with the models, mounted read-only at /models in every pod."""
    offline: bool = False
    """Set every library's offline switch in every pod."""
    metrics: bool = False
    """Run `astraflow metrics-serve` beside the controller (port 9600 on its Service)."""
    autoscale: AutoscaleConfig | None = None
    """Scale the RaaS StatefulSet with a HorizontalPodAutoscaler on astraflow_slot_demand (implies metrics)."""
    drain_timeout_s: float = 10.0
    """rollout.drain_timeout_s: a RaaS pod gets this plus 30 s to drain after SIGTERM."""
    run_name: str = ""
    """run.name: the `run` label of the exported metrics the autoscaler selects."""


def _labels(opts: K8sOptions, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "astraflow",
        "app.kubernetes.io/instance": opts.name,
        "astraflow/role": component,
    }


def _meta(opts: K8sOptions, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"{opts.name}-{name}", "labels": _labels(opts, component)}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    return meta


def _env(opts: K8sOptions) -> list[dict[str, Any]]:
    from astraflow.cluster.slurm import OFFLINE_ENV

    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if opts.offline:
        env.update(OFFLINE_ENV)
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    out.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return out


def _secret(opts: K8sOptions, name: str, files: dict[str, Path]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(opts, name, "keys"),
        "type": "Opaque",
        "stringData": {k: p.read_text() for k, p in files.items()},
    }


def _secret_volume(opts: K8sOptions, volume: str, secret: str) -> dict[str, Any]:
    return {"name": volume, "secret": {"secretName": f"{opts.name}-{secret}", "defaultMode": 0o400}}


def _common_volumes(
    opts: K8sOptions, store: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The recipe in every pod, the models if a claim is named, and the key store where `store` (the
    controller; the trainers, whose weight servers admit only registered members' keys)."""
    volumes: list[dict[str, Any]] = [{"name": "recipe", "configMap": {"name": f"{opts.name}-recipe"}}]
    mounts: list[dict[str, Any]] = [
        {"name": "recipe", "mountPath": "/etc/astraflow/recipe", "readOnly": True}
    ]
    if store:
        volumes.append(_secret_volume(opts, "keys", "keys"))
        mounts.append({"name": "keys", "mountPath": "/etc/astraflow/keys", "readOnly": True})
    if opts.models_claim:
        volumes.append(
            {"name": "models", "persistentVolumeClaim": {"claimName": opts.models_claim, "readOnly": True}}
        )
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
    return volumes, mounts


def _container(
    opts: K8sOptions, name: str, args: list[str], mounts: list[dict[str, Any]], gpus: int
) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "image": opts.image,
        "command": ["sh", "-c", " ".join(args)],
        "env": _env(opts),
        "volumeMounts": mounts,
    }
    if gpus:
        c["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    return c


KEYS = "/etc/astraflow/keys"
RECIPE = "/etc/astraflow/recipe/recipe.resolved.json"


def controller_objects(opts: K8sOptions) -> list[dict[str, Any]]:
    """The controller's Service and StatefulSet (state.db on its volume claim)."""
    volumes, mounts = _common_volumes(opts)
    mounts = [*mounts, {"name": "run", "mountPath": "/var/lib/astraflow"}]
    container = _container(
        opts,
        "controller",
        [
            "exec python -m astraflow controller",
            RECIPE,
            "--run-dir /var/lib/astraflow/run",
            f"--keys {KEYS}",
            f"--bind tcp://0.0.0.0:{PORT}",
        ],
        mounts,
        0,
    )
    container["ports"] = [{"name": "control", "containerPort": PORT}]
    probe = (
        f"python -m astraflow status --controller tcp://127.0.0.1:{PORT} "
        f"--key /etc/astraflow/observer/observer.key_secret --controller-key {KEYS}/controller.key"
    )
    container["readinessProbe"] = {
        "exec": {"command": ["sh", "-c", probe]},
        "initialDelaySeconds": 5,
        "periodSeconds": 15,
        "timeoutSeconds": 10,
    }
    container["volumeMounts"].append(
        {"name": "observer", "mountPath": "/etc/astraflow/observer", "readOnly": True}
    )
    volumes.append(_secret_volume(opts, "observer", "observer"))
    containers = [container]
    ports = [{"name": "control", "port": PORT, "targetPort": PORT}]
    pod_meta: dict[str, Any] = {}
    if opts.metrics or opts.autoscale is not None:
        containers.append(_metrics_sidecar(opts, mounts))
        ports.append({"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT})
        pod_meta["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(METRICS_PORT),
            "prometheus.io/path": "/metrics",
        }
    selector = _labels(opts, "controller")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(opts, "controller", "controller"),
        "spec": {"selector": selector, "ports": ports},
    }
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(opts, "controller", "controller"),
        "spec": {
            "serviceName": f"{opts.name}-controller",
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector, **pod_meta},
                "spec": {"containers": containers, "volumes": volumes},
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "run"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": opts.storage}},
                    },
                }
            ],
        },
    }
    return [service, sts]


def _metrics_sidecar(opts: K8sOptions, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """`astraflow metrics-serve` asking the controller beside it, with the observer key."""
    c = _container(
        opts,
        "metrics",
        [
            "exec python -m astraflow metrics-serve",
            f"--bind 0.0.0.0:{METRICS_PORT}",
            f"--controller tcp://127.0.0.1:{PORT}",
            "--key /etc/astraflow/observer/observer.key_secret",
            f"--controller-key {KEYS}/controller.key",
        ],
        [m for m in mounts if m["name"] in ("keys", "observer")],
        0,
    )
    c["ports"] = [{"name": "metrics", "containerPort": METRICS_PORT}]
    return c


def autoscaler_object(plan: Plan, opts: K8sOptions, cfg: AutoscaleConfig, keys: int) -> dict[str, Any]:
    """A HorizontalPodAutoscaler of the RaaS StatefulSet on the external metric astraflow_slot_demand
    (tasks queued or leased; an adapter such as prometheus-adapter serves it from the sidecar's
    /metrics): replicas = ceil(demand / slots per worker) within min..max, one pod per cooldown_s
    each way after the condition held window_s. A pod removed on scale-down gets SIGTERM and drains."""
    period = max(1, min(1800, int(cfg.cooldown_s)))
    window = max(0, min(3600, int(cfg.window_s)))
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(opts, "raas", "raas"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": f"{opts.name}-raas"},
            "minReplicas": cfg.min,
            "maxReplicas": min(cfg.max, keys),
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": "astraflow_slot_demand",
                            "selector": {"matchLabels": {"run": opts.run_name}},
                        },
                        "target": {"type": "AverageValue", "averageValue": str(plan.slots)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": window,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": period}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": window,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": period}],
                },
            },
        },
    }


def _member_args(role: str, controller_key: str) -> list[str]:
    return [
        "exec python -m astraflow join",
        f"--role {role}",
        f'--controller "tcp://$CONTROLLER:{PORT}"',
        f"--controller-key {controller_key}",
        "--connect-timeout 600",
    ]


def trainer_objects(plan: Plan, opts: K8sOptions) -> list[dict[str, Any]]:
    """Per trainable policy: a checkpoint volume claim and an indexed Job (one index: one node)."""
    out: list[dict[str, Any]] = []
    for m in plan.trainers:
        assert m.policy is not None
        volumes, mounts = _common_volumes(opts)
        volumes += [
            _secret_volume(opts, "member", m.name),
            {
                "name": "checkpoints",
                "persistentVolumeClaim": {"claimName": f"{opts.name}-{m.name}-checkpoints"},
            },
        ]
        mounts = [
            *mounts,
            {"name": "member", "mountPath": "/etc/astraflow/member", "readOnly": True},
            {"name": "checkpoints", "mountPath": "/var/lib/astraflow/checkpoints"},
        ]
        args = [
            *_member_args("trainer", f"{KEYS}/controller.key"),
            f"--policy {shlex.quote(m.policy)}",
            f"--member-id {m.name}",
            f"--key /etc/astraflow/member/{m.name}.key_secret",
            f"--keys {KEYS}",
            "--checkpoint-dir /var/lib/astraflow/checkpoints",
            '--advertise "$POD_IP"',
            *([f"--nproc {m.nproc}"] if m.nproc > 1 else []),
        ]
        container = _container(opts, "trainer", args, mounts, m.nproc if opts.trainer_gpus else 0)
        container["env"].append({"name": "CONTROLLER", "value": f"{opts.name}-controller"})
        out.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": _meta(opts, f"{m.name}-checkpoints", "trainer"),
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": opts.storage}},
                },
            }
        )
        labels = {**_labels(opts, "trainer"), "astraflow/policy": m.policy}
        out.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": _meta(opts, m.name, "trainer"),
                "spec": {
                    "completionMode": "Indexed",
                    "completions": 1,
                    "parallelism": 1,
                    "backoffLimit": 6,
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {"restartPolicy": "OnFailure", "containers": [container], "volumes": volumes},
                    },
                },
            }
        )
    return out


def raas_objects(plan: Plan, opts: K8sOptions) -> list[dict[str, Any]]:
    """The RaaS workers: a headless Service and a StatefulSet whose pod N uses key raas-N."""
    volumes, mounts = _common_volumes(opts, store=False)
    volumes.append(_secret_volume(opts, "raas-keys", "raas-keys"))
    mounts = [*mounts, {"name": "raas-keys", "mountPath": "/etc/astraflow/raas-keys", "readOnly": True}]
    args = [
        'ORD="${HOSTNAME##*-}";',
        *_member_args("raas", "/etc/astraflow/raas-keys/controller.key"),
        '--member-id "raas-$ORD"',
        '--key "/etc/astraflow/raas-keys/raas-$ORD.key_secret"',
        f"--slots {plan.slots}",
    ]
    container = _container(opts, "raas", args, mounts, opts.gpus_per_raas)
    container["env"].append({"name": "CONTROLLER", "value": f"{opts.name}-controller"})
    selector = _labels(opts, "raas")
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(opts, "raas", "raas"),
            "spec": {"clusterIP": "None", "selector": selector},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _meta(opts, "raas", "raas"),
            "spec": {
                "serviceName": f"{opts.name}-raas",
                "replicas": len(plan.raas),
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {"labels": selector},
                    "spec": {
                        "containers": [container],
                        "volumes": volumes,
                        # SIGTERM drains a worker (scale-down, rollout): give it the time to finish
                        "terminationGracePeriodSeconds": int(opts.drain_timeout_s) + 30,
                    },
                },
            },
        },
    ]


def secret_objects(plan: Plan, opts: K8sOptions, raas_names: list[str]) -> list[dict[str, Any]]:
    """The key store made by the launch: the controller's store, each trainer's key, the workers' keys."""
    keys = plan.keys
    out = [
        _secret(
            opts,
            "keys",
            {f: keys / f for f in ("controller.key", "controller.key_secret", "members.json")},
        ),
        _secret(opts, "observer", {"observer.key_secret": plan.secret("observer")}),
        _secret(
            opts,
            "raas-keys",
            {"controller.key": keys / "controller.key"}
            | {f"{n}.key_secret": plan.secret(n) for n in raas_names},
        ),
    ]
    out += [_secret(opts, m.name, {f"{m.name}.key_secret": plan.secret(m.name)}) for m in plan.trainers]
    return out


def recipe_object(plan: Plan, opts: K8sOptions) -> dict[str, Any]:
    """The resolved recipe as a ConfigMap."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(opts, "recipe", "recipe"),
        "data": {"recipe.resolved.json": plan.resolved.read_text()},
    }


def write(plan: Plan, opts: K8sOptions, out: Path, raas_names: list[str]) -> list[Path]:
    """Write the manifests and their kustomization.yaml into `out`; returns the manifest files."""
    import yaml

    files = {
        "recipe.yaml": [recipe_object(plan, opts)],
        "secrets.yaml": secret_objects(plan, opts, raas_names),
        "controller.yaml": controller_objects(opts),
        "trainers.yaml": trainer_objects(plan, opts),
        "raas.yaml": raas_objects(plan, opts),
    }
    if opts.autoscale is not None:
        files["autoscale.yaml"] = [autoscaler_object(plan, opts, opts.autoscale, len(raas_names))]
    paths = []
    for name, docs in files.items():
        path = out / name
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False, width=120))
        if name == "secrets.yaml":
            path.chmod(0o600)
        paths.append(path)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(files),
    }
    (out / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return paths

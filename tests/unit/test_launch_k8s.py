"""`astraflow launch k8s`: the manifests validate against the Kubernetes schemas (kubernetes-validate
ships them, so this runs offline) and carry the run's keys, recipe, volumes and probes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _launch(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow",
            "launch",
            "k8s",
            str(ROOT / "recipes/quickstart/recipe.toml"),
            "--out",
            str(tmp_path / "k8s"),
            "--image",
            "registry.example/astraflow:0.1",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("k8s")
    out = _launch(tmp, "--raas", "2", "--raas-max", "4", "--models-claim", "models", "--namespace", "rl")
    assert out.returncode == 0, out.stdout + out.stderr
    base = tmp / "k8s"
    kust = yaml.safe_load((base / "kustomization.yaml").read_text())
    docs = [d for f in kust["resources"] for d in yaml.safe_load_all((base / f).read_text())]
    return base, docs


def _one(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_every_manifest_validates_against_the_kubernetes_schema(manifests: tuple[Path, list[dict]]) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (in the dev extra)"
    )
    _, docs = manifests
    assert {d["kind"] for d in docs} == {
        "ConfigMap",
        "Secret",
        "Service",
        "StatefulSet",
        "Job",
        "PersistentVolumeClaim",
    }
    for doc in docs:
        kv.validate(doc, kv.latest_version(), strict=True)  # raises on an unknown field or a wrong type
    broken = json.loads(json.dumps(_one(docs, "StatefulSet", "af-quickstart-controller")))
    broken["spec"]["replica"] = 1  # a typo a schema check must catch
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.latest_version(), strict=True)


def test_manifests_carry_the_runs_keys_recipe_and_roles(manifests: tuple[Path, list[dict]]) -> None:
    base, docs = manifests
    assert all(d["metadata"].get("namespace") == "rl" for d in docs)
    store = _one(docs, "Secret", "af-quickstart-keys")["stringData"]
    assert store["controller.key_secret"] == (base / "keys/controller.key_secret").read_text()
    members = json.loads(store["members.json"])["members"]
    assert {n for n in members} >= {"trainer-main", "raas-0", "raas-3", "observer"}
    workers = _one(docs, "Secret", "af-quickstart-raas-keys")["stringData"]
    assert sorted(workers) == ["controller.key", *[f"raas-{i}.key_secret" for i in range(4)]]
    assert "controller.key_secret" not in workers  # workers never see the controller's secret
    recipe = json.loads(_one(docs, "ConfigMap", "af-quickstart-recipe")["data"]["recipe.resolved.json"])
    assert recipe["policy"][0]["model"] == "/models/tiny-qwen3"
    ctl = _one(docs, "StatefulSet", "af-quickstart-controller")
    assert ctl["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "run"
    c = ctl["spec"]["template"]["spec"]["containers"][0]
    assert "astraflow status --controller" in c["readinessProbe"]["exec"]["command"][-1]
    assert "--run-dir /var/lib/astraflow/run" in c["command"][-1]
    job = _one(docs, "Job", "af-quickstart-trainer-main")
    assert job["spec"]["completionMode"] == "Indexed"
    args = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "--checkpoint-dir /var/lib/astraflow/checkpoints" in args and "--policy main" in args
    raas = _one(docs, "StatefulSet", "af-quickstart-raas")
    assert raas["spec"]["replicas"] == 2
    assert (
        '--key "/etc/astraflow/raas-keys/raas-$ORD.key_secret"'
        in raas["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    )
    assert (base / "secrets.yaml").stat().st_mode & 0o077 == 0


def test_a_bad_name_prefix_is_refused(tmp_path: Path) -> None:
    out = _launch(tmp_path, "--name", "Bad_Name")
    assert out.returncode == 2 and "not a usable Kubernetes name" in out.stderr
    assert not (tmp_path / "k8s").exists()


def test_autoscaled_workers_get_an_hpa_on_the_exported_demand(tmp_path: Path) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (in the dev extra)"
    )
    sets = ["rollout.autoscale.enabled=true", "rollout.autoscale.max=6", "rollout.autoscale.cooldown_s=45"]
    out = _launch(tmp_path, "--raas", "1", *[a for s in sets for a in ("--set", s)])
    assert out.returncode == 0, out.stdout + out.stderr
    base = tmp_path / "k8s"
    kust = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert "autoscale.yaml" in kust["resources"]
    docs = [d for f in kust["resources"] for d in yaml.safe_load_all((base / f).read_text())]
    for doc in docs:
        kv.validate(doc, kv.latest_version(), strict=True)
    hpa = _one(docs, "HorizontalPodAutoscaler", "af-quickstart-raas")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "af-quickstart-raas",
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 6)
    [metric] = hpa["metrics"]
    assert metric["external"]["metric"] == {
        "name": "astraflow_slot_demand",
        "selector": {"matchLabels": {"run": "quickstart"}},
    }
    assert metric["external"]["target"] == {
        "type": "AverageValue",
        "averageValue": "32",
    }  # the recipe's slots
    assert hpa["behavior"]["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 45}]
    # a key for every replica the HPA may start; a removed pod has time to drain
    workers = _one(docs, "Secret", "af-quickstart-raas-keys")["stringData"]
    assert sorted(workers) == ["controller.key", *[f"raas-{i}.key_secret" for i in range(6)]]
    raas = _one(docs, "StatefulSet", "af-quickstart-raas")["spec"]["template"]["spec"]
    assert raas["terminationGracePeriodSeconds"] == 40
    # the metrics sidecar asks the controller beside it with the observer key
    ctl = _one(docs, "StatefulSet", "af-quickstart-controller")["spec"]["template"]
    sidecar = [c for c in ctl["spec"]["containers"] if c["name"] == "metrics"][0]
    assert "metrics-serve --bind 0.0.0.0:9600 --controller tcp://127.0.0.1:7600" in sidecar["command"][-1]
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"keys", "observer"}
    assert ctl["metadata"]["annotations"]["prometheus.io/port"] == "9600"
    svc = _one(docs, "Service", "af-quickstart-controller")["spec"]["ports"]
    assert {"name": "metrics", "port": 9600, "targetPort": 9600} in svc

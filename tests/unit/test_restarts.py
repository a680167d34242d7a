"""The restart policy `astraflow up` and `launch ray` share (launch/restarts.py), and the command
lines `launch ray` gives its roles (cluster/ray_placement.py), without a Ray cluster."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from astraflow.cluster.plan import Member, Plan
from astraflow.cluster.ray_placement import Placement, RayOptions
from astraflow.launch.restarts import MAX_RAAS_RESTARTS, MAX_TRAINER_RESTARTS, restart_rules, rule_for


def test_each_role_restarts_up_to_its_limit() -> None:
    svc = SimpleNamespace(name="judge", max_restarts=1)
    rules = restart_rules(SimpleNamespace(service=[svc]))
    trainer, raas = rule_for(rules, "trainer", "trainer-main"), rule_for(rules, "raas", "raas-0")
    assert [trainer.after(n, False) for n in range(MAX_TRAINER_RESTARTS + 1)] == ["restart"] * 2 + ["fail"]
    # a trainer is never a spare: another trainer running does not carry a policy that lost its own
    assert trainer.after(MAX_TRAINER_RESTARTS, True) == "fail"
    assert raas.after(MAX_RAAS_RESTARTS - 1, False) == "restart"
    # past its limit a worker is given up on while another one runs, else the run ends
    assert raas.after(MAX_RAAS_RESTARTS, True) == "spare" and raas.after(MAX_RAAS_RESTARTS, False) == "fail"
    assert rule_for(rules, "controller", "controller").after(0, True) == "fail"
    assert rule_for(rules, "service", "service-judge").after(0, False) == "restart"
    assert rule_for(rules, "service", "service-judge").after(1, False) == "fail"
    assert rule_for(rules, "service", "service-other").after(0, False) == "fail"
    assert restart_rules(SimpleNamespace(), 0)["raas"].after(0, True) == "spare"


def test_ray_roles_get_the_commands_up_gives_them(tmp_path: Path) -> None:
    plan = Plan(tmp_path, [Member("trainer-main", "trainer", "main", 2)], [Member("raas-0", "raas")], 4)
    place = Placement(None, plan, RayOptions(port=7600, trainer_gpus=True, offline=True))
    ctl = place.argv(Member("controller", "controller"), "")
    assert ctl == ["controller", str(tmp_path / "recipe.resolved.json"), "--run-dir", str(tmp_path)] + [
        "--bind",
        "tcp://0.0.0.0:7600",
    ]
    raas = place.argv(plan.raas[0], "tcp://10.0.0.1:7600")
    assert raas[:7] == [
        "join",
        "--role",
        "raas",
        "--controller",
        "tcp://10.0.0.1:7600",
        "--member-id",
        "raas-0",
    ]
    assert raas[-2:] == ["--slots", "4"] and "--policy" not in raas
    trainer = place.argv(plan.trainers[0], "tcp://10.0.0.1:7600")
    assert trainer[-2:] == ["--nproc", "2"] and "--checkpoint-dir" in trainer and "--slots" not in trainer
    assert str(tmp_path / "keys/members/trainer-main.key_secret") in trainer
    assert place.gpus(plan.trainers[0]) == 2.0 and place.gpus(plan.raas[0]) == 0.0
    assert place.env(plan.raas[0])["HF_HUB_OFFLINE"] == "1"

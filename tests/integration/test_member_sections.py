"""Each member receives only the recipe's sections its role reads (roles/member_sections.py): real
members (MemberClient) join a real controller process over a real socket, and the Welcome that
reaches them carries no other policy's section, nor the dataset, controller or service tables."""

from __future__ import annotations

import signal
from pathlib import Path

from astraflow.protocol.codec import encode
from astraflow.roles.member import make_hello
from astraflow.roles.raas_sections import RaaSSections
from astraflow.roles.trainer_sections import TrainerSections
from astraflow.transport.client import MemberClient
from tests.integration.test_controller import RECIPE, _start

SECRET_A = "/models/only-for-a"
SECRET_B = "/models/only-for-b"

TWO_POLICIES = {
    **RECIPE,
    # the workflow's one role maps to policy-a (the first policy); policy-b trains on its own tasks of
    # nobody's workflow here, so no rollout worker of this run needs its section
    "policy": [
        {**RECIPE["policy"][0], "name": "policy-a", "model": SECRET_A},
        {**RECIPE["policy"][0], "name": "policy-b", "model": SECRET_B},
    ],
}


def _welcome(addr: str, role: str, member_id: str, policies: list[str]):  # type: ignore[no-untyped-def]
    client = MemberClient(addr, make_hello(role, member_id, policies=policies), connect_timeout_s=60.0)
    try:
        return client.connect()
    finally:
        client.close("done")


def test_each_member_gets_only_its_own_sections(tmp_path: Path) -> None:
    proc, addr = _start(tmp_path, TWO_POLICIES)
    try:
        welcome = _welcome(addr, "raas", "raas-a", ["policy-a"])
        wire = encode(welcome)
        assert SECRET_B.encode() not in wire and b"policy-b" not in wire  # B's section never left
        raas = RaaSSections.from_wire(welcome.sections)
        assert list(raas.policies) == ["policy-a"] and raas.policies["policy-a"].model == SECRET_A
        assert raas.roles == {"actor": "policy-a"} and raas.seed == 3
        assert raas.rollout.lease_timeout_s == 1.0 and raas.workflow.name == "quickstart"
        assert not {"dataset", "controller", "service", "metrics", "eval"} & set(welcome.sections)

        welcome = _welcome(addr, "trainer", "trainer-policy-b", ["policy-b"])
        wire = encode(welcome)
        assert SECRET_A.encode() not in wire and b"policy-a" not in wire  # nor A's to B's trainer
        trainer = TrainerSections.from_wire(welcome.sections)
        assert trainer.policy.name == "policy-b" and trainer.policy.model == SECRET_B
        assert trainer.budget == 2 and trainer.run_name == "ctl-test" and trainer.eval is False

        welcome = _welcome(addr, "observer", "watcher", [])
        assert welcome.sections == {}
        assert SECRET_A.encode() not in encode(welcome) and SECRET_B.encode() not in encode(welcome)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

"""Idle members beat less often, live: a controller process with a small controller.idle_beats_per_s
and a real member process (a MemberClient) on loopback. Idle, the member beats at the long interval
and stays alive well past member_timeout_s; killed (SIGKILL), it is declared dead within its own
timeout; given tasks, it renews their leases at the recipe's interval (none lapses)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from astraflow.protocol.messages import StatusReply, StatusRequest
from astraflow.roles.controller.beat_pace import timeout_scale
from tests.integration.test_controller import RECIPE, Peer, _start

HEARTBEAT_S = 0.25
TIMEOUT_S = 1.0
IDLE_S = 2.0
"""One member and idle_beats_per_s = 0.5: the idle interval."""

MEMBER = r"""
import json, os, sys, time
from pathlib import Path
from astraflow.protocol.messages import PROTOCOL_VERSION, Hello, TaskRequest
from astraflow.transport.client import MemberClient

addr, out = sys.argv[1], Path(sys.argv[2])
hello = Hello(member_id="idle-a", role="raas", protocol=PROTOCOL_VERSION, policies=["main"], slots=4,
              pid=os.getpid(), host="h")
client = MemberClient(addr, hello, heartbeat_interval_s=9.0, credentials=None)
client.connect()
active = []
while True:
    client.tick()
    if out.with_suffix(".work").exists() and not active:
        grant = client.request(TaskRequest(n=2, loaded={"main": 0}))
        active = [t.task_id for t in grant.tasks]
        client.set_progress(active)
    state = {"beats": client.beats_sent, "idle_s": client.idle_interval_s, "active": active,
             "at": time.monotonic()}
    out.with_suffix(".tmp").write_text(json.dumps(state))
    out.with_suffix(".tmp").replace(out)
    time.sleep(0.05)
"""


@pytest.fixture()
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _recipe() -> dict[str, Any]:
    return {
        **RECIPE,
        "rollout": {"lease_timeout_s": 1.0},
        "controller": {
            "heartbeat_interval_s": HEARTBEAT_S,
            "member_timeout_s": TIMEOUT_S,
            "idle_beats_per_s": 1 / IDLE_S,
        },
    }


def _member(addr: str, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", MEMBER, addr, str(out)], env=env)


def _state(out: Path) -> dict[str, Any]:
    for _ in range(200):
        if out.exists():
            return dict(json.loads(out.read_text()))
        time.sleep(0.05)
    raise AssertionError("the member wrote no state")


def _status(peer: Peer) -> dict[str, Any]:
    reply = peer.ask(StatusRequest())
    assert isinstance(reply, StatusReply)
    return reply.status


def _wait_told(out: Path) -> float:
    """Wait until the member says the controller told it IDLE_S; returns the deadline it waited by."""
    deadline = time.monotonic() + 10
    while _state(out)["idle_s"] != IDLE_S:
        assert time.monotonic() < deadline, _state(out)
        time.sleep(0.1)
    return deadline


def _member_status(peer: Peer) -> str:
    return {m["id"]: m["status"] for m in _status(peer)["members"]}.get("idle-a", "")


@contextlib.contextmanager
def _controller_and_idle_member(
    tmp_path: Path, ctx: zmq.Context
) -> Iterator[tuple[subprocess.Popen[bytes], Path, Peer]]:
    """A controller process and one member process (its state file) and an observer peer; both
    processes are stopped on the way out."""
    proc, addr = _start(tmp_path, _recipe())
    out = tmp_path / "member.json"
    member = _member(addr, out)
    try:
        yield member, out, Peer(ctx, addr, "observer")
    finally:
        member.kill()
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)


def test_an_idle_member_beats_at_its_interval_lives_and_dies_by_its_own_timeout(
    tmp_path: Path, ctx: zmq.Context
) -> None:
    with _controller_and_idle_member(tmp_path, ctx) as (member, out, observer):
        _wait_told(out)  # the controller tells the new interval at its first answer after the join
        time.sleep(IDLE_S)
        first = _state(out)
        time.sleep(4 * IDLE_S)  # eight times member_timeout_s
        last = _state(out)
        beats = last["beats"] - first["beats"]
        span = last["at"] - first["at"]
        assert span / IDLE_S - 1 <= beats <= span / IDLE_S + 1  # not span / HEARTBEAT_S (32)
        assert _member_status(observer) == "alive"
        member.send_signal(signal.SIGKILL)
        member.wait(5)
        killed = time.monotonic()
        own = TIMEOUT_S * timeout_scale(IDLE_S, HEARTBEAT_S)
        while _member_status(observer) == "alive":
            assert time.monotonic() - killed < own + 2.0, "not declared dead within its own timeout"
            time.sleep(0.1)
        assert _member_status(observer) == "dead"
        # never before member_timeout_s times the beats it missed: it was alive for TIMEOUT_S at least
        assert time.monotonic() - killed > TIMEOUT_S


def test_a_member_given_tasks_renews_their_leases_at_the_recipes_interval(
    tmp_path: Path, ctx: zmq.Context
) -> None:
    with _controller_and_idle_member(tmp_path, ctx) as (_, out, observer):
        deadline = _wait_told(out)
        time.sleep(IDLE_S)  # beating at the idle interval, longer than lease_timeout_s
        (tmp_path / "member.work").touch()
        while not _state(out)["active"]:
            assert time.monotonic() < deadline + 10
            time.sleep(0.05)
        held = _state(out)
        time.sleep(4.0)  # four lease timeouts
        now = _state(out)
        assert now["beats"] - held["beats"] >= 4.0 / HEARTBEAT_S - 4
        status = _status(observer)
        assert status["tasks"].get("leased", 0) == len(held["active"]) > 0
        assert status["failures"]["by_reason"].get("lease expired", 0) == 0
        assert _member_status(observer) == "alive"

"""Groups of (task, policy, group key): workflow group keys, per-role baselines in self-play,
read-only policies not kept, episode info aggregated per policy and role."""

from __future__ import annotations

from pathlib import Path

from astraflow.config.recipe import PolicyConfig, Recipe, WorkflowConfig
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.pipeline import Pipeline
from astraflow.protocol.messages import Episode, SamplingParams, Sequence
from astraflow.state.store import Store


def _seq(policy: str, reward: float, role: str = "", key: str = "") -> Sequence:
    return Sequence(
        policy=policy,
        tokens=[1, 2],
        loss_mask=[0, 1],
        logprobs=[0.0, -1.0],
        versions=[-1, 0],
        reward=reward,
        role=role,
        group_key=key,
        sampling=SamplingParams(),
    )


def _advantages(store: Store, policy: str) -> dict[tuple[str, float], float]:
    return {
        (r["group_key"] or r["role"], float(r["reward"])): float(r["advantage"])
        for r in store.query(
            "SELECT role, group_key, reward, advantage FROM trajectories WHERE policy = ?", (policy,)
        )
    }


def test_group_keys_roles_read_only_and_info(tmp_path: Path) -> None:
    recipe = Recipe(
        policy=[
            PolicyConfig(name="a", model="m", advantage="drgrpo"),
            PolicyConfig(name="b", model="m", advantage="drgrpo"),
        ],
        workflow=WorkflowConfig(name="collab", roles={"proposer": "a", "solver": "a", "judge": "b"}),
    )  # type: ignore[arg-type]
    store = Store.open(tmp_path / "s.db")
    pipe = Pipeline(recipe.policy, store, seed=recipe.run.seed)
    pipe.split_roles = {"a"}  # a plays two roles: one baseline each
    buf = Buffer(store)
    episodes = [
        Episode(
            sequences=[
                _seq("a", 1.0, "proposer"),
                _seq("a", 0.0, "solver", "p0"),
                _seq("a", 1.0, "solver", "p0"),
                _seq("b", 5.0, "judge"),
            ],
            info={"solved": 0.5, "note": "text is ignored"},
        ),
        Episode(
            sequences=[
                _seq("a", 0.0, "proposer"),
                _seq("a", 0.6, "solver", "p1"),
                _seq("a", 0.2, "solver", "p1"),
            ],
            info={"solved": 0.4},
        ),
    ]
    out = pipe.ingest(buf, 1, "k", episodes, read_only={"b"})
    assert sorted(len(g.traj_ids) for g in out) == [2, 2, 2]  # proposer, solver p0, solver p1; b not kept
    adv = _advantages(store, "a")
    # each group is centred on its own mean: the proposer's, and each proposal's solver attempts
    assert adv[("proposer", 1.0)] == 0.5 and adv[("proposer", 0.0)] == -0.5
    assert adv[("p0", 1.0)] == 0.5 and abs(adv[("p1", 0.6)] - 0.2) < 1e-9
    assert store.scalar("SELECT COUNT(*) FROM trajectories WHERE policy = 'b'") == 0
    info = pipe.take_info("a", [1, 1])
    assert abs(info["info/solved"] - 0.45) < 1e-9 and abs(info["info/solver/solved"] - 0.45) < 1e-9
    assert "info/note" not in info and pipe.take_info("a", [2]) == {}  # only the batch's tasks count
    assert pipe.take_info("a", [1]) == info and pipe.take_info("b", [1]) == {}  # b was read-only
    ids = [int(r["id"]) for r in store.query("SELECT id FROM trajectories")]
    roles = buf.role_metrics(ids)
    assert roles["role/solver/sequences"] == 4.0 and roles["role/proposer/reward_mean"] == 0.5
    # without split roles (two policies, or baseline_per_role = False) the proposer and solver sequences
    # without a group key share one group
    pipe.split_roles = set()
    out = pipe.ingest(
        buf, 2, "k2", [Episode(sequences=[_seq("a", 1.0, "proposer"), _seq("a", 0.0, "solver")])]
    )
    assert [len(g.traj_ids) for g in out] == [2]

"""The reference server's lookup game with drawn keys and values (`--draw`): each task's key and value
follow its seed and index, so tasks of another seed are held out, and only a lookup answers them."""

from __future__ import annotations

import json

from astraflow.workflows.env_protocol.reference import WORDS, Game, sft_rows


def _ask(game: Game, seed: int, index: int) -> tuple[str, str]:
    start = game.reset({"task": {"index": index, "seed": seed}})
    state = game.sessions[start["session"]]
    assert state["key"] in start["observation"]
    return state["key"], state["word"]


def test_drawn_tasks_follow_seed_and_index() -> None:
    game = Game(tools=True, draw=True, keys=16)
    a = [_ask(game, 0, i) for i in range(64)]
    assert a == [_ask(game, 0, i) for i in range(64)]  # the same task is the same question
    b = [_ask(game, 1, i) for i in range(64)]
    assert a != b
    keys = {k for k, _ in a + b}
    assert keys <= {f"k{i}" for i in range(16)} and len(keys) > 8
    # a key does not fix its value: the same key has different values across tasks
    values: dict[str, set[str]] = {}
    for k, w in a + b:
        values.setdefault(k, set()).add(w)
    assert any(len(v) > 1 for v in values.values())
    # without draw the game is as before: k0 is apple, whatever the seed
    plain = Game(tools=True)
    assert _ask(plain, 5, 8) == ("k0", WORDS[0])


def test_drawn_episode_rewards_a_lookup_then_the_value() -> None:
    game = Game(tools=True, draw=True, keys=16)
    start = game.reset({"task": {"index": 3, "seed": 7}})
    sid, state = start["session"], game.sessions[start["session"]]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"key": state["key"]})},
    }
    out = game.step({"session": sid, "action": "", "tool_calls": [call]})
    assert out["tool_results"][0]["content"] == state["word"]
    assert game.step({"session": sid, "action": state["word"]})["done"]
    assert game.reward({"session": sid})["reward"] == 1.0


def test_sft_rows_of_drawn_tasks_answer_with_the_looked_up_value() -> None:
    rows = sft_rows(8, draw=True, keys=16, seed=100)
    game = Game(tools=True, draw=True, keys=16)
    for i, row in enumerate(rows):
        key, word = _ask(game, 100, i)
        msgs = row["messages"]
        assert json.loads(msgs[2]["tool_calls"][0]["function"]["arguments"]) == {"key": key}
        assert msgs[3]["content"] == word and msgs[4]["content"] == word

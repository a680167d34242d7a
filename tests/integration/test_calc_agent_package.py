"""The outside package examples/calc-agent, installed with pip into a folder of its own: its warm-start
rows render through a real chat template as the policy sees them, its environment server runs as a
process and speaks the env_server protocol, and both of its recipes validate against astraflow's
workflows. The learning itself is measured by scripts/agent_learning.py (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import install_isolated, uninstall_isolated

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "calc-agent"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """pip-install a copy of the package into a folder of its own (on sys.path and PYTHONPATH while
    this module's tests run)."""
    try:
        import pip  # noqa: F401
    except ImportError:
        pytest.skip("pip is not available in this interpreter: cannot install the example package")
    site = install_isolated(PACKAGE, tmp_path_factory.mktemp("calc-agent"))
    yield site
    uninstall_isolated(site)


def test_warm_start_rows_teach_the_taught_operations_only(installed: Path) -> None:
    from calc_agent import game

    rows = game.sft_rows(600, seed=100, teach=("add",))
    named: Counter[tuple[str, bool]] = Counter()
    for i, row in enumerate(rows):
        task = {"index": i, "seed": 100}
        call = row["messages"][2]["tool_calls"][0]["function"]
        result = row["messages"][3]["content"]
        assert result == game.run_tool(task, call["name"]) == row["messages"][4]["content"]
        named[game.problem(task)["op"], call["name"] == game.problem(task)["op"]] += 1
    assert named["add", False] == 0 and named["add", True] > 150, named
    for op in ("subtract", "multiply"):  # about a third: the tool is drawn, not chosen
        share = named[op, True] / (named[op, True] + named[op, False])
        assert 0.2 < share < 0.47, named
    with pytest.raises(ValueError, match="unknown operations"):
        game.sft_rows(1, seed=0, teach=("divide",))
    held_out = {game.problem({"index": i, "seed": 1})["question"] for i in range(32)}
    trained = {game.problem({"index": i, "seed": 0})["question"] for i in range(1024)}
    assert len(held_out - trained) >= 24  # the held-out seed's questions are mostly unseen


def test_rows_render_through_the_bpe_chat_template(installed: Path, tmp_path: Path) -> None:
    """The rows' tool calls render in the one format the endpoint and env_server parse."""
    from calc_agent import game

    from astraflow.models.bpe import build_bpe_tokenizer
    from astraflow.workflows.openai.tool_calls import TOOL_CALL

    corpus = tmp_path / "rows.jsonl"
    rows = game.sft_rows(8, seed=3)
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_bpe_tokenizer(corpus, 300)
    text = tok.apply_chat_template(rows[0]["messages"], tools=rows[0]["tools"], tokenize=False)
    name = rows[0]["messages"][2]["tool_calls"][0]["function"]["name"]
    turn = text.split("<|im_start|>assistant\n", 1)[1]
    assert [json.loads(m) for m in TOOL_CALL.findall(turn)][:1] == [{"name": name, "arguments": {}}]
    assert '"name": "multiply"' in text  # the tools block lists all three


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_environment_server_process_plays_the_protocol(installed: Path) -> None:
    from calc_agent import game

    proc = subprocess.Popen(
        [sys.executable, "-m", "calc_agent.server", "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("listening on "), line
        url = line.split()[-1]
        task = {"index": 5, "seed": 9}
        op = game.problem(task)["op"]
        wrong = next(n for n in game.OPS if n != op)

        def episode(tool: str, say: str | None = None) -> dict[str, Any]:
            start = post(f"{url}/reset", {"task": task})
            assert start["tools"] == game.TOOLS and start["observation"] == game.problem(task)["question"]
            call = {"id": "call_1", "type": "function", "function": {"name": tool, "arguments": "{}"}}
            out = post(f"{url}/step", {"session": start["session"], "action": "", "tool_calls": [call]})
            assert out["done"] is False and out["tool_results"][0]["tool_call_id"] == "call_1"
            result = out["tool_results"][0]["content"]
            end = post(f"{url}/step", {"session": start["session"], "action": say or result})
            assert end["done"] is True
            first = post(f"{url}/reward", {"session": start["session"]})
            assert post(f"{url}/reward", {"session": start["session"]}) == first  # idempotent
            return first

        right = episode(op)
        assert right["reward"] == 1.0 and right["info"] == {"calculator_calls": 1, "right_tool": 1.0}
        assert episode(wrong)["reward"] == 0.0  # the wrong tool's result is the wrong answer
        assert episode(wrong, say=game.answer(task))["reward"] == 1.0  # the answer is what is scored
        assert episode(wrong, say=game.answer(task))["info"]["right_tool"] == 0.0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("path", ["endpoint", "env"])
def test_recipes_validate(installed: Path, path: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "astraflow", "recipe", "check", str(PACKAGE / "recipes" / f"{path}.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr

"""`astraflow bench rollout-stream` end to end on the tiny model: it streams every group under each rule
and its counts show the greedy rule's extra prefills where rows end at random lengths."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from astraflow.bench.rollout_stream import format_stream_table, parse_rules, run_stream_bench
from astraflow.cli.main import app
from astraflow.errors import AstraflowError
from astraflow.models.init import init_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("stream") / "m", seed=0)


def test_the_stream_bench_counts_fewer_prefills_per_row_under_the_rule(model_dir: Path) -> None:
    res = run_stream_bench(
        model_dir, [0, 8], max_batch=16, group=8, in_flight=4, groups=12, new_tokens=24, stops=2,
        device="cpu", repeats=1,
    )  # fmt: skip
    greedy, rule = res.rounds[0][0], res.rounds[8][0]
    assert greedy.tokens_per_s > 0 and rule.tokens_per_s > 0
    # the rule prefills each group's prompt in one admission: 1/8 forward per row at most
    assert rule.forwards_per_row <= 1 / 8 < greedy.forwards_per_row
    table = format_stream_table(res)
    assert "fwd/row" in table and len(table.splitlines()) == 5


def test_bad_rules_are_refused() -> None:
    assert parse_rules("0,16, 64") == [0, 16, 64]
    for bad in ("", "a", "-1", "4,4"):
        with pytest.raises(AstraflowError):
            parse_rules(bad)


def test_the_command_prints_the_table(model_dir: Path) -> None:
    out = CliRunner().invoke(
        app,
        ["bench", "rollout-stream", "--model", str(model_dir), "--rules", "0,4", "--max-batch", "8",
         "--group", "4", "--in-flight", "3", "--groups", "4", "--new-tokens", "6", "--repeats", "1",
         "--device", "cpu"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "admit_min_free" in out.output

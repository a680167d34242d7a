"""The first hour: a recipe's model_init builds a missing model, a directory that is no model is refused
up front, `astraflow logs` merges roles by time, hand-started roles log into the run directory."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from astraflow.cli.logs import LogFollower
from astraflow.config.recipe import ModelInitConfig
from astraflow.errors import RecipeError
from astraflow.models.dirs import check_models


class _Policy:
    def __init__(self, model: Path, model_init: ModelInitConfig | None) -> None:
        self.name, self.model, self.model_init = "main", str(model), model_init


class _Recipe:
    def __init__(self, *policies: _Policy) -> None:
        self.policy = list(policies)


def test_model_init_builds_a_missing_model(tmp_path: Path) -> None:
    out = tmp_path / "models" / "tiny"
    check_models(_Recipe(_Policy(out, ModelInitConfig(preset="tiny", seed=3))))
    assert (out / "config.json").is_file()
    assert any(out.glob("*.safetensors"))


def test_missing_model_without_model_init_names_both_ways(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as exc:
        check_models(_Recipe(_Policy(tmp_path / "nope", None)))
    assert "model_init" in exc.value.hint and "astraflow model init" in exc.value.hint


def test_a_directory_that_is_not_a_model_is_refused_up_front(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="not a model directory"):
        check_models(_Recipe(_Policy(tmp_path / "empty", ModelInitConfig())))


def test_model_init_command_is_the_cli_command() -> None:
    cmd = ModelInitConfig(tokenizer="bpe", corpus="c.txt", vocab_size=320).command("models/x")
    assert cmd == (
        "astraflow model init --arch qwen3 --preset tiny --seed 0 --tokenizer bpe --corpus c.txt "
        "--vocab-size 320 --out models/x"
    )


def test_logs_merge_roles_by_time(tmp_path: Path) -> None:
    (tmp_path / "controller.log").write_text(
        "10:00:01 controller I a\n10:00:03 controller I c\nTraceback line of c\n"
    )
    (tmp_path / "raas-0.log").write_text("10:00:02 raas-0 I b\n10:00:04 raas-0 I d\n")
    lines = [line for _, line in LogFollower(tmp_path).read()]
    assert lines == [
        "10:00:01 controller I a",
        "10:00:02 raas-0 I b",
        "10:00:03 controller I c",
        "Traceback line of c",
        "10:00:04 raas-0 I d",
    ]


def test_add_file_writes_the_role_log(tmp_path: Path) -> None:
    from astraflow import log

    log.setup("controller")
    path = tmp_path / "controller.log"
    logger = logging.getLogger("astraflow")
    before = list(logger.handlers)
    try:
        log.add_file(path)
        log.get("test").warning("hello file")
        for h in logger.handlers[len(before) :]:
            h.flush()
        assert "hello file" in path.read_text()
    finally:
        for h in logger.handlers[len(before) :]:
            logger.removeHandler(h)
            h.close()


def test_missing_model_names_the_recipes_own_commands(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        "# a smoke recipe whose model is trained first:\n"
        "#   astraflow model init --preset tiny --out m/base\n"
        "#   astraflow sft m/base data.jsonl --out m/sft --epochs 3\n"
        "#   astraflow up r.toml\n"
    )
    with pytest.raises(RecipeError) as exc:
        check_models(_Recipe(_Policy(Path("m/sft"), None)), source=recipe)
    assert exc.value.hint == (
        "create it as the recipe's comments say: astraflow model init --preset tiny --out m/base; "
        "astraflow sft m/base data.jsonl --out m/sft --epochs 3"
    )
    with pytest.raises(RecipeError) as exc:  # a model its comments do not make: the generic hint
        check_models(_Recipe(_Policy(Path("m/other"), None)), source=recipe)
    assert "policy.model_init" in exc.value.hint


def test_the_log_writes_to_the_stderr_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that swapped stderr for a while and closed its stand-in (a CLI runner in process)
    leaves the log writing to the stderr of now, not to the closed stand-in."""
    import io

    from astraflow import log

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler = log._Stderr()
    record = logging.LogRecord("astraflow.t", logging.WARNING, __file__, 1, "%s", ("line",), None)
    handler.emit(record)
    monkeypatch.setattr(sys, "stderr", second)
    first.close()
    handler.emit(record)
    handler.flush()
    assert second.getvalue() == "line\n"


def test_the_log_can_still_be_sent_to_a_file_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` moves the launcher's lines to logs/up.log under the dashboard (setStream), then back."""
    import io

    from astraflow import log

    err, up_log = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    handler = log._Stderr()
    record = logging.LogRecord("astraflow.t", logging.WARNING, __file__, 1, "%s", ("line",), None)
    handler.setStream(up_log)
    handler.emit(record)
    handler.setStream(sys.stderr)
    handler.emit(record)
    assert up_log.getvalue() == "line\n" and err.getvalue() == "line\n"

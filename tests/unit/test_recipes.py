"""Every recipe in the repository validates, with its plugins, and overrides behave."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astraflow.config.load import apply_override, load_recipe, parse_value, validate_plugins, validate_recipe
from astraflow.errors import PluginError, RecipeError

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").rglob("*.toml"))


def test_there_are_recipes() -> None:
    assert any(p.parent.name == "quickstart" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_recipe_validates(path: Path) -> None:
    recipe = load_recipe(path)
    validate_plugins(recipe)
    assert recipe.run.steps >= 1 and recipe.policy


def test_set_overrides_reach_nested_and_every_policy() -> None:
    r = load_recipe(
        ROOT / "recipes/quickstart/recipe.toml",
        ["run.steps=7", "policy.optimizer.lr=0.5", "policy.0.group_size=3"],
    )
    assert r.run.steps == 7
    assert r.policy[0].optimizer.lr == 0.5
    assert r.policy[0].group_size == 3


def test_parse_value_types() -> None:
    assert parse_value("3") == 3 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value("[1, 2]") == [1, 2] and parse_value("abc") == "abc" and parse_value('"x y"') == "x y"


def test_apply_override_on_list_by_index() -> None:
    data = {"policy": [{"name": "a"}, {"name": "b"}]}
    apply_override(data, "policy.1.name", "c")
    assert data["policy"][1]["name"] == "c" and data["policy"][0]["name"] == "a"


def test_unknown_field_is_a_clear_error() -> None:
    with pytest.raises(RecipeError) as exc:
        validate_recipe({"policy": [{"model": "m", "learning_rate": 1}]})
    assert "policy.0.learning_rate" in str(exc.value)


def test_duplicate_policy_names_rejected() -> None:
    with pytest.raises(RecipeError, match="unique"):
        validate_recipe({"policy": [{"name": "a", "model": "m"}, {"name": "a", "model": "m"}]})


def test_several_policies_allowed_by_schema() -> None:
    r = validate_recipe(
        {
            "policy": [{"name": "solver", "model": "m"}, {"name": "verifier", "model": "m"}],
            "workflow": {"roles": {"actor": "solver"}},
        }
    )
    assert [p.name for p in r.policy] == ["solver", "verifier"]


def test_missing_plugin_lists_installed() -> None:
    r = validate_recipe({"policy": [{"model": "m", "loss": "nope"}]})
    with pytest.raises(PluginError) as exc:
        validate_plugins(r)
    assert "grpo" in exc.value.hint


def test_bad_plugin_options_rejected() -> None:
    r = validate_recipe({"policy": [{"model": "m", "loss_options": {"clip_lo": 0.1}}]})
    with pytest.raises(RecipeError, match="clip_lo"):
        validate_plugins(r)


def test_extends_merges_tables_and_policies(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text(
        '[run]\nname = "b"\nsteps = 5\n\n[[policy]]\nmodel = "m"\ngroup_size = 4\n'
    )
    (tmp_path / "v.toml").write_text(
        'extends = "base.toml"\n[run]\nsteps = 9\n\n[[policy]]\nbatch_prompts = 2\n'
    )
    r = load_recipe(tmp_path / "v.toml")
    assert (r.run.name, r.run.steps) == ("b", 9)
    assert (r.policy[0].model, r.policy[0].group_size, r.policy[0].batch_prompts) == ("m", 4, 2)


def test_unset_removes_keys_of_the_base(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text(
        '[run]\nname = "b"\nsteps = 5\n\n[[policy]]\nmodel = "m"\ngroup_size = 4\n'
        'loss_options = { tau = 0.1 }\n\n[[policy.data]]\nname = "dynamic_sampling"\n'
    )
    (tmp_path / "v.toml").write_text(
        'extends = "base.toml"\nunset = ["run.name", "policy.0.data", "policy.0.loss_options.tau"]\n'
        "[[policy]]\nbatch_prompts = 2\n"
    )
    r = load_recipe(tmp_path / "v.toml")
    assert r.run.name != "b" and r.run.steps == 5
    assert r.policy[0].data == [] and r.policy[0].loss_options == {} and r.policy[0].batch_prompts == 2
    for bad, match in [
        ('unset = ["run.nope"]', "no 'nope'"),
        ('unset = ["policy.3.data"]', "no '3'"),
        ('unset = "run"', "list of dotted keys"),
    ]:
        (tmp_path / "w.toml").write_text(f'extends = "base.toml"\n{bad}\n')
        with pytest.raises(RecipeError, match=match):
            load_recipe(tmp_path / "w.toml")
    (tmp_path / "x.toml").write_text('unset = ["run"]\n')
    with pytest.raises(RecipeError, match="has no `extends`"):
        load_recipe(tmp_path / "x.toml")


def test_extends_cycle_and_missing_base_are_errors(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.toml")
    (tmp_path / "c.toml").write_text('extends = "nope.toml"\n')
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "c.toml")


def test_bad_trainer_and_engine_options_rejected_before_any_process_starts() -> None:
    r = validate_recipe({"policy": [{"model": "m", "trainer_options": {"dtype": "float8"}}]})
    with pytest.raises(RecipeError, match="trainer_options.dtype"):
        validate_plugins(r)
    r = validate_recipe({"policy": [{"model": "m", "engine_options": {"max_btach": 4}}]})
    with pytest.raises(RecipeError, match="engine_options.max_btach"):
        validate_plugins(r)


def test_words_smoke_data_is_what_its_generator_writes(tmp_path: Path) -> None:
    import importlib.util

    data = ROOT / "recipes/math/data"
    spec = importlib.util.spec_from_file_location("make_words", data / "make_words.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(tmp_path)
    names = ["words-train.jsonl", "words-heldout.jsonl", "words-sft.jsonl", "words-corpus.txt"]
    assert all((tmp_path / n).read_text() == (data / n).read_text() for n in names)
    train = {json.loads(x)["question"] for x in (data / "words-train.jsonl").read_text().splitlines()}
    held = {json.loads(x)["question"] for x in (data / "words-heldout.jsonl").read_text().splitlines()}
    assert len(train) == 28 and len(held) == 6 and not train & held


def test_builtin_options_models_are_the_plugins_own() -> None:
    """`up` checks engine and trainer options through the torch-free models registered in
    astraflow.options: they must be exactly what the plugins themselves validate with."""
    from astraflow import plugins

    for group in ("engines", "trainers"):
        assert plugins.options_model(group, "torch") is plugins.load(group, "torch").Config

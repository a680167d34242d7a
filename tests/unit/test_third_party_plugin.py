"""A separately installed package adds a data stage through the astraflow.data entry point."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from astraflow import plugins
from astraflow.config.load import validate_options, validate_plugins, validate_recipe
from astraflow.data.base import GroupFilter, GroupView
from astraflow.errors import RecipeError
from tests.conftest import install_isolated, uninstall_isolated

PACKAGE = Path(__file__).resolve().parents[1] / "plugins" / "astraflow-example-data"
NAME = "key_pattern"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """pip-install a copy of the example package into a folder of its own (on sys.path and PYTHONPATH
    while the module's tests run; the test environment itself is never changed)."""
    try:
        import pip  # noqa: F401
    except ImportError:
        pytest.skip("pip is not available in this interpreter: cannot install the example plugin")
    site = install_isolated(PACKAGE, tmp_path_factory.mktemp("plugin"))
    yield
    uninstall_isolated(site)


def recipe_data(options: dict[str, object]) -> dict[str, object]:
    """A minimal recipe whose only policy uses the third-party stage."""
    return {
        "run": {"steps": 1},
        "policy": [{"model": "models/tiny", "data": [{"name": NAME, "options": options}]}],
    }


def test_listed_without_import_and_loadable(installed: None) -> None:
    rows = {p.name: p for p in plugins.list_plugins("astraflow.data")["astraflow.data"]}
    assert NAME in rows
    assert rows[NAME].distribution == "astraflow-example-data"
    assert rows[NAME].target == "astraflow_example_data:KeyPatternFilter"
    cls = plugins.load("data", NAME)
    assert issubclass(cls, GroupFilter) and cls.__name__ == "KeyPatternFilter"
    stage = cls(cls.Config(pattern="^scratch-"), policy="main", seed=0)
    view = GroupView(
        task_id=1, prompt_key="scratch-7", policy="main", rewards=[1.0], advantages=[0.0], lengths=[3]
    )
    assert not stage.keep(view)
    view.prompt_key = "gsm8k-7"
    assert stage.keep(view)
    assert stage.metrics() == {"kept": 1.0, "filtered": 1.0}


def test_recipe_naming_it_validates(installed: None) -> None:
    recipe = validate_recipe(recipe_data({"pattern": "^scratch-"}))
    config = validate_options("data", NAME, recipe.policy[0].data[0].options, "policy.0.data.0.options")
    assert config is not None and config.pattern == "^scratch-"  # type: ignore[attr-defined]
    validate_plugins(recipe)
    with pytest.raises(RecipeError, match="pattern"):
        validate_plugins(validate_recipe(recipe_data({"pattern": "("})))
    with pytest.raises(RecipeError, match="patern"):
        validate_plugins(validate_recipe(recipe_data({"patern": "x"})))

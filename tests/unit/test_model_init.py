"""Random-init model directories: offline loading, the tiny tokenizer, determinism, clear errors."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch

from astraflow.errors import AstraflowError
from astraflow.models.init import SPECIAL_TOKENS, WORDS, count_parameters, init_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("m") / "tiny", seed=0)


def test_directory_loads_offline_with_auto_classes(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in tiny.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tok) == len(SPECIAL_TOKENS) + len(WORDS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, len(tok))


def test_tokenizer_splits_words_and_digits_and_prepends_bos(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok.encode("copy 3 1 4 =")
    assert ids[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(ids[1:]) == ["copy", "3", "1", "4", "="]
    # Unspaced digits and symbols split the same way.
    assert tok.convert_ids_to_tokens(tok.encode("add 12+7=")[1:]) == ["add", "1", "2", "+", "7", "="]
    assert tok.decode(ids, skip_special_tokens=True) == "copy 3 1 4 ="
    assert tok.convert_ids_to_tokens(tok.encode("banana")[1:]) == ["<unk>"]


def test_same_seed_same_bytes_other_seed_differs(tiny: Path, tmp_path: Path) -> None:
    again = init_model("qwen3", "tiny", tmp_path / "again", seed=0)
    other = init_model("qwen3", "tiny", tmp_path / "other", seed=1)
    blob = (tiny / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == blob
    assert (other / "model.safetensors").read_bytes() != blob


def test_init_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    init_model("qwen3", "tiny", tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_errors_carry_hints(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(AstraflowError) as exc:
        init_model("llama9", "tiny", tmp_path / "a", seed=0)
    assert "qwen3" in exc.value.hint
    with pytest.raises(AstraflowError) as exc:
        init_model("qwen3", "huge", tmp_path / "b", seed=0)
    assert "tiny" in exc.value.hint
    with pytest.raises(AstraflowError) as exc:
        init_model("qwen3", "tiny", tiny, seed=0)
    assert "not empty" in str(exc.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert init_model("qwen3", "tiny", empty, seed=0) == empty


def test_preset_sizes_without_materialising() -> None:
    assert count_parameters("qwen3", "tiny") < 200_000
    assert 1_000_000 < count_parameters("qwen3", "small") < 10_000_000
    # Qwen3-0.6B's published size with tied embeddings.
    assert count_parameters("qwen3", "0.6b-shape") == 596_049_920
    # Qwen3-1.7B's and Qwen3-4B's sizes with tied embeddings (as counted on the GPU runs).
    assert count_parameters("qwen3", "1.7b-shape") == 1_720_574_976
    assert count_parameters("qwen3", "4b-shape") == 4_022_468_096
    # Qwen3-8B's published size (its output projection is not tied to the embedding).
    assert count_parameters("qwen3", "8b-shape") == 8_190_735_360

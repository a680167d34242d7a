"""`model init --tokenizer bpe`: a byte-level BPE trained on a local corpus, with a chat template."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch

from astraflow.errors import AstraflowError
from astraflow.models.bpe import build_bpe_tokenizer
from astraflow.models.init import init_model

torch.set_num_threads(1)

CORPUS = "\n".join(
    [
        "What is 12 plus 7? The answer is \\boxed{19}.",
        "Natalia sold clips to 48 of her friends in April, and half as many in May.",
        "def add(a, b):\n    return a + b",
    ]
    * 5
)


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bpe")
    (d / "corpus.txt").write_text(CORPUS)
    return init_model("qwen3", "tiny", d / "model", tokenizer="bpe", corpus=d / "corpus.txt", vocab_size=320)


def test_any_text_round_trips_without_unknown_tokens(bpe_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_model)
    # Words, scripts and symbols the corpus never had: byte-level BPE still encodes them exactly.
    text = "Zebras über 9041 café ∑ 日本語 \\frac{1}{2}\ttabs"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    # Digits are single tokens: "9041" is four of them.
    assert len(tok.encode("9041", add_special_tokens=False)) == 4


def test_merges_are_learned_from_the_corpus(bpe_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_model)
    assert len(tok) == 320
    # A frequent corpus word takes fewer tokens than its bytes; a random string does not shrink.
    assert len(tok.encode(" answer", add_special_tokens=False)) < len(" answer")
    assert len(tok.encode("qzxj", add_special_tokens=False)) == 4


def test_chat_template_ends_turns_with_eos_and_model_matches_vocab(bpe_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_model)
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<bos><|im_start|>user\nWhat is 2+2?<eos>\n<|im_start|>assistant\n4<eos>\n"
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(bpe_model)
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id


def test_same_corpus_gives_the_same_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text(CORPUS)
    a = build_bpe_tokenizer(tmp_path / "c.txt", 300)
    b = build_bpe_tokenizer(tmp_path / "c.txt", 300)
    assert a.get_vocab() == b.get_vocab()


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AstraflowError, match="not found"):
        build_bpe_tokenizer(tmp_path / "missing.txt", 1000)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(AstraflowError, match="empty"):
        build_bpe_tokenizer(tmp_path / "empty.txt", 1000)
    (tmp_path / "c.txt").write_text(CORPUS)
    with pytest.raises(AstraflowError, match="below"):
        build_bpe_tokenizer(tmp_path / "c.txt", 100)
    with pytest.raises(AstraflowError, match="needs a corpus"):
        init_model("qwen3", "tiny", tmp_path / "m", tokenizer="bpe")
    with pytest.raises(AstraflowError, match="unknown tokenizer"):
        init_model("qwen3", "tiny", tmp_path / "m2", tokenizer="sentencepiece")

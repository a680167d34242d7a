"""A byte-level BPE tokenizer trained locally on a corpus file, with a chat template.

Byte-level: every string encodes (no <unk>), and decode(encode(text)) == text. Digits are split one
per token so numbers mean the same in every context, which math tasks need. Special tokens keep the
ids the model config expects (pad 0, bos 1, eos 2) and add <|im_start|> for chat turns; a chat turn
ends with <eos>, so an engine that stops at eos stops at the end of the assistant's turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

BPE_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<|im_start|>")
"""Special tokens, in id order: pad = 0, bos = 1, eos = 2 (also ends a chat turn), turn start = 3."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools (call as "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>):\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] if message['content'] else '' }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '<tool_call>{"name": {{ fn.name | tojson }}, "arguments": '
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}</tool_call>"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML-like: one `<|im_start|>role\\ncontent<eos>\\n` block per message (tool results: role `tool`).
With `tools`, a system block first lists them as JSON and names the tool-call format, Hermes style:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format the OpenAI-compatible endpoint
parses; an assistant message's `tool_calls` render in that format after its content."""

MIN_VOCAB = 256 + len(BPE_SPECIAL_TOKENS)
"""The byte alphabet plus the special tokens: the smallest vocabulary that covers every string."""


def build_bpe_tokenizer(corpus: Path, vocab_size: int) -> Any:
    """Train a byte-level BPE of `vocab_size` tokens on the text file `corpus`; a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = Path(corpus)
    if not corpus.is_file():
        raise AstraflowError(f"corpus file {corpus} not found", hint="pass --corpus a UTF-8 text file")
    if vocab_size < MIN_VOCAB:
        raise AstraflowError(
            f"vocab size {vocab_size} is below {MIN_VOCAB}",
            hint=f"the 256 bytes and {len(BPE_SPECIAL_TOKENS)} special tokens need at least {MIN_VOCAB}",
        )
    try:
        lines = [ln for ln in corpus.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except UnicodeDecodeError as e:
        raise AstraflowError(f"corpus {corpus} is not UTF-8 text: {e}") from e
    if not lines:
        raise AstraflowError(f"corpus {corpus} is empty", hint="give it the kind of text the task uses")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
    )

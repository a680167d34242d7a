"""Transcript: one policy's side of a multi-turn episode, built turn by turn into one Sequence.

Policy turns are appended exactly as the engine produced them (token ids, behaviour logprobs, versions;
loss mask 1). Everything else (the prompt, tool results, the environment's replies, a chat template's
turn markers) is appended masked (loss mask 0, logprob 0.0, version -1). The policy's tokens are never
re-tokenized, so what the trainer scores is what the engine sampled.

Two modes. Chat (`chat=True`): messages go through the tokenizer's chat template; each new message's
tokens are the template's rendering of the conversation so far minus what is already in the
transcript, so the template must render a conversation as a prefix of its extension (ChatML-style
templates do; one that rewrites earlier turns is reported as an error: use raw mode). Raw
(`chat=False`): text or ids are appended as given.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from astraflow.engines.base import Completion
from astraflow.protocol.messages import SamplingParams, Sequence

SAMPLING_OVERRIDES: frozenset[str] = frozenset(
    {"max_new_tokens", "temperature", "top_p", "top_k", "stop_ids", "seed"}
)
"""Keys a workflow may pass to PolicyClient.generate to change the recipe's sampling for one call
(the controller accepts changed temperature / top_p / top_k only inside policy.sampling.overrides)."""


class TranscriptError(ValueError):
    """A transcript was used in a way that cannot give a correct Sequence."""


class TranscriptFull(TranscriptError):
    """The transcript reached max_tokens: no room for another policy turn."""


@dataclass(frozen=True)
class PolicyTurn:
    """One policy turn as generated."""

    start: int
    """Index of its first token in the transcript."""
    length: int
    """Tokens generated (stop token included)."""
    truncated: bool
    """The engine stopped at max_new_tokens, not at a stop token."""
    text: str
    """Decoded text of the turn without its stop token."""


def check_overrides(overrides: dict[str, Any]) -> None:
    """Reject sampling override keys the engine would not apply."""
    unknown = set(overrides) - SAMPLING_OVERRIDES
    if unknown:
        raise TranscriptError(
            f"unknown sampling override(s) {sorted(unknown)}; allowed: {sorted(SAMPLING_OVERRIDES)}"
        )


class Transcript:
    """Builds one policy's interleaved conversation and its masks; `sequence(reward)` ends it."""

    def __init__(self, client: Any, *, chat: bool = True, max_tokens: int | None = None) -> None:
        """`client`: the role's PolicyClient; `max_tokens`: context budget of the whole transcript."""
        self.client = client
        self.tokenizer = client.tokenizer
        self.chat = chat
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[PolicyTurn] = []
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        """Tool schemas the chat template renders (its `tools=`); set before the first message."""
        self._text = ""
        self._sampling: SamplingParams | None = None
        """The settings of the first policy turn, as its engine reported them; later turns must match."""
        self._header_open = False
        self._forced: list[int] = []
        """Forced tokens of the open assistant turn (force()), masked, decoded with the turn's text."""
        if chat and not getattr(self.tokenizer, "chat_template", None):
            raise TranscriptError("the tokenizer has no chat template; use Transcript(chat=False)")

    # ----- masked (non-policy) content -----------------------------------------------------------

    def add_ids(self, ids: list[int]) -> None:
        """Append tokens the policy did not generate (masked)."""
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_text(self, text: str, *, special_tokens: bool = False) -> None:
        """Raw mode: append `text` tokenized as is (masked); special_tokens adds e.g. <bos> in front."""
        if self.chat:
            raise TranscriptError("add_text is for raw transcripts; use add_message in chat mode")
        self.add_ids(list(self.tokenizer.encode(text, add_special_tokens=special_tokens)))

    def add_message(self, role: str, content: str) -> None:
        """Chat mode: append a message (system, user, tool, ...) rendered by the chat template (masked)."""
        self.add_messages([{"role": role, "content": content}])

    def add_messages(self, messages: list[dict[str, Any]]) -> None:
        """Chat mode: append messages (any keys the template reads, e.g. tool_calls, tool_call_id),
        rendered together (masked): templates that group consecutive tool results need all of them."""
        if not self.chat:
            raise TranscriptError("add_message is for chat transcripts; use add_text in raw mode")
        if self._header_open:
            raise TranscriptError("a message after prompt_ids() and before the policy's turn")
        self.messages += [dict(m) for m in messages]
        self._extend_to(self._render(add_generation_prompt=False))

    def _extend_to(self, rendered: str) -> None:
        if not rendered.startswith(self._text):
            raise TranscriptError(
                "the chat template does not render the conversation as a prefix of its extension "
                "(it rewrites earlier turns); build this transcript with chat=False"
            )
        delta = rendered[len(self._text) :]
        self.add_ids(list(self.tokenizer.encode(delta, add_special_tokens=False)))
        self._text = rendered

    def start_conversation(self, messages: list[dict[str, Any]]) -> None:
        """Chat mode, empty transcript: render a whole conversation at once (masked) and open the
        assistant turn; any template works here, even one that rewrites earlier turns."""
        if not self.chat or self.tokens or self.messages:
            raise TranscriptError("start_conversation needs an empty chat transcript")
        self.messages = [dict(m) for m in messages]
        text = self._render(add_generation_prompt=True)
        self.add_ids(list(self.tokenizer.encode(text, add_special_tokens=False)))
        self._text = text
        self._header_open = True

    def fork(self) -> Transcript:
        """An independent copy sharing the client (to branch a conversation, e.g. n samples)."""
        other = copy.copy(self)
        other.tokens, other.loss_mask = list(self.tokens), list(self.loss_mask)
        other.logprobs, other.versions = list(self.logprobs), list(self.versions)
        other.turns, other.messages = list(self.turns), [dict(m) for m in self.messages]
        other._forced = list(self._forced)
        return other

    def prompt_ids(self) -> list[int]:
        """The tokens to generate the next policy turn from (chat: after the assistant's turn header)."""
        if self.chat and not self._header_open:
            self._extend_to(self._render(add_generation_prompt=True))
            self._header_open = True
        return list(self.tokens)

    def _render(self, add_generation_prompt: bool) -> str:
        kw: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        text = self.tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
        )
        return str(text)

    # ----- policy turns --------------------------------------------------------------------------

    def room(self) -> int | None:
        """Tokens left under max_tokens (None: no budget)."""
        return None if self.max_tokens is None else self.max_tokens - len(self.tokens)

    async def generate(self, **overrides: Any) -> PolicyTurn:
        """Sample the policy's next turn from the whole transcript and append it (trainable)."""
        check_overrides(overrides)
        prompt = self.prompt_ids()
        room = self.room()
        if room is not None:
            if room <= 0:
                raise TranscriptFull(f"transcript is at max_tokens={self.max_tokens}")
            default = getattr(getattr(self.client, "sampling", None), "max_new_tokens", room)
            overrides["max_new_tokens"] = min(int(overrides.get("max_new_tokens", default)), room)
        completion = (await self.client.generate(prompt, n=1, **overrides))[0]
        return self.add_completion(completion, **overrides)

    def force(self, ids: list[int]) -> None:
        """Chat mode, after prompt_ids(): tokens the next policy turn is forced to start with (e.g. a
        tool-call opening); masked, and part of that assistant message's text."""
        if not self.chat or not self._header_open:
            raise TranscriptError("force() comes after prompt_ids() and before the policy's turn")
        self.add_ids(list(ids))
        self._forced += [int(t) for t in ids]

    def add_completion(self, completion: Completion, **overrides: Any) -> PolicyTurn:
        """Append a completion the policy generated for this transcript (`overrides`: those of its call;
        only stop_ids is read, to cut the turn's text). Its sampling settings are the completion's own."""
        check_overrides(overrides)
        self.check_sampling(completion.sampling)
        ids = [int(t) for t in completion.token_ids]
        if len(completion.logprobs) != len(ids) or len(completion.versions) != len(ids):
            raise TranscriptError("completion token_ids, logprobs and versions differ in length")
        start = len(self.tokens)
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in completion.logprobs]
        self.versions += [int(v) for v in completion.versions]
        stops = set(overrides.get("stop_ids", getattr(self.client, "stop_ids", None) or []))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            stops.add(int(eos))
        body = ids[:-1] if ids and ids[-1] in stops else ids
        text = str(self.tokenizer.decode(body, skip_special_tokens=True))
        turn = PolicyTurn(start, len(ids), completion.finish_reason == "length", text)
        self.turns.append(turn)
        if self.chat:
            if not self._header_open:
                raise TranscriptError(
                    "in chat mode, generate from prompt_ids() (it opens the assistant turn)"
                )
            self._header_open = False
            forced, self._forced = self._forced, []
            self.messages.append({"role": "assistant", "content": str(self.tokenizer.decode(forced + body))})
            self._text += str(self.tokenizer.decode(forced + ids))
        return turn

    def accepts(self, sampling: SamplingParams) -> bool:
        """Whether a turn sampled with these settings may join this transcript."""
        return self._sampling is None or self._sampling == sampling

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Refuse a turn sampled with other settings than this transcript's earlier turns: one
        Sequence carries one SamplingParams, under which the trainer recomputes every turn."""
        if not isinstance(sampling, SamplingParams):
            raise TranscriptError(f"a completion must carry its engine's SamplingParams, not {sampling!r}")
        if self._sampling is None:
            self._sampling = sampling
        elif sampling != self._sampling:
            raise TranscriptError(
                f"policy turns of one transcript sampled with different settings ({self._sampling} then "
                f"{sampling}); a Sequence has one SamplingParams: keep temperature, top_p and top_k "
                "equal across its turns"
            )

    def _asked(self) -> SamplingParams:
        """What the client's generate would ask for: the claim of a sequence with no sampled token."""
        asked = getattr(self.client, "sampling_params", None)
        return asked() if callable(asked) else SamplingParams()

    # ----- the result ----------------------------------------------------------------------------

    @property
    def truncated(self) -> bool:
        """Some policy turn hit max_new_tokens."""
        return any(t.truncated for t in self.turns)

    def sequence(self, reward: float) -> Sequence:
        """The finished Sequence, with its per-turn metadata and the sampling settings its engine
        reported (a transcript without a policy turn sampled nothing: the settings its client asks for)."""
        return Sequence(
            policy=self.client.policy,
            tokens=list(self.tokens),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            reward=float(reward),
            sampling=self._sampling or self._asked(),
            turns=[(t.start, t.length, t.truncated) for t in self.turns],
        )

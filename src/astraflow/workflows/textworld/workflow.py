"""The `textworld` workflow: multi-turn embodied text games. Each policy turn is one command; the game's
answer (and the commands it accepts now) comes back as the next user message; the reward is the
game's own: its score normalized by the max score (or 1 for a won game, `reward = "won"`).

Games: generated offline with TextWorld into `games_dir` (the controller generates the missing ones on
first start), any TextWorld story files already there, or ALFWorld's games from a local copy of its
data (`alfworld_dir`). See games.py. Each game runs in a game-engine process of its own
(worker.py), driven from the tool thread pool, never on the event loop: a game step past
`env_timeout_s` kills that process and ends the episode with reward 0; a crashed engine fails the
episode (its task is retried) and leaves the RaaS running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.errors import AstraflowError
from astraflow.protocol.messages import Scalar
from astraflow.workflows.base import Episode, PolicyClient, Workflow
from astraflow.workflows.common.tools import Tools
from astraflow.workflows.textworld.games import alfworld_rows, game_rows, make_games, safe_command
from astraflow.workflows.textworld.worker import GameWorker, GameWorkers
from astraflow.workflows.transcript import Transcript, TranscriptFull

SYSTEM = (
    "You are playing a text adventure game. Reach the goal the game describes. "
    "Each turn, answer with exactly one command, such as one of the commands listed."
)


ENGINE_START_S = 120.0
"""How long a new game-engine process may take to import TextWorld."""


class TextWorldConfig(BaseModel):
    """Options of the textworld workflow (recipe: workflow.options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    games_dir: str = ""
    """Folder of TextWorld games (.z8 / .ulx with their .json); generated games are written here."""
    generate: int = Field(0, ge=0)
    """Games to generate into games_dir with TextWorld (seeded by run.seed); existing ones are reused."""
    world_size: int = Field(3, ge=1)
    """Generated games: rooms."""
    nb_objects: int = Field(4, ge=0)
    """Generated games: objects."""
    quest_length: int = Field(2, ge=1)
    """Generated games: commands of the shortest winning walkthrough."""
    alfworld_dir: str = ""
    """ALFWorld instead: a local json_2.1.1/<split> folder (game.tw-pddl + traj_data.json per trial)."""
    max_turns: int = Field(10, ge=1)
    """Commands per episode."""
    max_tokens: int = Field(4096, ge=16)
    """Context budget of the whole conversation."""
    show_commands: bool = True
    """List the admissible commands in every observation."""
    reward: Literal["score", "won"] = "score"
    """score: the game's final score / its max score; won: 1 for a won game, else 0."""
    env_timeout_s: float = Field(20.0, gt=0)
    """A game start or step taking longer ends the episode (reward 0)."""


def command_of(text: str) -> str:
    """The command in a policy turn: its first non-empty line, without quotes or a prompt mark."""
    for line in text.splitlines():
        line = line.strip().strip("`'\"").lstrip(">").strip()
        if line:
            return line.rstrip(".")
    return ""


class TextWorldWorkflow(Workflow):
    """Text games played turn by turn; one role, "actor"."""

    Config = TextWorldConfig
    roles = ("actor",)

    def __init__(self, config: TextWorldConfig | None = None) -> None:
        super().__init__(config if config is not None else TextWorldConfig())
        self.config: TextWorldConfig
        self._tools: Tools | None = None
        self.workers = GameWorkers()

    def dataset(self, seed: int, size: int = 0) -> Iterator[dict[str, Any]]:
        """One row per game: ALFWorld's, or games_dir's (generating the missing ones first)."""
        cfg = self.config
        if cfg.alfworld_dir:
            rows = alfworld_rows(Path(cfg.alfworld_dir))
        elif cfg.games_dir:
            if cfg.generate:
                make_games(
                    Path(cfg.games_dir),
                    cfg.generate,
                    seed,
                    world_size=cfg.world_size,
                    nb_objects=cfg.nb_objects,
                    quest_length=cfg.quest_length,
                )
            rows = game_rows(Path(cfg.games_dir))
        else:
            raise AstraflowError("the textworld workflow needs games", hint="set games_dir or alfworld_dir")
        if not rows:
            raise AstraflowError(
                f"no games in {cfg.games_dir}", hint="set workflow.options.generate to make some"
            )
        yield from rows[:size] if size else rows

    def tools(self) -> Tools:
        """The thread pool that drives the game-engine processes."""
        if self._tools is None:
            self._tools = Tools(timeout_s=self.config.env_timeout_s)
        return self._tools

    def close(self) -> None:
        """Stop the idle game-engine processes and the thread pool."""
        self.workers.close()
        self.tools().close()

    def _observation(self, text: str, state: dict[str, Any]) -> str:
        if self.config.show_commands and state["admissible"]:
            return f"{text}\nCommands: {', '.join(state['admissible'])}"
        return text

    async def run_episode(self, sample: dict[str, Any], policies: dict[str, PolicyClient]) -> Episode:
        """Play the game until it is won or lost, or the turns or context run out."""
        cfg = self.config
        tools = self.tools()
        # on the event loop's thread, which lives as long as the RaaS: the engine's parent-death
        # signal follows the thread that started it (spawning is quick; the TextWorld import is not)
        worker: GameWorker = self.workers.acquire()
        healthy = False
        valid = turns = 0
        timed_out = False
        state: dict[str, Any] = {"admissible": [], "done": False, "won": False, "score": 0.0}
        tr = Transcript(policies["actor"], chat=True, max_tokens=cfg.max_tokens)
        try:
            if not worker.ready:  # a fresh process imports TextWorld first: seconds on a busy machine
                await tools.run(
                    worker.call, {"op": "hello"}, timeout_s=max(cfg.env_timeout_s, ENGINE_START_S)
                )
                worker.ready = True
            await tools.run(worker.call, {"op": "start", "path": str(sample["game"])})
            state = await tools.run(worker.call, {"op": "reset"})
            tr.add_message("system", SYSTEM)
            tr.add_message("user", self._observation(state["text"], state))
            for _ in range(cfg.max_turns):
                try:
                    turn = await tr.generate()
                except TranscriptFull:
                    break
                turns += 1
                command = safe_command(command_of(turn.text))
                valid += command in state["admissible"]
                state = await tools.run(worker.call, {"op": "step", "command": command})
                if state["done"]:
                    break
                tr.add_message("user", self._observation(state["text"], state))
            await tools.run(worker.call, {"op": "close"})
            healthy = True
        except TimeoutError:
            timed_out = True  # a hung engine: its process is killed below, the thread it held ends then
        finally:
            # a worker that hung, crashed or saw an error mid-game is not reused
            await asyncio.to_thread(self.workers.release, worker, healthy)
        won = bool(state["won"]) and not timed_out
        score = float(state["score"])
        if timed_out:
            reward = 0.0
        elif cfg.reward == "won":
            reward = float(won)
        else:
            reward = score
        info: dict[str, Scalar] = {
            "won": float(won),
            "score": score,
            "turns": float(turns),
            "valid_commands": valid / turns if turns else 0.0,
            "env_timeout": float(timed_out),
        }
        return Episode(sequences=[tr.sequence(reward)], info=info)

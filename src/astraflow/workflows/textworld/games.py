"""Text games for the `textworld` workflow: generated offline with TextWorld, or ALFWorld's games read
from a local copy of its data; and a thin wrapper that plays one game (inside a game-engine process:
worker.py).

TextWorld (`pip install 'astraflow[textworld]'`) generates a game with its own generator and compiles it
with the Inform 7 compiler it ships (no network): a `.z8` story file plus its `.json` game description,
played through jericho. ALFWorld games are `game.tw-pddl` files (PDDL domain, problem and text grammar)
that TextWorld plays with its PDDL backend, which needs `fast-downward-textworld` (pip; built from
source, so not part of the extras). ALFWorld's data is not downloaded by astraflow: point `alfworld_dir`
at the `json_2.1.1/<split>` folder of a local copy.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

GAME_SUFFIXES = (".z8", ".ulx", ".tw-pddl")
"""Story files the workflow plays."""

_LOAD_LOCK = threading.Lock()
"""TextWorld parses a game's logic with one shared (tatsu) parser that breaks when two threads load at
once (IndexError inside tatsu), so loading and resetting games is serialized; steps run concurrently."""


def _textworld() -> Any:
    try:
        import textworld
    except ImportError as e:
        raise AstraflowError(
            "the textworld workflow needs TextWorld", hint="pip install 'astraflow[textworld]'"
        ) from e
    return textworld


def make_games(
    out_dir: Path, count: int, seed: int, *, world_size: int = 3, nb_objects: int = 4, quest_length: int = 2
) -> list[Path]:
    """Generate `count` TextWorld games into out_dir (kept: existing games of the same name are reused);
    the same seed gives the same games."""
    textworld = _textworld()
    from textworld.generator import compile_game, make_game

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = out_dir / f"tw-s{seed}-r{world_size}-o{nb_objects}-q{quest_length}-{i}.z8"
        if not (path.is_file() and path.with_suffix(".json").is_file()):
            options = textworld.GameOptions()
            options.seeds = seed * 100_003 + i
            options.nb_rooms = world_size
            options.nb_objects = nb_objects
            options.chaining.min_length = quest_length
            options.chaining.max_length = quest_length
            options.chaining.max_depth = quest_length
            options.path = str(path)
            options.file_ext = ".z8"
            options.force_recompile = True
            compile_game(make_game(options), options)
        paths.append(path)
    return paths


def game_rows(games_dir: Path) -> list[dict[str, Any]]:
    """One task row per TextWorld story file in games_dir (sorted by name)."""
    games_dir = Path(games_dir)
    if not games_dir.is_dir():
        raise AstraflowError(f"games directory not found: {games_dir}")
    files = sorted(p for p in games_dir.iterdir() if p.suffix in (".z8", ".ulx"))
    return [{"id": p.stem, "game": str(p.resolve()), "source": "textworld"} for p in files]


def _alfworld_goal(traj: dict[str, Any]) -> str:
    anns = traj.get("turk_annotations", {}).get("anns", [])
    return str(anns[0].get("task_desc", "")) if anns else ""


def alfworld_rows(data_dir: Path) -> list[dict[str, Any]]:
    """One task row per solvable ALFWorld game under data_dir (a `json_2.1.1/<split>` folder: each trial
    folder holds `game.tw-pddl` and `traj_data.json`)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise AstraflowError(
            f"ALFWorld data folder not found: {data_dir}",
            hint="point alfworld_dir at json_2.1.1/<split> of a local ALFWorld data copy",
        )
    rows = []
    for game in sorted(data_dir.rglob("game.tw-pddl")):
        try:
            data = json.loads(game.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise AstraflowError(f"{game}: not an ALFWorld game file ({e})") from e
        if not isinstance(data, dict) or "pddl_problem" not in data:
            raise AstraflowError(f"{game}: not an ALFWorld game file (no pddl_problem)")
        if data.get("solvable") is False:
            continue  # ALFWorld's own loader skips these too
        traj_path = game.parent / "traj_data.json"
        traj = json.loads(traj_path.read_text(encoding="utf-8")) if traj_path.is_file() else {}
        rows.append(
            {
                "id": str(game.parent.relative_to(data_dir)),
                "game": str(game.resolve()),
                "source": "alfworld",
                "task_type": str(traj.get("task_type", "")),
                "goal": _alfworld_goal(traj),
            }
        )
    if not rows:
        raise AstraflowError(f"no solvable game.tw-pddl under {data_dir}")
    return rows


_STATUS = re.compile(r"^-= .* =-\d+/\d+$")
"""The status line (room, score/moves) jericho appends to every answer."""


def clean(text: str) -> str:
    """An observation without TextWorld's ASCII-art banner lines, prompt marks and blank lines."""
    lines = [x.strip() for x in text.replace("\r", "").split("\n")]
    keep = [x for x in lines if x and "$$" not in x and not set(x) <= set("_|\\/ >")]
    keep = [x for x in keep if not _STATUS.match(x) and not x.startswith("Would you like to RESTART")]
    return "\n".join(x.lstrip("> ").strip() for x in keep if x.lstrip("> ").strip())


_UNSAFE = re.compile(r"[^a-z0-9 ,.'-]+")
MAX_COMMAND_CHARS = 80
"""Longer commands are cut (the Z-machine's input line is short)."""


def safe_command(command: str) -> str:
    """A command the interpreter can take: lower-case letters, digits, spaces and , . ' - only, at most
    MAX_COMMAND_CHARS. The Z-machine interpreter runs in this process and treats some input as its own
    meta-commands (a leading backslash) or breaks on control bytes (a NUL crashed it), so model text is
    never passed through raw; an empty result becomes "look"."""
    text = " ".join(_UNSAFE.sub(" ", command.lower()).split())[:MAX_COMMAND_CHARS].strip()
    return text or "look"


class GameSession:
    """One running game (synchronous: call it from a worker thread, never the event loop).

    Each game loads its own copy of the interpreter library (jericho does so), so games in different
    threads do not share state."""

    def __init__(self, path: str, max_score_default: float = 1.0) -> None:
        """Start the game at `path` (a TextWorld story file or an ALFWorld game.tw-pddl)."""
        textworld = _textworld()
        if not Path(path).is_file():
            raise AstraflowError(
                f"game file not found: {path}", hint="games must exist on every RaaS machine"
            )
        infos = textworld.EnvInfos(
            admissible_commands=True,
            objective=True,
            description=True,
            max_score=True,
            score=True,
            won=True,
            lost=True,
        )
        # jericho warns once per game that it cannot list valid actions of a TextWorld story file;
        # TextWorld lists them itself (admissible_commands), so the warning says nothing here
        warnings.filterwarnings("ignore", message="Unable to find valid actions")
        with _LOAD_LOCK:
            self.env = textworld.start(path, request_infos=infos)
        self.max_score_default = max_score_default
        self.state: Any = None

    def reset(self) -> str:
        """Start the game; the first observation (goal and first room)."""
        with _LOAD_LOCK:
            self.state = self.env.reset()
        return clean(str(self.state.feedback or ""))

    def step(self, command: str) -> str:
        """Play one command (made safe first: see `safe_command`); the game's answer."""
        self.state, _, _ = self.env.step(safe_command(command))
        return clean(str(self.state.feedback or ""))

    @property
    def admissible(self) -> list[str]:
        """Commands the game accepts now."""
        return list(self.state.admissible_commands or []) if self.state is not None else []

    @property
    def done(self) -> bool:
        """Won or lost."""
        return bool(self.state is not None and (self.state.won or self.state.lost))

    @property
    def won(self) -> bool:
        """The quest is complete."""
        return bool(self.state is not None and self.state.won)

    @property
    def score(self) -> float:
        """The game's score normalized by its max score (0..1)."""
        if self.state is None:
            return 0.0
        top = float(self.state.max_score or self.max_score_default)
        return max(0.0, float(self.state.score or 0)) / top if top > 0 else 0.0

    def close(self) -> None:
        """Stop the interpreter."""
        self.env.close()

"""Process supervision for `astraflow up`: start every role as a child `astraflow` process, watch
them, print progress, and tear everything down on exit, Ctrl-C or a child's failure.

Children run in their own session (so the terminal's Ctrl-C reaches only the launcher, which then
stops them in order) and ask the kernel to SIGTERM them if the launcher dies (no orphans).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from astraflow import log
from astraflow.metrics.role_stats import STATS_ENV

_log = log.get("launcher")
PR_SET_PDEATHSIG = 1
MAX_TRAINER_RESTARTS = 2


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def astraflow_cmd() -> list[str]:
    """How to start an `astraflow` child so that `ps` shows `astraflow <role> ...`."""
    script = Path(sys.executable).with_name("astraflow")
    if script.is_file():
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "astraflow"]


@dataclass
class Child:
    """One supervised child process."""

    name: str
    role: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for this child only (its GPUs, its stats file)."""
    log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts, watches and stops the children of one `up`."""

    def __init__(self, run_dir: Path, env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.children: list[Child] = []
        self.env = {**os.environ, **(env or {})}

    def start(self, name: str, role: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        """Start `astraflow ARGS` as a child whose output goes to logs/<name>.log (env: its own extra variables)."""
        child = Child(
            name=name,
            role=role,
            argv=astraflow_cmd() + args,
            log_path=self.run_dir / "logs" / f"{name}.log",
            env=env or {},
        )
        self._spawn(child)
        self.children.append(child)
        return child

    def start_command(self, name: str, role: str, argv: list[str], env: dict[str, str]) -> Child:
        """Start any command (a recipe's [[service]]) as a supervised child, output to logs/<name>.log."""
        child = Child(
            name=name, role=role, argv=argv, log_path=self.run_dir / "logs" / f"{name}.log", env=env
        )
        try:
            self._spawn(child)
        except OSError as exc:
            from astraflow.errors import AstraflowError

            if child.log_file is not None:
                child.log_file.close()
            raise AstraflowError(f"cannot start {name}: {exc}", hint="check its command") from None
        self.children.append(child)
        return child

    def _spawn(self, child: Child) -> None:
        child.log_file = open(child.log_path, "ab")  # noqa: SIM115 - closed in stop_all
        child.proc = subprocess.Popen(
            child.argv,
            stdout=child.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**self.env, **child.env},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        _log.debug("started %s pid %d: %s", child.name, child.proc.pid, " ".join(child.argv))

    def restart(self, child: Child) -> None:
        """Start a dead child again with the same command line (a service's leftover processes, which
        may still hold its port, are killed first)."""
        child.restarts += 1
        if child.role == "service" and child.proc is not None:
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)  # its own session: the group id is its pid
            except (ProcessLookupError, PermissionError):
                pass
        if child.log_file is not None:
            child.log_file.close()
        self._spawn(child)

    def exited(self) -> list[tuple[Child, int]]:
        """Children that have exited since they were started, with their return codes."""
        out = []
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                out.append((c, c.proc.returncode))
        return out

    def stop_all(self, grace_s: float = 10.0, drain_s: float = 0.0) -> None:
        """SIGTERM the RaaS workers first and give them drain_s to finish or return their leases while
        the controller still runs; then the trainers and the controller; SIGKILL stragglers."""
        workers = [c for c in self.children if c.role == "raas" and c.running and c.proc is not None]
        for c in workers:
            assert c.proc is not None
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + drain_s + 2.0
        for c in workers:
            assert c.proc is not None
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # killed below with the others if it does not stop within grace_s
        order = {"raas": 0, "trainer": 1, "controller": 2, "service": 3}
        for c in sorted(self.children, key=lambda c: order.get(c.role, 0)):
            if c.running and c.proc is not None:
                _signal(c, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _log.warning("%s did not stop within %.0fs; killing it", c.name, grace_s)
                _signal(c, signal.SIGKILL)
                c.proc.wait()
        for c in self.children:
            if c.log_file is not None:
                c.log_file.close()
                c.log_file = None


def _signal(child: Child, sig: int) -> None:
    """Signal a role, or the whole process group of a service (a command may start children of its own)."""
    assert child.proc is not None
    if child.role == "service":
        try:
            os.killpg(child.proc.pid, sig)  # its own session: the group id is its pid
        except ProcessLookupError:
            pass
    else:
        child.proc.send_signal(sig)


def worker_gpus(gpus: str, index: int, workers: int) -> str:
    """The GPUs of local RaaS worker `index`: with several workers and several GPUs listed, one GPU
    each in turn (worker i gets the (i mod n)-th); otherwise every listed GPU."""
    listed = [g for g in gpus.split(",") if g]
    if workers > 1 and len(listed) > 1:
        return listed[index % len(listed)]
    return gpus


def gpu_env(gpus: str) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a child when the recipe names its GPUs; nothing otherwise."""
    return {"CUDA_VISIBLE_DEVICES": gpus} if gpus else {}


def tail_log(path: Path, lines: int = 15) -> str:
    """The last lines of a child's log, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class MetricsTail:
    """Follows metrics.jsonl and yields new records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        """New complete records since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        out = []
        for line in complete:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out


def progress_line(rec: dict[str, Any], steps: int | dict[str, int]) -> str:
    """One human-readable progress line per trainer step."""

    def f(key: str, fmt: str = ".3f") -> str:
        v = rec.get(key)
        return "-" if v is None else format(v, fmt)

    if rec.get("kind") == "eval":
        scores = "  ".join(f"{k[5:]} {v:.3f}" for k, v in sorted(rec.items()) if k.startswith("eval/"))
        return f"[{rec.get('policy', '?')}] eval of version {rec.get('version', '?')}  {scores}"
    if isinstance(steps, dict):
        steps = steps.get(str(rec.get("policy")), 0)
    return (
        f"[{rec.get('policy', '?')}] step {rec.get('step', '?')}/{steps}  version {rec.get('version', '?')}  "
        f"reward {f('reward_mean')}  samples/s {f('samples_per_s', '.1f')}  "
        f"staleness {f('staleness_mean', '.2f')}/{f('staleness_max', '.0f')}"
        + ("  SKIPPED: non-finite loss or gradient norm" if rec.get("trainer_skipped_step") else "")
    )


def print_progress(metrics: MetricsTail, budgets: dict[str, int], show: bool) -> None:
    """Print a progress line for each new metrics row (consumed either way)."""
    for rec in metrics.read():
        if show and "step" in rec and "policy" in rec:
            sys.stdout.write(progress_line(rec, budgets) + "\n")


def check_models(recipe: Any, source: Path | None = None) -> None:
    """Every policy's model directory must exist before any process starts: a missing one the recipe
    says how to make (policy.model_init) is built here; one without config.json is refused. A missing
    one the recipe file (`source`) makes by commands in its comments is refused naming those."""
    from astraflow.errors import RecipeError

    for pol in recipe.policy:
        path = Path(pol.model)
        if not path.exists() and pol.model_init is not None:
            build_model(pol.model_init, path)
        if not path.is_dir():
            made = pol.model_init.command(pol.model) if pol.model_init is not None else None
            own = recipe_commands(source, pol.model) if source is not None and made is None else []
            raise RecipeError(
                f"policy {pol.name!r}: model directory {pol.model!r} does not exist",
                hint=f"create it: {made}"
                if made
                else f"create it as the recipe's comments say: {'; '.join(own)}"
                if own
                else "add policy.model_init to the recipe (docs/recipes.md) or create one offline: "
                f"astraflow model init --arch qwen3 --preset tiny --out {pol.model}",
            )
        if not (path / "config.json").is_file():
            raise RecipeError(
                f"policy {pol.name!r}: {pol.model!r} is not a model directory (no config.json)",
                hint="point policy.model at a transformers model directory (astraflow model init makes one)",
            )


def recipe_commands(source: Path, model: str) -> list[str]:
    """The `astraflow` commands a recipe file's comments give for making `model`: every one before (and
    with) the first that writes `--out MODEL` (a model init, then an sft of it); [] when none does."""
    try:
        lines = source.read_text(errors="replace").splitlines()
    except OSError:
        return []
    cmds = [ln.lstrip("#").strip() for ln in lines if ln.lstrip("#").strip().startswith("astraflow ")]
    cmds = [c for c in cmds if not c.startswith(("astraflow up ", "astraflow launch "))]
    for i, cmd in enumerate(cmds):
        if cmd.split("--out ", 1)[-1].split(" ", 1)[0].rstrip("/") == model.rstrip("/") and "--out " in cmd:
            return cmds[: i + 1]
    return []


def build_model(init: Any, out: Path) -> None:
    """Build a policy's random-init model as its recipe's model_init says (`astraflow model init`)."""
    from astraflow.errors import RecipeError
    from astraflow.models.init import init_model

    if init.tokenizer == "bpe" and (init.corpus is None or not Path(init.corpus).is_file()):
        raise RecipeError(
            f"model_init for {out}: corpus {init.corpus!r} is not a file",
            hint="policy.model_init.corpus names the text the bpe tokenizer is trained on",
        )
    _log.info("building %s: %s", out, init.command(str(out)))
    init_model(
        init.arch,
        init.preset,
        out,
        init.seed,
        tokenizer=init.tokenizer,
        corpus=Path(init.corpus) if init.corpus else None,
        vocab_size=init.vocab_size,
    )


def wait_for_address(path: Path, controller: Child, timeout_s: float = 60.0) -> str:
    """Wait until the controller has written its bound endpoint."""
    from astraflow.errors import AstraflowError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            addr = path.read_text().strip()
            if addr:
                return addr
        if not controller.running:
            raise AstraflowError(
                "the controller exited during start-up:\n" + tail_log(controller.log_path),
                hint=f"full log: {controller.log_path}",
            )
        time.sleep(0.05)
    raise AstraflowError(
        f"the controller did not report its address within {timeout_s:.0f}s",
        hint=f"see {controller.log_path}",
    )


def throwaway_keys(keys_dir: Path, members: list[tuple[str, str, str | None]]) -> dict[str, list[str]]:
    """Make (or reuse, on a resumed run) a key store and one key per child; returns each child's key flags.

    `up` always runs authenticated: these keys live only in the run directory and never leave it.
    """
    from astraflow.transport.keys import KeyStore, load_keypair, new_key_files

    store = KeyStore(keys_dir) if KeyStore.exists(keys_dir) else KeyStore.init(keys_dir)
    registered = store.members()
    flags: dict[str, list[str]] = {}
    for name, role, policy in members:
        secret = keys_dir / "members" / f"{name}.key_secret"
        if not secret.is_file():
            new_key_files(keys_dir / "members", name)
        public = load_keypair(secret).public
        row = registered.get(name)
        if row is None or row.get("revoked") or row["public_key"] != public.decode() or row["role"] != role:
            if row is not None and not row.get("revoked"):
                store.revoke(name)
            store.add(name, public, role, policy)
        flags[name] = ["--key", str(secret), "--controller-key", str(keys_dir / "controller.key")]
    return flags


def run_up(
    recipe: Any,
    run_dir: Path,
    *,
    offline: bool = False,
    max_raas_restarts: int = 3,
    viewer: list[str] | None = None,
) -> int:
    """Run a whole recipe on this machine; returns the exit code (0 when every policy reached its budget).
    The caller has checked the recipe's plugins (config.load.validate_plugins), as `astraflow up` does.

    viewer: `astraflow` arguments of a process that shows the run on this terminal instead of progress
    lines (the dashboard); closing it stops the run, and at the run's end `up` waits until it is closed."""
    from astraflow.errors import AstraflowError
    from astraflow.rundir import prepare
    from astraflow.services import start_services

    check_models(recipe)
    prepare(run_dir, recipe)
    resolved = str(run_dir / "recipe.resolved.json")
    addr_file = run_dir / "controller.addr"
    addr_file.unlink(missing_ok=True)
    env = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if offline:
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    sup = Supervisor(run_dir, env)
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    member_keys = throwaway_keys(
        run_dir / "keys",
        [(f"trainer-{p.name}", "trainer", p.name) for p in recipe.policy]
        + [(f"raas-{i}", "raas", None) for i in range(recipe.rollout.local_workers)]
        # for `astraflow status --controller ADDR --key RUN/keys/members/observer.key_secret ...`
        + [("observer", "observer", None)]
        # for `astraflow ctl ... --run-dir RUN` and the dashboard's control keys
        + [("operator", "operator", None)],
    )
    shown: subprocess.Popen[bytes] | None = None
    try:
        # environment servers and the like are up before any RaaS can ask them for an episode
        start_services(sup, recipe.service)
        # the controller authenticates with <run-dir>/keys, which it finds by itself; `astraflow up`
        # has checked the engine and trainer options, so the controller need not import torch
        ctl = sup.start(
            "controller",
            "controller",
            ["controller", resolved, "--run-dir", str(run_dir), "--plugins-checked"],
        )
        # the members start now too: they import torch and the model's code (most of their start-up)
        # while the controller opens the state and binds, then read its address from addr_file
        at_controller = ["--controller-file", str(addr_file)]
        for pol in recipe.trainable():  # a frozen policy has no trainer
            sup.start(
                f"trainer-{pol.name}",
                "trainer",
                [
                    "join",
                    "--role",
                    "trainer",
                    *at_controller,
                    "--policy",
                    pol.name,
                    "--member-id",
                    f"trainer-{pol.name}",
                    "--checkpoint-dir",
                    str(run_dir / "checkpoints" / pol.name),
                    *member_keys[f"trainer-{pol.name}"],
                    "--keys",
                    str(run_dir / "keys"),
                    *(["--nproc", str(pol.trainer_nproc)] if pol.trainer_nproc > 1 else []),
                ],
                env=gpu_env(pol.trainer_gpus),
            )
        for i in range(recipe.rollout.local_workers):
            sup.start(
                f"raas-{i}",
                "raas",
                [
                    "join",
                    "--role",
                    "raas",
                    *at_controller,
                    "--member-id",
                    f"raas-{i}",
                    "--slots",
                    str(recipe.rollout.slots),
                    *member_keys[f"raas-{i}"],
                ],
                # each worker appends its engines' busy time and weight loads here (docs/benchmarks.md)
                env={
                    **gpu_env(worker_gpus(recipe.rollout.gpus, i, recipe.rollout.local_workers)),
                    STATS_ENV: str(run_dir / "logs" / f"raas-{i}.stats.jsonl"),
                },
            )
        addr = wait_for_address(addr_file, ctl)
        _log.info("controller at %s; run directory %s", addr, run_dir)
        if viewer is not None:
            shown = subprocess.Popen(astraflow_cmd() + viewer, env=sup.env, preexec_fn=_die_with_parent)
        return _watch(sup, recipe, run_dir, stop, t0, max_raas_restarts, shown)
    except AstraflowError:
        raise
    finally:
        if shown is not None and shown.poll() is None:
            shown.terminate()  # gives the terminal back before any error is printed
            shown.wait()
        sup.stop_all(drain_s=recipe.rollout.drain_timeout_s)
        for s, h in old.items():
            signal.signal(s, h)


def _echo_failures(fails: Any, viewer: subprocess.Popen[bytes] | None) -> None:
    """Print the task failures recorded since the last read (one line per kind and second)."""
    for line in fails.read():
        if viewer is None:
            sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _watch(
    sup: Supervisor,
    recipe: Any,
    run_dir: Path,
    stop: dict[str, int],
    t0: float,
    max_restarts: int,
    viewer: subprocess.Popen[bytes] | None = None,
) -> int:
    """Supervise until the trainers finish, a fatal child fails, or a signal arrives. A dead RaaS is
    restarted up to max_restarts times, a dead trainer up to MAX_TRAINER_RESTARTS times, a dead service
    up to its own max_restarts; a controller failure, or a child past its restarts, ends the run."""
    from astraflow.state.failure_tail import FailureTail

    metrics = MetricsTail(run_dir / "metrics.jsonl")
    fails, next_fail_read = FailureTail(run_dir / "state.db"), 0.0
    trainers = [c for c in sup.children if c.role == "trainer"]
    budgets = {p.name: recipe.budget(p.name) for p in recipe.trainable()}
    service_restarts = {f"service-{s.name}": s.max_restarts for s in getattr(recipe, "service", [])}
    seen_dead: set[tuple[str, int]] = set()
    reached: dict[str, int] = {}
    while True:
        for rec in metrics.read():
            if "step" in rec and "policy" in rec:
                reached[rec["policy"]] = max(reached.get(rec["policy"], 0), int(rec["step"]))
                if viewer is None:
                    sys.stdout.write(progress_line(rec, budgets) + "\n")
                    sys.stdout.flush()
        if time.monotonic() >= next_fail_read:
            # failures reach the console as one line per kind and second (the full traceback is in the controller log)
            next_fail_read = time.monotonic() + 1.0
            _echo_failures(fails, viewer)
        if stop["signal"]:
            _log.warning("stopping on signal %d", stop["signal"])
            return 130
        if viewer is not None and viewer.poll() is not None:
            # 3: the dashboard stopped the run (cli/dash.py STOPPED_HERE): trainers checkpoint and exit 0
            if viewer.returncode == 3 or all(reached.get(p, 0) >= b for p, b in budgets.items()):
                viewer = None  # closed after the last step: let the roles finish on their own
            else:
                _log.warning("the dashboard was closed; stopping the run")
                return 130
        trainers_done = bool(trainers) and all(t.proc is not None and t.proc.poll() == 0 for t in trainers)
        for child, rc in sup.exited():
            if child.proc is None or (child.name, child.restarts) in seen_dead:
                continue
            seen_dead.add((child.name, child.restarts))
            if (rc == 0 and child.role != "service") or trainers_done:
                continue  # a graceful stop (the controller said so, or the run is over); a service must not stop
            if child.role == "trainer" and child.restarts < MAX_TRAINER_RESTARTS:
                # it resumes from its newest checkpoint and gets the recorded batches again
                _log.warning(
                    "%s exited with %s; restarting it from its checkpoint (%d/%d)",
                    child.name,
                    rc,
                    child.restarts + 1,
                    MAX_TRAINER_RESTARTS,
                )
                sup.restart(child)
                continue
            if child.role == "service":
                limit = service_restarts.get(child.name, 0)
                if child.restarts < limit:
                    _log.warning(
                        "%s exited with %s; restarting it (%d/%d)", child.name, rc, child.restarts + 1, limit
                    )
                    sup.restart(child)
                    continue
            if child.role == "raas":
                if child.restarts < max_restarts:
                    _log.warning(
                        "%s exited with %s; restarting it (%d/%d)",
                        child.name,
                        rc,
                        child.restarts + 1,
                        max_restarts,
                    )
                    sup.restart(child)
                    continue
                if any(c.running for c in sup.children if c.role == "raas"):
                    _log.warning("%s exited with %s and will not be restarted again", child.name, rc)
                    continue
            _echo_failures(fails, viewer)  # the failures that ended it, read before the run is left
            _log.error(
                "%s failed (exit %s); last lines of %s:\n%s",
                child.name,
                rc,
                child.log_path,
                tail_log(child.log_path),
            )
            return 1
        if trainers and all(t.proc is not None and t.proc.poll() == 0 for t in trainers):
            for rec in metrics.read():
                if viewer is None and "step" in rec and "policy" in rec:
                    sys.stdout.write(progress_line(rec, budgets) + "\n")
            _log.info(
                "%s (%s) in %.1fs; run directory %s",
                "every policy reached its step budget"
                if all(reached.get(p, 0) >= b for p, b in budgets.items())
                else "the run was stopped before its budget",
                ", ".join(f"{k} {v}" for k, v in budgets.items()),
                time.monotonic() - t0,
                run_dir,
            )
            deadline = time.monotonic() + 10.0
            # the roles exit by themselves now; services run until stop_all
            while time.monotonic() < deadline and any(c.running for c in sup.children if c.role != "service"):
                print_progress(metrics, budgets, viewer is None)
                time.sleep(0.1)
            print_progress(metrics, budgets, viewer is None)
            while viewer is not None and viewer.poll() is None and not stop["signal"]:
                time.sleep(0.1)  # the run is over; the dashboard stays until its user closes it
            return 0
        time.sleep(0.1)

"""Process supervision for `astraflow up`: start every role as a child `astraflow` process, watch
them, print progress, and tear everything down on exit, Ctrl-C or a child's failure.

The parts: launch/supervisor.py (the children), launch/restarts.py (what a death does),
launch/progress.py (the console), launch/pool.py (the RaaS workers, autoscaled), models/dirs.py (model directories), launch/services.py (a recipe's
[[service]] commands under launch/service_guard.py), launch/early_start.py (members that start before
the controller's address is known).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.launch.pool import LocalPool, check_bounds, pool_names
from astraflow.launch.progress import Progress
from astraflow.launch.restarts import MAX_RAAS_RESTARTS, RestartRule, restart_or_fail, restart_rules
from astraflow.launch.supervisor import Child, Supervisor, _die_with_parent, astraflow_cmd, tail_log
from astraflow.models.dirs import check_models

_log = log.get("launcher")


def gpu_env(gpus: str) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a child when the recipe names its GPUs; nothing otherwise."""
    return {"CUDA_VISIBLE_DEVICES": gpus} if gpus else {}


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
    max_raas_restarts: int = MAX_RAAS_RESTARTS,
    viewer: list[str] | None = None,
) -> int:
    """Run a whole recipe on this machine; returns the exit code (0 when every policy reached its budget).
    The caller has checked the recipe's plugins (config.load.validate_plugins), as `astraflow up` does.

    viewer: `astraflow` arguments of a process that shows the run on this terminal instead of progress
    lines (the dashboard); closing it stops the run, and at the run's end `up` waits until it is closed."""
    from astraflow.errors import AstraflowError
    from astraflow.launch.services import start_services
    from astraflow.rundir import prepare

    check_bounds(recipe.rollout)
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
        + [(name, "raas", None) for name in pool_names(recipe.rollout)]
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
        pool = LocalPool(sup, recipe.rollout, run_dir, member_keys, at_controller)
        for name in pool.names[: recipe.rollout.local_workers]:
            pool.start(name)
        addr = pool.address = wait_for_address(addr_file, ctl)
        _log.info("controller at %s; run directory %s", addr, run_dir)
        if viewer is not None:
            shown = subprocess.Popen(astraflow_cmd() + viewer, env=sup.env, preexec_fn=_die_with_parent)
        return _watch(sup, pool, recipe, run_dir, stop, t0, max_raas_restarts, shown)
    except AstraflowError:
        raise
    finally:
        if shown is not None and shown.poll() is None:
            shown.terminate()  # gives the terminal back before any error is printed
            shown.wait()
        sup.stop_all(drain_s=recipe.rollout.drain_timeout_s)
        for s, h in old.items():
            signal.signal(s, h)


def _watch(
    sup: Supervisor,
    pool: LocalPool,
    recipe: Any,
    run_dir: Path,
    stop: dict[str, int],
    t0: float,
    max_restarts: int,
    viewer: subprocess.Popen[bytes] | None = None,
) -> int:
    """Supervise until the trainers finish, a fatal child fails, or a signal arrives. A dead child is
    restarted as restart_rules says (unless the pool drained it); a controller failure, or a child past
    its restarts, ends the run. The pool is autoscaled meanwhile (launch/pool.py)."""
    budgets = {p.name: recipe.budget(p.name) for p in recipe.trainable()}
    progress = Progress(run_dir, budgets, show=viewer is None)
    rules = restart_rules(recipe, max_restarts)
    trainers = [c for c in sup.children if c.role == "trainer"]
    seen_dead: set[int] = set()  # process ids: a restarted or re-added child is a new process
    while True:
        progress.poll()
        if stop["signal"]:
            _log.warning("stopping on signal %d", stop["signal"])
            return 130
        if viewer is not None and viewer.poll() is not None:
            # 3: the dashboard stopped the run (cli/dash.py STOPPED_HERE): trainers checkpoint and exit 0
            if viewer.returncode != 3 and not progress.all_reached:
                _log.warning("the dashboard was closed; stopping the run")
                return 130
            viewer, progress.show = None, True  # closed after the last step: the roles finish on their own
        trainers_done = _all_exited_0(trainers)
        if _a_child_failed(sup, pool, rules, seen_dead, trainers_done, progress):
            return 1
        if _all_exited_0(trainers):
            _finish(sup, progress, run_dir, t0, stop, viewer)
            return 0
        if not trainers_done:
            pool.watch(pool.address)
        time.sleep(0.1)


def _a_child_failed(
    sup: Supervisor,
    pool: LocalPool,
    rules: dict[str, RestartRule],
    seen_dead: set[int],
    trainers_done: bool,
    progress: Progress,
) -> bool:
    """Look at the children that exited since the last look (`seen_dead`: their process ids): restart
    those restart_rules allows; True (logged) when one failed for good, which ends the run."""
    for child, rc in sup.exited():
        if child.proc is None or child.proc.pid in seen_dead:
            continue
        seen_dead.add(child.proc.pid)
        if (rc == 0 and child.role != "service") or trainers_done or pool.was_drained(child):
            continue  # a graceful stop (the controller said so, or the run is over); a service must not stop
        if restart_or_fail(sup, rules, child, rc):
            continue
        progress.failures()  # the failures that ended it, read before the run is left
        _log.error(
            "%s failed (exit %s); last lines of %s:\n%s",
            child.name,
            rc,
            child.log_path,
            tail_log(child.log_path),
        )
        return True
    return False


def _all_exited_0(trainers: list[Child]) -> bool:
    """There are trainers and every one has exited 0."""
    return bool(trainers) and all(t.proc is not None and t.proc.poll() == 0 for t in trainers)


def _finish(
    sup: Supervisor,
    progress: Progress,
    run_dir: Path,
    t0: float,
    stop: dict[str, int],
    viewer: subprocess.Popen[bytes] | None,
) -> None:
    """The trainers are done: say so, give the other roles 10 s to exit by themselves (services run until
    stop_all), and keep a dashboard up until its user closes it."""
    progress.steps()
    _log.info(
        "%s (%s) in %.1fs; run directory %s",
        "every policy reached its step budget"
        if progress.all_reached
        else "the run was stopped before its budget",
        ", ".join(f"{k} {v}" for k, v in progress.budgets.items()),
        time.monotonic() - t0,
        run_dir,
    )
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(c.running for c in sup.children if c.role != "service"):
        progress.steps()
        time.sleep(0.1)
    progress.steps()
    while viewer is not None and viewer.poll() is None and not stop["signal"]:
        time.sleep(0.1)  # the run is over; the dashboard stays until its user closes it

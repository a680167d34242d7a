"""The trainer service: pulls its policy's batches, steps, checkpoints, publishes each version's weights."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from astraflow import log
from astraflow.errors import AstraflowError

_log = log.get("trainer")

BATCH_WAIT_S = 1.0
"""How long a BatchRequest asks the controller to hold it when the batch is not ready (a long poll)."""


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint directory (step-N with a COMPLETE marker) under root."""
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for d in root.iterdir():
        m = re.fullmatch(r"step-(\d+)", d.name)
        if m and (d / "COMPLETE").is_file():
            k = int(m.group(1))
            if best is None or k > best[0]:
                best = (k, d)
    return None if best is None else best[1]


def save_checkpoint(trainer: Any, root: Path, keep: int = 2) -> Path:
    """Write step-N atomically (a COMPLETE marker last) and keep only the newest `keep`."""
    import shutil

    step = trainer.step_count
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save_checkpoint(tmp)
    (tmp / "COMPLETE").write_text(str(step))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    ckpts = sorted(
        (d for d in root.iterdir() if re.fullmatch(r"step-\d+", d.name)),
        key=lambda d: int(d.name.split("-")[1]),
    )
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def run_trainer(
    controller: str,
    *,
    policy: str,
    checkpoint_dir: Path | None = None,
    member_id: str | None = None,
    region: str = "",
    advertise: str | None = None,
    connect_timeout_s: float = 30.0,
    weights_bind: str | None = None,
    weights_port: int = 0,
) -> int:
    """Train `policy` until the run's step budget; returns the process exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from astraflow import plugins
    from astraflow.config.load import validate_recipe
    from astraflow.protocol.messages import BatchReply, BatchRequest, Error, TrainSample
    from astraflow.roles import member_files
    from astraflow.roles.member import (
        advertise_host,
        connect_retrying,
        make_hello,
        request_retrying,
        require_model_dirs,
    )
    from astraflow.roles.trainer_ranks import Leader, follow, world_from_env
    from astraflow.transport.client import MemberClient

    ranks = world_from_env()
    if ranks > 1:
        from astraflow.trainers import distributed as dist

        dist.init_from_env("auto")
        if dist.rank() != 0:
            # A follower: the recipe comes from rank 0, which alone talks to the controller.
            recipe_dict = dist.broadcast(None)
            recipe = validate_recipe(recipe_dict, source="recipe from rank 0")
            pol = recipe.get_policy(policy)
            import torch

            torch.set_num_threads(pol.threads)
            follower = plugins.load("trainers", pol.trainer)(pol, seed=recipe.run.seed)
            return follow(follower)

    hello = make_hello("trainer", member_id or f"trainer-{policy}", policies=[policy], region=region)
    client = MemberClient(controller, hello, connect_timeout_s=connect_timeout_s)
    welcome = connect_retrying(client)
    recipe = validate_recipe(welcome.recipe, source="recipe from the controller")
    try:
        pol = recipe.get_policy(policy)
    except KeyError:
        client.close("unknown policy")
        raise AstraflowError(
            f"the run has no policy {policy!r}", hint=f"policies: {', '.join(p.name for p in recipe.policy)}"
        ) from None
    if not pol.trainable:
        client.close("frozen policy")
        raise AstraflowError(
            f"policy {policy!r} is frozen (trainable = false): it has no trainer",
            hint="RaaS workers serve it from its model directory at version 0",
        )
    budget = recipe.budget(policy)

    require_model_dirs(recipe, [policy], client)
    if ranks > 1:
        dist.broadcast(welcome.recipe)
    import torch

    from astraflow.roles.trainer_publish import VersionAnnouncer, trainer_transports
    from astraflow.trainers.guard import NonFiniteError, SkipGuard, finite_metrics, nonfinite_weights

    torch.set_num_threads(pol.threads)
    stopping = {"sig": 0}

    def on_term(signum: int, _frame: Any) -> None:
        # leave at once, even from a blocking request: checkpoints are written atomically
        stopping["sig"] = signum
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_term)

    trainer_cls = plugins.load("trainers", pol.trainer)
    trainer = trainer_cls(pol, seed=recipe.run.seed)
    if ranks > 1:
        trainer = Leader(trainer)
        _log.info("training %s over %d ranks (FSDP2)", policy, ranks)
    ckpt_root = checkpoint_dir or member_files.checkpoint_dir(recipe.run.name, policy)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _log.info("checkpoints of %s in %s", policy, ckpt_root)
    last = latest_checkpoint(ckpt_root)
    if last is not None:
        trainer.load_checkpoint(last)
        _log.info("resumed %s from %s (step %d)", policy, last, trainer.step_count)

    host = advertise or advertise_host(controller)
    # the weight server binds a local address (the one that reaches the controller unless told) and is
    # announced under --advertise when workers reach this host by another name (NAT, a load balancer)
    server, background = weight_publisher(
        recipe.weights,
        weights_bind or advertise_host(controller),
        policy,
        port=weights_port,
        advertise=host,
    )
    dev = getattr(trainer, "device", None)
    fast = trainer_transports(
        recipe, policy, dev if isinstance(dev, torch.device) else torch.device("cpu"), host
    )
    publisher = VersionAnnouncer(client, policy, server, fast, background)

    def announce(block: bool, give_up_after_s: float = 600.0) -> float:
        """Announce the version whose blob is in flight once it is served (VersionAnnouncer.flush)."""
        return publisher.flush(block, give_up_after_s)

    def publish(metrics: dict[str, float]) -> None:
        t0 = time.monotonic()
        weights = snapshot()
        bad = nonfinite_weights(weights)
        if bad:
            raise NonFiniteError(
                f"the weights after step {trainer.step_count} are not finite ({len(bad)} tensors, e.g. "
                f"{bad[0]}); they are not published",
                hint="lower optimizer.lr, or look for extreme values in the results (the controller's events)",
            )
        # trainer_publish_s counts the weights' copy too (the trainer's own share of publishing)
        publisher.publish(trainer.step_count, weights, metrics, started=t0)

    def snapshot() -> dict[str, Any]:
        take = getattr(trainer, "weights_snapshot", None)
        return dict(take() if take is not None else trainer.export_weights())

    guard = SkipGuard(policy, pol.max_nonfinite_steps)
    bye = "done"
    try:
        if trainer.step_count > 0:
            publish({})
        while trainer.step_count < budget and not stopping["sig"]:
            step = trainer.step_count + 1
            t_wait = time.monotonic()
            batch: list[TrainSample] | None = None
            parts = 1
            while not stopping["sig"]:
                client.tick()
                announce(block=False)  # the previous version, as soon as it is served
                # a long poll (the controller answers once the batch is ready), except while a version
                # is still being serialised: it must be announced first, so workers can pull it
                wait = 0.0 if publisher.busy else BATCH_WAIT_S
                # a held request whose controller died is never answered: the restarted controller's
                # HeartbeatAck names it lost at once; the shorter deadline is the fallback if none does
                reply = request_retrying(
                    client,
                    BatchRequest(policy=policy, step=step, wait_s=wait),
                    timeout_s=15.0 + wait if wait > 0 else 60.0,
                )
                if isinstance(reply, BatchReply) and reply.ready:
                    parts = reply.parts
                    batch = fetch_parts(client, reply)
                    break
                if isinstance(reply, BatchReply) and reply.done:
                    break
                if isinstance(reply, Error):
                    raise AstraflowError(f"controller refused batch {step}: {reply.code} {reply.message}")
                pause = max(0.0, getattr(reply, "retry_after_s", 0.05) or 0.0)
                if wait > 0:
                    pause = 0.01  # the controller held the request already: ask again at once
                if publisher.busy:
                    publisher.wait(pause)  # announce it the moment it is served
                elif pause > 0:
                    time.sleep(pause)
            if batch is None:
                break
            wait_s = time.monotonic() - t_wait
            client.tick()
            t_step = time.monotonic()
            metrics = dict(trainer.step(batch))
            dev = getattr(trainer, "device", None)
            if isinstance(dev, torch.device) and dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the optimizer's kernels may still run: count them here
            compute_s = time.monotonic() - t_step
            guard.after_step(trainer.step_count, metrics)  # reports a skipped step; raises at the limit
            if pol.trainer_sleep_s > 0:
                time.sleep(pol.trainer_sleep_s)  # the benchmarking knob: a costlier policy's step
            step_s = time.monotonic() - t_step
            client.tick()
            announce(block=False)  # the previous version, if it was not yet served when this step began
            t_ckpt = time.monotonic()
            if trainer.step_count % pol.checkpoint_every == 0 or trainer.step_count >= budget:
                save_checkpoint(trainer, ckpt_root)
            metrics.update(
                {
                    "trainer_wait_s": wait_s,
                    "trainer_step_s": step_s,
                    "trainer_compute_s": compute_s,
                    # wall clock at the step's end: its version may be announced a step later
                    "trainer_done_at": time.time(),
                    "trainer_checkpoint_s": time.monotonic() - t_ckpt,
                    "batch_size": float(len(batch)),
                    "trainer_batch_parts": float(parts),
                }
            )
            publish(finite_metrics({k: float(v) for k, v in metrics.items()}))
        announce(block=True)
        if not stopping["sig"] and 0 < trainer.step_count < budget:
            # the controller ended the run early (an operator's stop): keep the last step
            if trainer.step_count % pol.checkpoint_every:
                save_checkpoint(trainer, ckpt_root)
            _log.info("run stopped by the controller at step %d of %d", trainer.step_count, budget)
        if stopping["sig"]:
            _log.info("stopping on signal; last step %d", trainer.step_count)
            return 0 if trainer.step_count >= budget else 143
        _log.info("policy %s reached %d steps", policy, trainer.step_count)
        if recipe.eval is not None:
            serve_until_done(client, policy, budget, stopping)
        if isinstance(trainer, Leader):
            trainer.stop()
        return 0
    except NonFiniteError as exc:
        bye = f"failed: {exc}"  # the controller records why this trainer left
        _log.error("%s\n  hint: %s", exc.message, exc.hint)
        return 1
    except AstraflowError as exc:
        bye = f"failed: {exc}"
        raise
    finally:
        if publisher.busy:
            # a stop (signal, error) mid-publish: finish and announce the version if the controller
            # still answers; a restarted trainer re-announces its last checkpoint anyway
            try:
                announce(block=True, give_up_after_s=10.0)
            except (AstraflowError, OSError) as exc:
                _log.warning("version in flight at stop not announced: %s", exc)
        publisher.close()
        server.close()
        client.close(bye[:1000])


def fetch_parts(client: Any, first: Any) -> list[Any] | None:
    """The samples of a ready batch: `first`'s, then those of its other parts (a batch larger than one
    message comes in parts); None when the controller says the run is done meanwhile."""
    from astraflow.protocol.messages import BatchReply, BatchRequest
    from astraflow.roles.member import request_retrying

    samples = list(first.samples)
    for part in range(1, first.parts):
        reply = request_retrying(
            client, BatchRequest(policy=first.policy, step=first.step, part=part), timeout_s=60.0
        )
        if isinstance(reply, BatchReply) and reply.done:
            return None
        if not (isinstance(reply, BatchReply) and reply.ready and reply.part == part):
            detail = f"{reply.code} {reply.message}" if hasattr(reply, "code") else type(reply).__name__
            raise AstraflowError(f"controller refused part {part} of batch {first.step}: {detail}")
        samples += reply.samples
    return samples


def serve_until_done(client: Any, policy: str, budget: int, stopping: dict[str, int]) -> None:
    """Keep the weight server up after the last step until the controller says the run is done: a
    held-out eval round of the last version may still pull these weights."""
    from astraflow.protocol.messages import BatchReply, BatchRequest
    from astraflow.roles.member import request_retrying

    while not stopping["sig"]:
        client.tick()
        reply = request_retrying(client, BatchRequest(policy=policy, step=budget + 1), timeout_s=60.0)
        if not isinstance(reply, BatchReply) or reply.done:
            return
        time.sleep(max(0.05, reply.retry_after_s or 0.2))


def weight_publisher(
    cfg: Any, host: str, policy: str, *, port: int = 0, advertise: str | None = None
) -> tuple[Any, Any]:
    """The trainer's weight server (bound on `host`, a fixed `port` or any, announced under `advertise`)
    and the publisher that fills it, as `[weights]` asks (deltas or not)."""
    from astraflow.weights.publisher import BackgroundPublisher
    from astraflow.weights.server import WeightServer

    delta = cfg.mode == "delta"
    server = WeightServer(
        host,
        chunk_bytes=cfg.chunk_bytes,
        keep_versions=cfg.keep_versions,
        keep_deltas=cfg.max_chain if delta else 0,
        port=port,
        advertise_host=advertise or host,
    )
    return server, BackgroundPublisher(server, policy, delta=delta)

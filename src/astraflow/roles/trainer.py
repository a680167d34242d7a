"""The trainer service: pulls its policy's batches, steps, checkpoints, publishes each version's weights."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow import log
from astraflow.errors import AstraflowError, Stopped
from astraflow.roles import member_files
from astraflow.roles.member import advertise_host
from astraflow.roles.stop_flag import StopFlag
from astraflow.roles.trainer_batches import fetch_parts
from astraflow.roles.trainer_checkpoint import latest_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from astraflow.roles.trainer_sections import TrainerSections
    from astraflow.transport.client import MemberClient

_log = log.get("trainer")

BATCH_WAIT_S = 1.0
"""How long a BatchRequest asks the controller to hold it when the batch is not ready (a long poll)."""


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
    from astraflow.roles.trainer_ranks import world_from_env

    ranks = world_from_env()
    if ranks > 1:
        from astraflow.trainers import distributed as dist

        dist.init_from_env("auto")
        if dist.rank() != 0:
            return _follow_rank0(policy)
    client, welcome, sections = _join(controller, policy, member_id, region, connect_timeout_s)
    if ranks > 1:
        dist.broadcast(welcome.sections)
    loop = TrainerLoop(
        client,
        sections,
        policy,
        ranks=ranks,
        checkpoint_dir=checkpoint_dir,
        host=advertise or advertise_host(controller),
        weights_bind=weights_bind or advertise_host(controller),
        weights_port=weights_port,
    )
    return loop.run()


def _follow_rank0(policy: str) -> int:
    """A follower rank: its sections of the recipe come from rank 0, which alone talks to the controller."""
    import torch

    from astraflow import plugins
    from astraflow.roles.trainer_ranks import follow
    from astraflow.roles.trainer_sections import TrainerSections
    from astraflow.trainers import distributed as dist

    sections = TrainerSections.from_wire(dist.broadcast(None))
    pol = sections.policy
    torch.set_num_threads(pol.threads)
    return follow(plugins.load("trainers", pol.trainer)(pol, seed=sections.seed))


def _join(
    controller: str, policy: str, member_id: str | None, region: str, connect_timeout_s: float
) -> tuple[Any, Any, Any]:
    """Join the controller as `policy`'s trainer; the client, its Welcome and its sections of the recipe
    (roles/trainer_sections.py). Refuses (with the client closed) sections that are not valid, a frozen
    policy, or a missing model; the controller refuses a policy the run does not have."""
    from astraflow.models.dirs import require_model_dirs
    from astraflow.roles.member import connect_retrying, make_hello
    from astraflow.roles.trainer_sections import TrainerSections
    from astraflow.transport.client import MemberClient

    hello = make_hello("trainer", member_id or f"trainer-{policy}", policies=[policy], region=region)
    client = MemberClient(controller, hello, connect_timeout_s=connect_timeout_s)
    welcome = connect_retrying(client)
    try:
        sections = TrainerSections.from_wire(welcome.sections)
    except AstraflowError:
        client.close("bad sections")
        raise
    pol = sections.policy
    if not pol.trainable:
        client.close("frozen policy")
        raise AstraflowError(
            f"policy {policy!r} is frozen (trainable = false): it has no trainer",
            hint="RaaS workers serve it from its model directory at version 0",
        )
    require_model_dirs([pol], client)
    return client, welcome, sections


class TrainerLoop:
    """One policy's training, as a list of steps: resume, then (next batch, train, checkpoint, publish)
    until the step budget or a stop, then drain. A signal sets `stop`, which is checked between those
    steps and inside the long polls; the loop then returns the signal's exit code."""

    def __init__(
        self,
        client: MemberClient,
        sections: TrainerSections,
        policy: str,
        *,
        ranks: int,
        checkpoint_dir: Path | None,
        host: str,
        weights_bind: str,
        weights_port: int,
    ) -> None:
        """Build the trainer and the weight publishing for `policy`; SIGTERM/SIGINT set `stop` from now."""
        import torch

        from astraflow import plugins
        from astraflow.roles.trainer_publish import VersionAnnouncer, trainer_transports, weight_publisher
        from astraflow.roles.trainer_ranks import Leader
        from astraflow.trainers.guard import SkipGuard

        self.client = client
        self.sections = sections
        self.policy = policy
        self.pol = sections.policy
        self.budget = sections.budget
        torch.set_num_threads(self.pol.threads)
        self.stop = StopFlag().install()
        self.trainer = plugins.load("trainers", self.pol.trainer)(self.pol, seed=sections.seed)
        if ranks > 1:
            self.trainer = Leader(self.trainer)
            _log.info("training %s over %d ranks (FSDP2)", policy, ranks)
        self.ckpt_root = checkpoint_dir or member_files.checkpoint_dir(sections.run_name, policy)
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        _log.info("checkpoints of %s in %s", policy, self.ckpt_root)
        # the weight server binds a local address (the one that reaches the controller unless told) and
        # is announced under `host` when workers reach this host by another name (NAT, a load balancer)
        self.server, background = weight_publisher(
            sections.weights, weights_bind, policy, port=weights_port, advertise=host
        )
        fast = trainer_transports(sections.weights, policy, self.cuda_device or torch.device("cpu"), host)
        self.publisher = VersionAnnouncer(client, policy, self.server, fast, background, stop=self.stop)
        self.publisher.prewarm(self.trainer, sections.weights.keep_versions)
        self.guard = SkipGuard(policy, self.pol.max_nonfinite_steps)

    @property
    def cuda_device(self) -> Any:
        """The trainer's torch device when it has one (None for a trainer that names none)."""
        import torch

        dev = getattr(self.trainer, "device", None)
        return dev if isinstance(dev, torch.device) else None

    def run(self) -> int:
        """Train to the budget (or the controller's stop), then drain; returns the exit code."""
        from astraflow.trainers.guard import NonFiniteError

        self.resume()
        bye = "done"
        try:
            if self.trainer.step_count > 0:
                self.publish({})  # the resumed version, for workers that join after a restart
            _log.info("training %s from step %d to %d", self.policy, self.trainer.step_count, self.budget)
            while self.trainer.step_count < self.budget and not self.stop():
                batch = self.next_batch()
                if batch is None or self.stop():
                    break
                metrics = self.train(batch)
                if self.stop():
                    break
                metrics["trainer_checkpoint_s"] = self.checkpoint()
                self.publish(metrics)
            return self.stopped() if self.stop() else self.drain()
        except Stopped:
            return self.stopped()
        except NonFiniteError as exc:
            bye = f"failed: {exc}"  # the controller records why this trainer left
            _log.error("%s\n  hint: %s", exc.message, exc.hint)
            return 1
        except AstraflowError as exc:
            bye = f"failed: {exc}"
            raise
        finally:
            self.close(bye)

    def resume(self) -> None:
        """Load the newest complete checkpoint, if any."""
        last = latest_checkpoint(self.ckpt_root)
        if last is not None:
            self.trainer.load_checkpoint(last)
            _log.info("resumed %s from %s (step %d)", self.policy, last, self.trainer.step_count)

    def next_batch(self) -> list[Any] | None:
        """The next step's batch, by long polls; None when the controller says the run is done.

        Sets `wait_s` (the time spent waiting) and `parts` (the messages the batch came in)."""
        from astraflow.protocol.messages import BatchReply, BatchRequest, Error
        from astraflow.roles.member import request_retrying

        step = self.trainer.step_count + 1
        t_wait = time.monotonic()
        self.parts = 1
        batch: list[Any] | None = None
        while not self.stop():
            self.client.tick()
            self.announce(block=False)  # the previous version, as soon as it is served
            # a long poll (the controller answers once the batch is ready), except while a version is
            # still being serialised: it must be announced first, so workers can pull it
            wait = 0.0 if self.publisher.busy else BATCH_WAIT_S
            # a held request whose controller died is never answered: the restarted controller's
            # HeartbeatAck names it lost at once; the shorter deadline is the fallback if none does
            reply = request_retrying(
                self.client,
                BatchRequest(policy=self.policy, step=step, wait_s=wait),
                timeout_s=15.0 + wait if wait > 0 else 60.0,
                stop=self.stop,
            )
            if isinstance(reply, BatchReply) and reply.ready:
                self.parts = reply.parts
                batch = fetch_parts(self.client, reply, stop=self.stop)
                break
            if isinstance(reply, BatchReply) and reply.done:
                break
            if isinstance(reply, Error):
                raise AstraflowError(f"controller refused batch {step}: {reply.code} {reply.message}")
            self.pause_before_asking_again(reply, wait)
        self.wait_s = time.monotonic() - t_wait
        return batch

    def pause_before_asking_again(self, reply: Any, wait: float) -> None:
        """Between batch polls: announce a version being served the moment it is, else sleep as told."""
        pause = max(0.0, getattr(reply, "retry_after_s", 0.05) or 0.0)
        if wait > 0:
            pause = 0.01  # the controller held the request already: ask again at once
        if self.publisher.busy:
            self.publisher.wait(pause)  # announce it the moment it is served
        elif pause > 0:
            self.stop.sleep(pause)

    def train(self, batch: list[Any]) -> dict[str, float]:
        """One optimizer step on `batch`; its metrics with the step's timings."""
        import torch

        self.client.tick()
        t_step = time.monotonic()
        metrics = dict(self.trainer.step(batch))
        dev = self.cuda_device
        if dev is not None and dev.type == "cuda":
            # the optimizer's kernels may still run: count them here (this stream only: a device-wide
            # sync would also wait for the last version's copies to the host on the publisher's stream)
            torch.cuda.current_stream(dev).synchronize()
        compute_s = time.monotonic() - t_step
        self.guard.after_step(self.trainer.step_count, metrics)  # reports a skipped step; raises at the limit
        if self.pol.trainer_sleep_s > 0:
            time.sleep(self.pol.trainer_sleep_s)  # the benchmarking knob: a costlier policy's step
        metrics.update(
            {
                "trainer_wait_s": self.wait_s,
                "trainer_step_s": time.monotonic() - t_step,
                "trainer_compute_s": compute_s,
                # wall clock at the step's end: its version may be announced a step later
                "trainer_done_at": time.time(),
                "batch_size": float(len(batch)),
                "trainer_batch_parts": float(self.parts),
            }
        )
        self.client.tick()
        self.announce(block=False)  # the previous version, if it was not yet served when this step began
        return metrics

    def checkpoint(self) -> float:
        """Save a checkpoint when one is due (every checkpoint_every steps, and at the budget); returns
        the seconds it took."""
        t_ckpt = time.monotonic()
        step = self.trainer.step_count
        if step % self.pol.checkpoint_every == 0 or step >= self.budget:
            save_checkpoint(self.trainer, self.ckpt_root, self.pol.keep_checkpoints)
        return time.monotonic() - t_ckpt

    def publish(self, metrics: dict[str, float]) -> None:
        """Publish the current weights as the version of this step (refused when not finite)."""
        from astraflow.trainers.guard import NonFiniteError, finite_metrics, nonfinite_weights

        t0 = time.monotonic()
        step = self.trainer.step_count

        def check(weights: dict[str, Any]) -> None:
            bad = nonfinite_weights(weights)
            if bad:
                raise NonFiniteError(
                    f"the weights after step {step} are not finite ({len(bad)} tensors, e.g. "
                    f"{bad[0]}); they are not published",
                    hint="lower optimizer.lr, or look for extreme values in the results (the controller's events)",
                )

        take = getattr(self.trainer, "weights_snapshot", None)
        weights = dict(take() if take is not None else self.trainer.export_weights())
        metrics = finite_metrics({k: float(v) for k, v in metrics.items()})
        # trainer_publish_s counts the weights' copy too (the trainer's own share of publishing); the
        # check and the packing run on the publisher's thread
        self.publisher.publish(step, weights, metrics, started=t0, check=check)

    def announce(self, block: bool, give_up_after_s: float = 600.0) -> float:
        """Announce the version whose blob is in flight once it is served (VersionAnnouncer.flush)."""
        return self.publisher.flush(block, give_up_after_s)

    def drain(self) -> int:
        """After the loop: announce the last version, keep an early-stopped run's last step, serve the
        weights until the run is done when an eval may pull them; returns the exit code."""
        from astraflow.roles.trainer_ranks import Leader

        self.announce(block=True)
        self.publisher.finish_deltas(30.0, give_up_after_s=10.0)  # the last version's delta metrics
        step = self.trainer.step_count
        if 0 < step < self.budget:
            # the controller ended the run early (an operator's stop): keep the last step
            if step % self.pol.checkpoint_every:
                save_checkpoint(self.trainer, self.ckpt_root, self.pol.keep_checkpoints)
            _log.info("run stopped by the controller at step %d of %d", step, self.budget)
        _log.info("policy %s reached %d steps", self.policy, step)
        if self.sections.eval:
            serve_until_done(self.client, self.policy, self.budget, self.stop)
            if self.stop():
                return self.stopped()
        if isinstance(self.trainer, Leader):
            self.trainer.stop()
        return 0

    def stopped(self) -> int:
        """The exit code of a stop by signal (the newest checkpoint is what a restart resumes from)."""
        _log.info("stopping on signal; last step %d", self.trainer.step_count)
        return self.stop.exit_code

    def close(self, bye: str) -> None:
        """Finish a version still in flight if the controller answers, stop publishing, say Bye."""
        if self.publisher.busy:
            # a stop (signal, error) mid-publish: finish and announce the version if the controller
            # still answers; a restarted trainer re-announces its last checkpoint anyway
            self.publisher.stop = None  # a signal's stop is no reason to skip this last announcement
            # but after a signal, briefly: the launcher that sent it (or died) stops the controller too
            try:
                self.announce(block=True, give_up_after_s=3.0 if self.stop() else 10.0)
            except (AstraflowError, OSError, Stopped) as exc:
                _log.warning("version in flight at stop not announced: %s", exc)
        self.publisher.close()
        self.server.close()
        self.client.close(bye[:1000])


def serve_until_done(client: MemberClient, policy: str, budget: int, stop: StopFlag) -> None:
    """Keep the weight server up after the last step until the controller says the run is done: a
    held-out eval round of the last version may still pull these weights."""
    from astraflow.protocol.messages import BatchReply, BatchRequest
    from astraflow.roles.member import request_retrying

    while not stop():
        client.tick()
        reply = request_retrying(
            client, BatchRequest(policy=policy, step=budget + 1), timeout_s=60.0, stop=stop
        )
        if not isinstance(reply, BatchReply) or reply.done:
            return
        stop.sleep(max(0.05, reply.retry_after_s or 0.2))

"""The training loop: ``train()`` (loop, evaluation, callbacks, checkpoints), ``train_step()`` (one optimizer
step) and the engine's ``forward_backward()`` (the step's micro-batches), on a layout built once
(``rank_setup``). The loop acts; what it asks (is this step logged, is a save due, which checkpoint to resume,
the step's batches) is answered from plain values by ``tracking.metrics``, ``checkpoint.policy``, ``data.feed``.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from paratrain.callbacks.base import Callback, CallbackList
from paratrain.callbacks.built_in import built_in_callbacks
from paratrain.callbacks.configured import build_callbacks
from paratrain.checkpoint.state import Progress, RNGState, scaler_state, training_state
from paratrain.config.factories import call_factory, reported_as_user_code
from paratrain.config.loading import config_to_yaml
from paratrain.config.schema import Config
from paratrain.debug import maybe_dump_gradients
from paratrain.evaluation import check_evaluation
from paratrain.gradients import clip_grad_norm
from paratrain.launch import faults
from paratrain.launch.joining_groups import maybe_join_replica_groups
from paratrain.launch.preemption import StopSignals, end_on_signal
from paratrain.launch.process_group import destroy_distributed
from paratrain.launch.watchdog import StepWatchdog
from paratrain.losses import LossFn
from paratrain.nonfinite import NonFiniteWatch, step_optimizer
from paratrain.optim import build_lr_scheduler, build_optimizer
from paratrain.tracking.metrics import LogWindow, MetricsLogger, NoMetrics, build_record, open_metrics, should_log
from paratrain.training import rank_setup
from paratrain.training.run_checkpoints import RunCheckpoints

logger = logging.getLogger("paratrain")


@dataclass(frozen=True)
class TrainResult:
    """What a finished run leaves behind."""

    steps: int
    final_loss: float | None
    output_dir: Path
    last_checkpoint: Path | None


@dataclass(frozen=True)
class StepOutput:
    """What one optimizer step reports, kept on device until a log step reads it."""

    loss: torch.Tensor  # this rank's mean loss over the step's micro-batches
    grad_norm: torch.Tensor  # global gradient norm before clipping
    lr: float  # learning rate the step used
    finite: torch.Tensor  # whether the gradients were finite (False: the optimizer did not step), on device
    committed: bool = True  # False: replica groups did not commit the step (torchft); it is taken again


class Trainer:
    """Trains a model under the layout the config names.

    Args:
        config: The resolved config (``paratrain.load_config``).
        model_factory: Builds the model; defaults to ``model.factory`` of the config.
        dataset: A map-style dataset of (inputs, targets); defaults to ``data.factory``.
        loss_fn: ``loss_fn(outputs, targets) -> mean loss``; defaults to ``loss.factory``.
        callbacks: Called after the config's ``callbacks`` (see paratrain.callbacks.Callback).
        eval_dataset: A validation dataset like ``dataset``; defaults to ``eval.factory`` (none if null).
    """

    def __init__(
        self,
        config: Config,
        *,
        model_factory: Callable[[], nn.Module] | None = None,
        dataset: Dataset | None = None,
        loss_fn: LossFn | None = None,
        callbacks: list[Callback] = (),
        eval_dataset: Dataset | None = None,
    ):
        self.config, train, output_dir = config, config.train, config.run.output_dir
        dims = rank_setup.resolve_dims(config.parallel)
        check_evaluation(config.eval, dims, has_dataset=eval_dataset is not None)
        user_callbacks = build_callbacks(config.callbacks, callbacks)
        ctx, self.dims = rank_setup.init_rank(dims, parallel=config.parallel, train=train)
        self.ctx = ctx
        self.pipeline_group = self.dims.pp_mesh.get_group() if self.dims.pp_enabled else None  # other stages' ranks
        self.health = NonFiniteWatch(train, before_stopping=lambda: self.checkpointer.wait())  # a save in flight
        resolved = config.model_dump(mode="json")  # recorded in every checkpoint, compared with a resume's
        self.checkpoints = RunCheckpoints(
            config.checkpoint, output_dir, ctx=ctx, config=resolved, state=self.checkpoint_state, health=self.health
        )
        self.checkpointer = self.checkpoints.checkpointer
        given = (dataset is not None, bool(model_factory), bool(loss_fn))  # for messages naming what the user gave
        dataset = rank_setup.load_dataset(dataset, config.data, dims=self.dims)
        sections = rank_setup.RankSections(*(getattr(config, field.name) for field in fields(rank_setup.RankSections)))
        built = rank_setup.build_rank_model(
            model_factory or (lambda: call_factory(config.model, key="model")),
            loss_fn or call_factory(config.loss, key="loss"),
            dataset,
            given=given,
            dims=self.dims,
            ctx=ctx,
            sections=sections,
            output_dir=output_dir,
            resuming=self.checkpoints.chosen is not None,
        )
        self.bare_model, self.model, self.engine = built.layout.bare, built.layout.runnable, built.layout.engine
        self.precision, self.devices = built.precision, built.devices
        # dp ranks draw different random numbers (dropout masks); a replica's tp ranks the same: same activations.
        torch.manual_seed(train.seed + self.dims.dp_rank)
        self.optimizer = build_optimizer(self.bare_model, config.optim, dp_size=self.dims.dp)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.optim, max_steps=train.max_steps)
        self.feed = rank_setup.build_feed(
            dataset, data=config.data, train=train, pipeline=config.pipeline, dims=self.dims, device=ctx.device
        )
        self.tokens_per_sample, self.progress = self.feed.tokens_per_sample, Progress()
        self.evaluator = rank_setup.build_rank_evaluator(config.eval, eval_dataset, built, dims=self.dims, train=train)
        self.reference = rank_setup.build_preference_reference(dataset, built, dims=self.dims, train=train)  # DPO
        own = built_in_callbacks(config.profile, self.bare_model, built.loss_fn, output_dir=output_dir, ctx=ctx)
        self.callbacks = CallbackList([*own, *user_callbacks], self)
        self._started, self._stepped = False, False  # _stepped: see _first_step_or_next
        groups = config.parallel.fault_tolerance  # fault-tolerant replica groups, when the run is one of several
        self.replicas = maybe_join_replica_groups(
            groups, dims=self.dims, device=ctx.device, state=self.checkpoint_state, feed=self.feed
        )

    def train(self) -> TrainResult:
        """Runs from the current step to ``train.max_steps`` (or until a callback stops it), evaluating,
        logging and checkpointing on the way."""
        self._maybe_start()
        self.checkpoints.attempt_started(self.progress.step)  # the run directory's failure history
        config, ctx, max_steps = self.config, self.ctx, self.config.train.max_steps
        hparams, hang = config.model_dump(mode="json"), config.run.output_dir / "hang"
        metrics = open_metrics(
            config.log, config.run, hparams, is_main=ctx.is_main, start_step=self.progress.step, max_steps=max_steps
        )
        batches, window, last_loss, last_checkpoint = self.feed.step_batches(), LogWindow.open(ctx.device), None, None
        stop = StopSignals.install(ctx.device)
        watchdog = StepWatchdog(config.debug.step_timeout_s, directory=hang, rank=ctx.rank, world_size=ctx.world_size)
        self.callbacks.call("on_train_start")
        outcome = "failed"  # what the trackers record unless the loop ends otherwise
        try:
            while self.progress.step < max_steps:
                if self.replicas.start_step():
                    batches = self.feed.step_batches()  # healed: read on from the position a live peer sent
                step = self._first_step_or_next(window.next_batch(batches))
                if not step.committed:  # a replica group failed during the step: the next quorum retakes it
                    logger.warning(
                        "step %d not committed by the replica groups; taking it again", self.progress.step + 1
                    )
                    batches = self.feed.step_batches()
                    continue
                self._count_step(step, window)
                metrics.step_done()
                evaluated = self._maybe_evaluate(window)
                if should_log(self.progress.step, every_steps=config.log.every_steps, max_steps=max_steps) or evaluated:
                    last_loss = self._log(metrics, window, step, evaluated=evaluated)
                    window = LogWindow.open(ctx.device)
                else:
                    self.callbacks.call("on_step_end")
                stop_signal = self.replicas.agreed_stop(stop) if self.progress.step < max_steps else None
                last_checkpoint = self._maybe_save(preempted=stop_signal is not None) or last_checkpoint
                faults.maybe_kill("after_step", step=self.progress.step, rank=ctx.rank)
                if stop_signal is not None:
                    outcome = "preempted"
                    raise end_on_signal(
                        stop_signal.name, last_checkpoint, step=self.progress.step, ctx=ctx, received=stop.received_name
                    )
                watchdog.step_done(self.progress.step)
                if self.callbacks.stop_reason:
                    logger.info("stopping early after step %d: %s", self.progress.step, self.callbacks.stop_reason)
                    break
            self.health.settle()
            self.checkpointer.wait()  # an asynchronous save still in flight is complete before train() returns
            self.callbacks.call("on_train_end")
            outcome = "success"
        finally:
            watchdog.stop()
            stop.uninstall()
            metrics.close(outcome)
            self.checkpoints.attempt_ended(self.progress.step, outcome)
            self.engine.flush()
        return TrainResult(self.progress.step, last_loss, config.run.output_dir, last_checkpoint)

    def train_step(self, micro_batches: list[Any]) -> StepOutput:
        """One optimizer step over a global batch."""
        step, rank, model, group = self.progress.step + 1, self.ctx.rank, self.bare_model, self.pipeline_group
        faults.maybe_stall("stall_in_step", step=step, rank=rank)
        faults.maybe_slow_down("slow_step", step=step, rank=rank, seconds=faults.SLOW_STEP_S)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.replicas.forward_backward(self.engine, micro_batches, model.parameters())
        self.precision.unscale_(self.optimizer)
        faults.maybe_poison_gradients("nan_grad", model, step=step, rank=rank)
        config, is_main = self.config, self.ctx.is_main
        maybe_dump_gradients(
            model, config.debug, config.run.output_dir, step=step, is_main=is_main, pipeline_group=group
        )
        # Pipeline ranks hold different parameters: their squared norms add up to the global one.
        grad_norm = clip_grad_norm(list(model.parameters()), config.train.grad_clip, sum_over=group)
        lr = self.optimizer.param_groups[0]["lr"]
        if not self.replicas.should_commit():
            return StepOutput(loss, grad_norm, lr, torch.ones((), dtype=torch.bool), committed=False)
        # The schedule follows the step count (as with fp16's scaler), so a skipped step uses up its learning rate.
        finite = step_optimizer(self.optimizer, grad_norm, precision=self.precision)
        self.lr_scheduler.step()
        return StepOutput(loss, grad_norm, lr, finite)

    def _count_step(self, step: StepOutput, window: LogWindow) -> None:
        """Moves the run past a step: its count, the data position, the log window and its pending verdict."""
        self.progress.step += 1
        self.feed.step_done()
        window.add_step(step.loss, finite=step.finite)
        self.health.step_done(self.progress.step, step.finite)

    def close(self) -> None:
        """Releases the layout, then the process group if this Trainer created it. Call once training is over."""
        self.checkpointer.close()  # a background save needs the process group until it is written
        self.replicas.close()
        # DDP's reducer must be freed while the group is still registered: a reducer that outlives
        # it destroys the gloo group while holding the GIL, and gloo's worker threads, which need the
        # GIL to free tensors, then deadlock with it (pytorch#56297).
        self.model = self.engine = None
        gc.collect()
        if self.ctx.owns_group:
            destroy_distributed()

    def checkpoint_state(self) -> dict[str, Any]:
        """Every Stateful that a resume needs, under the names checkpoints store them by."""
        rng, scaler = RNGState(self.ctx.rank, self.devices), self.precision.scaler
        parts = training_state(self.bare_model, self.optimizer, self.lr_scheduler, data=self.feed.position, rng=rng)
        extra = self.replicas.checkpoint_state() | self.reference.checkpoint_state()
        return parts | {"progress": self.progress} | scaler_state(scaler) | extra

    def _maybe_evaluate(self, window: LogWindow) -> dict[str, float]:
        """{eval_loss, eval_time_s} on evaluation steps, else {}."""
        evaluated = self.evaluator.maybe_evaluate(self.progress.step) if self.evaluator is not None else {}
        if evaluated:
            window.leave_out(evaluated["eval_time_s"])  # step time and throughput measure training alone
            self.callbacks.call("on_evaluation", eval_loss=evaluated["eval_loss"])
        return evaluated

    def _log(
        self, metrics: MetricsLogger | NoMetrics, window: LogWindow, step: StepOutput, *, evaluated: dict[str, float]
    ) -> float:
        applied = self.health.applied_steps(window.steps, through_step=self.progress.step)  # skipped: left out
        group = self.dims.loss_mesh.get_group() if self.dims.mesh is not None else None
        loss = window.mean_loss(applied, group=group, dp=self.dims.loss_ranks)
        record = build_record(
            window,
            step=self.progress.step,
            loss=loss,
            lr=step.lr,
            grad_norm=step.grad_norm.item(),
            samples_per_step=self.config.train.global_batch_size,
            tokens_per_sample=self.tokens_per_sample,
            epoch=self.feed.position.epoch,
            world_size=self.ctx.world_size,
            skipped_steps=self.health.skipped_steps,
        )
        record.update(evaluated)
        record.update(self.replicas.log_fields(global_batch_size=self.config.train.global_batch_size))
        self.callbacks.call("on_step_end", record=record)  # callbacks may add fields to what is logged
        if self.ctx.is_main:
            metrics.log(record)
        return loss

    def _maybe_save(self, *, preempted: bool = False) -> Path | None:
        early, max_steps = self.callbacks.stop_reason is not None, self.config.train.max_steps
        path = self.checkpoints.maybe_save(
            self.progress.step, self.bare_model, max_steps=max_steps, ending_early=early, preempted=preempted
        )
        if path is not None:
            self.callbacks.call("on_checkpoint_saved", checkpoint=path)
        return path

    def _maybe_start(self) -> None:
        """Once, as training starts: the resume (a damaged one stops the run here), DPO's reference, the output dir."""
        config, step = self.config, self.progress.step
        if not self._started:
            self._started = True
            if not self.replicas.heals_instead_of_resuming() and self.checkpoints.chosen is not None:  # all groups join
                self._resume()
            self.reference.maybe_compute()
            if self.ctx.is_main:
                config.run.output_dir.mkdir(parents=True, exist_ok=True)
                (config.run.output_dir / "config.yaml").write_text(config_to_yaml(config))
            step = self.progress.step
        if step >= config.train.max_steps:
            logger.info("already at step %d of train.max_steps=%d: nothing to train", step, config.train.max_steps)

    def _resume(self) -> None:
        """Loads the chosen checkpoint (see RunCheckpoints.resume) and brings the layout past its first step."""
        loaded, step, epoch = self.checkpoints.resume(), self.progress.step, self.feed.position.epoch
        logger.info("resumed from %s at step %d (epoch %d)", loaded, step, epoch)
        rank_setup.settle_resumed_layout(self.model, self.engine, self.feed, dims=self.dims, device=self.ctx.device)
        self.replicas.set_step(step)  # replica groups whose checkpoint is older heal from this one

    def _first_step_or_next(self, batch: Any) -> Any:
        """A step; the run's first is where the user's forward and loss meet real data first, so what it
        raises is reported as their code's error (the user's frames, exit code 2), not a traceback."""
        if self._stepped:
            return self.train_step(batch)
        where = f"the first training step (the model's forward, the loss or backward) at step {self.progress.step + 1}"
        with reported_as_user_code(where):
            step = self.train_step(batch)
        self._stepped = True
        return step

"""The training loop: ``train()`` (loop, evaluation, callbacks, checkpoints), ``train_step()`` (one optimizer
step) and the engine's ``forward_backward()`` (the step's micro-batches). The loop never asks which layout
runs underneath: the layout is applied once, in ``build_parallel_model``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from paratrain.callbacks.base import Callback, CallbackList
from paratrain.callbacks.build import build_callbacks
from paratrain.callbacks.profiling import maybe_profiler
from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.config_changes import check_resume_config, log_resume_changes
from paratrain.checkpoint.manifest import read_manifest
from paratrain.checkpoint.state import ModelState, OptimizerState, Progress, RNGState
from paratrain.config.factories import call_factory, describe_user_error
from paratrain.config.schema import Config, config_to_yaml
from paratrain.cuda_settings import apply_kernel_settings
from paratrain.data.checks import SampleSources, check_dataset_fits_model
from paratrain.data.loader import StepBatches
from paratrain.data.sampler import DataPosition, GlobalBatchSampler, build_sampler
from paratrain.data.stream import StreamBatches, StreamedTokens, check_streaming
from paratrain.debug import dump_gradients, dump_weights
from paratrain.errors import CheckpointError, ConfigError, NonFiniteStop, Preempted, UserCodeError
from paratrain.evaluation import build_evaluator, check_evaluation
from paratrain.gradients import clip_grad_norm
from paratrain.launch import faults
from paratrain.launch.preemption import StopSignals, announce_stop
from paratrain.launch.process_group import (
    DistContext,
    destroy_distributed,
    init_distributed,
    local_world_size_from_env,
    world_size_from_env,
)
from paratrain.launch.watchdog import StepWatchdog
from paratrain.layout import build_layout, tokens_per_sample
from paratrain.losses import LossFn
from paratrain.models.meta import maybe_build_on_meta
from paratrain.nonfinite import NonFiniteGuard, PendingVerdicts, step_unless_nonfinite, weights_are_finite
from paratrain.optim import build_lr_scheduler, build_optimizer
from paratrain.parallel.activation import compile_loss
from paratrain.parallel.collectives import all_reduce_sum, barrier
from paratrain.parallel.ddp import settle_buckets
from paratrain.parallel.devices import devices_computed_on
from paratrain.parallel.dims import micro_batch_size, resolve_parallel_dims
from paratrain.precision import build_mixed_precision
from paratrain.tracking.metrics import MetricsLogger, NoMetrics
from paratrain.tracking.trackers import Outcome, RunInfo

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


@dataclass
class _LogWindow:
    """Per-step values kept on device between log steps, so steps in between never synchronise."""

    loss_sum: torch.Tensor
    steps: int = 0
    started: float = 0.0
    data_wait: float = 0.0  # seconds this rank waited for the loader's next batch


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
        self.config = config
        dims = resolve_parallel_dims(
            config.parallel, world_size=world_size_from_env(), local_world_size=local_world_size_from_env()
        )
        check_evaluation(config.eval, dims, has_dataset=eval_dataset is not None)
        user_callbacks = build_callbacks(config.callbacks, callbacks)
        self.ctx: DistContext = init_distributed(
            device_kind=config.train.device,
            needs_group=dims.needs_process_group,
            timeout_s=config.parallel.collective_timeout_s,
            cpu_collectives=dims.fsdp_enabled and config.parallel.fsdp.cpu_offload,
        )
        apply_kernel_settings(self.ctx.device, deterministic=config.train.deterministic)
        self.dims = dims.with_mesh(self.ctx.device.type)
        logger.info("layout %s on %s", self.dims.describe_layout(), self.ctx.device)
        self.dp_rank, self.dp_size = self.dims.dp_rank, self.dims.dp
        self.precision = build_mixed_precision(config.precision, device=self.ctx.device, sharded=self.dims.is_sharded)
        self.dataset = dataset if dataset is not None else call_factory(config.data, key="data")
        self.streaming = isinstance(self.dataset, StreamedTokens)
        if self.streaming:
            check_streaming(config.data, self.dims)
        sources = SampleSources(
            "the dataset given to Trainer" if dataset is not None else f"data.factory={config.data.factory!r}",
            "the model_factory given to Trainer" if model_factory else f"model.factory={config.model.factory!r}",
            "the loss_fn given to Trainer" if loss_fn else f"loss.factory={config.loss.factory!r}",
        )
        loss_fn = loss_fn or call_factory(config.loss, key="loss")
        model_factory = model_factory or (lambda: call_factory(config.model, key="model"))
        if not self.streaming:  # one sample through the model on meta: shapes and token ids, before allocating
            check_dataset_fits_model(self.dataset, maybe_build_on_meta(model_factory), loss_fn, sources=sources)
        loss_fn = compile_loss(loss_fn, compile=config.parallel.compile, backend=config.parallel.compile_backend)
        layout = build_layout(
            model_factory,
            loss_fn,
            dims=self.dims,
            ctx=self.ctx,
            precision=self.precision,
            parallel=config.parallel,
            pipeline=config.pipeline,
            train=config.train,
            sample_dataset=self.dataset,
            timeline_dir=config.run.output_dir / "pipeline",
            pretrained=Path(config.model.pretrained) if config.model.pretrained else None,
        )
        self.bare_model, self.model, self.engine = layout.bare, layout.runnable, layout.engine
        self.devices = devices_computed_on(self.model, own=self.ctx.device)  # several under dp, model_parallel
        if config.debug.dump_initial_weights:
            path = config.run.output_dir / "initial-weights.safetensors"
            dump_weights(self.bare_model, path, is_main=self.ctx.is_main, pipeline_group=self._pipeline_group())
        # Data-parallel ranks draw different random numbers (e.g. dropout masks); tensor-parallel
        # ranks of one replica must draw the same, since they compute on the same activations.
        torch.manual_seed(config.train.seed + self.dp_rank)
        self.optimizer = build_optimizer(self.bare_model, config.optim, dp_size=self.dp_size)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.optim, max_steps=config.train.max_steps)
        self.micro_batch_size = micro_batch_size(config.train, config.pipeline, dims=self.dims)
        self.sampler = None if self.streaming else self._build_sampler()
        self.tokens_per_sample = self.dataset.block_size if self.streaming else tokens_per_sample(self.dataset)
        # A stream's position is its own (files, documents, tokens carried); a map-style dataset's is the sampler's.
        self.progress, self.position = Progress(), self.dataset.position if self.streaming else DataPosition()
        self.nonfinite = NonFiniteGuard(config.train.nonfinite, config.train.nonfinite_max_skips)
        self.verdicts = PendingVerdicts(self.nonfinite)  # read one step late (see paratrain.nonfinite)
        self.last_healthy_checkpoint: Path | None = None  # what a stop on non-finite values names
        self.evaluator = build_evaluator(
            config.eval,
            eval_dataset,
            loss_fn,
            model=self.model,
            device=self.engine.device,
            autocast=self.precision.autocast,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            group=self.dims.batch_mesh.get_group() if self.dims.mesh is not None else None,
            train=config.train,
        )
        self.callbacks = CallbackList(
            [
                *maybe_profiler(
                    config.profile,
                    directory=config.run.output_dir / "profile",
                    rank=self.ctx.rank,
                    device=self.ctx.device,
                ),
                *user_callbacks,
            ],
            self,
        )
        self.checkpointer = self._build_checkpointer()
        # Chosen and checked now, so a changed config is refused before anything runs; loaded by train().
        self._resume_from = self._choose_resume()
        self._started = False
        self._stepped = False  # whether this run has taken a step (see _first_step_or_next)

    def train(self) -> TrainResult:
        """Runs from the current step to ``train.max_steps`` (or until a callback stops it), evaluating,
        logging and checkpointing on the way."""
        self._maybe_start()
        metrics, batches = self._open_metrics(), self.step_batches()
        window, last_loss, last_checkpoint = self._new_window(), None, None
        self._say_if_nothing_to_train()
        stop = StopSignals.install(self.ctx.device)
        watchdog = StepWatchdog(
            self.config.debug.step_timeout_s,
            directory=self.config.run.output_dir / "hang",
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
        )
        self.callbacks.call("on_train_start")
        outcome: Outcome = "failed"  # what the trackers record unless the loop ends otherwise
        try:
            while self.progress.step < self.config.train.max_steps:
                step = self._first_step_or_next(self._next_batch(batches, window))
                self._advance(window, step)
                self._settle_verdicts(keep_newest=True)  # the previous step's, while this one runs
                metrics.step_done()
                evaluated = self._maybe_evaluate(window)
                if self._should_log() or evaluated:  # eval_loss is logged beside the training metrics
                    self._settle_verdicts()
                    last_loss = self._log(metrics, window, step, evaluated=evaluated)
                    window = self._new_window()
                else:
                    self.callbacks.call("on_step_end")
                stop_signal = stop.agreed_signal() if self.progress.step < self.config.train.max_steps else None
                last_checkpoint = self._maybe_checkpoint(stopping=stop_signal is not None) or last_checkpoint
                faults.maybe_kill("after_step", step=self.progress.step, rank=self.ctx.rank)
                if stop_signal is not None:
                    outcome = "preempted"
                    raise self._stopped(stop_signal.name, last_checkpoint, received=stop.received_name)
                watchdog.step_done(self.progress.step)
                if self.callbacks.stop_reason:
                    logger.info("stopping early after step %d: %s", self.progress.step, self.callbacks.stop_reason)
                    break
            self._settle_verdicts()
            self.checkpointer.wait()  # an asynchronous save still in flight is complete before train() returns
            self.callbacks.call("on_train_end")
            outcome = "success"
        finally:
            watchdog.stop()
            stop.uninstall()
            metrics.close(outcome)
            self.engine.flush()
        return TrainResult(self.progress.step, last_loss, self.config.run.output_dir, last_checkpoint)

    def train_step(self, micro_batches: list[Any]) -> StepOutput:
        """One optimizer step over a global batch."""
        faults.maybe_stall("stall_in_step", step=self.progress.step + 1, rank=self.ctx.rank)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.engine.forward_backward(micro_batches)
        self.precision.unscale_(self.optimizer)
        faults.maybe_poison_gradients("nan_grad", self.bare_model, step=self.progress.step + 1, rank=self.ctx.rank)
        self._maybe_dump_gradients()
        grad_norm = self._clip_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        return StepOutput(loss, grad_norm, lr, self._step_optimizer(grad_norm))

    def _step_optimizer(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """Applies the step unless its gradients are not finite; returns that verdict, on the device. The
        schedule follows the step count (as with fp16's scaler), so a skipped step uses up its learning rate."""
        if self.precision.scaler is not None:
            # fp16's scaler skips overflowed steps itself (and shrinks its scale): expected, not counted.
            self.precision.step(self.optimizer)
            finite = torch.ones((), dtype=torch.bool, device=grad_norm.device)
        else:
            finite = step_unless_nonfinite(self.optimizer, grad_norm)
        self.lr_scheduler.step()
        return finite

    def _settle_verdicts(self, *, keep_newest: bool = False) -> None:
        """Reads the guard's pending verdicts (see PendingVerdicts); raises if the run must stop."""
        stop_at = self.verdicts.settle(keep_newest=keep_newest)
        if stop_at is not None:
            raise self._diverged(self.nonfinite.reason(), step=stop_at)

    def close(self) -> None:
        """Releases the layout, then the process group if this Trainer created it. Call once training is over."""
        self.checkpointer.close()  # a background save needs the process group until it is written
        # DDP's reducer must be freed while the group is still registered: a reducer that outlives
        # it destroys the gloo group while holding the GIL, and gloo's worker threads, which need the
        # GIL to free tensors, then deadlock with it (pytorch#56297).
        self.model = self.engine = None
        gc.collect()
        if self.ctx.owns_group:
            destroy_distributed()

    def checkpoint_state(self) -> dict[str, Any]:
        """Every Stateful that a resume needs, under the names checkpoints store them by."""
        state = {
            "model": ModelState(self.bare_model),
            "optimizer": OptimizerState(self.bare_model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "data": self.position,
            "progress": self.progress,
            "rng": RNGState(self.ctx.rank, self.devices),
        }
        if self.precision.scaler is not None:
            state["grad_scaler"] = self.precision.scaler
        return state

    def _maybe_dump_gradients(self) -> None:
        step = self.progress.step + 1  # the step being taken
        if step in self.config.debug.dump_gradients_at_steps:
            path = self.config.run.output_dir / "gradients" / f"step-{step}.safetensors"
            dump_gradients(self.bare_model, path, is_main=self.ctx.is_main, pipeline_group=self._pipeline_group())

    def _clip_gradients(self) -> torch.Tensor:
        # Pipeline ranks hold different parameters: their squared norms add up to the global one.
        return clip_grad_norm(
            list(self.bare_model.parameters()), self.config.train.grad_clip, sum_over=self._pipeline_group()
        )

    def _pipeline_group(self) -> torch.distributed.ProcessGroup | None:
        """The ranks holding the other stages of this rank's model, or None without a pipeline."""
        return self.dims.pp_mesh.get_group() if self.dims.pp_enabled else None

    def _build_sampler(self) -> GlobalBatchSampler:
        return build_sampler(
            len(self.dataset),
            self.config.data,
            global_batch_size=self.config.train.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            seed=self.config.train.seed,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )

    def step_batches(self) -> Iterator[list[Any]]:
        """This rank's micro-batches, one list per optimizer step, from the current data position."""
        if self.streaming:
            return StreamBatches(
                self.dataset,
                global_batch_size=self.config.train.global_batch_size,
                micro_batch_size=self.micro_batch_size,
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
            )
        return StepBatches(
            self.dataset,
            self.sampler,
            start=self.position,
            num_workers=self.config.data.num_workers,
            pin_memory=self.ctx.device.type == "cuda",
            prefetch_factor=self.config.data.prefetch_factor,
            persistent_workers=self.config.data.persistent_workers,
        )

    def _next_batch(self, batches: Iterator[list[Any]], window: _LogWindow) -> list[Any]:
        waited = time.perf_counter()
        micro_batches = next(batches)
        window.data_wait += time.perf_counter() - waited
        return micro_batches

    def _advance(self, window: _LogWindow, step: StepOutput) -> None:
        self.progress.step += 1
        if not self.streaming:  # a stream moved its position as it was read; a skipped step's batch is not retried
            self.position.advance(self.sampler.batches_per_epoch)
        window.steps += 1
        finite = step.finite.to(step.loss.device)
        window.loss_sum += torch.where(finite, step.loss, 0.0)
        self.verdicts.add(self.progress.step, step.finite)

    def _say_if_nothing_to_train(self) -> None:
        if self.progress.step >= self.config.train.max_steps:
            logger.info(
                "already at step %d of train.max_steps=%d: nothing to train",
                self.progress.step,
                self.config.train.max_steps,
            )

    def _should_log(self) -> bool:
        # The first step is always logged: it shows the job is running and when training began.
        step = self.progress.step
        return step % self.config.log.every_steps == 0 or step in (1, self.config.train.max_steps)

    def _maybe_evaluate(self, window: _LogWindow) -> dict[str, float]:
        """{eval_loss, eval_time_s} on evaluation steps, else {}."""
        if self.evaluator is None or not self.evaluator.is_due(self.progress.step):
            return {}
        started = time.perf_counter()
        eval_loss = self.evaluator.evaluate()
        eval_time = time.perf_counter() - started
        window.started += eval_time  # step time and throughput measure training alone
        self.callbacks.call("on_evaluation", eval_loss=eval_loss)
        return {"eval_loss": eval_loss, "eval_time_s": eval_time}

    def _new_window(self) -> _LogWindow:
        return _LogWindow(torch.zeros((), device=self.ctx.device), started=time.perf_counter())

    def _log(
        self, metrics: MetricsLogger, window: _LogWindow, step: StepOutput, *, evaluated: dict[str, float]
    ) -> float:
        # Only ranks holding the last pipeline stage have a loss (all ranks, without a pipeline); the
        # others add zero. The reduction also waits for the window's work, for the step time.
        # Skipped steps' losses are left out of loss_sum; every verdict is settled before a log step.
        applied = window.steps - self.nonfinite.skipped_after(self.progress.step - window.steps)
        loss = window.loss_sum / max(applied, 1)
        if self.dims.mesh is not None:
            loss = all_reduce_sum(loss, group=self.dims.loss_mesh.get_group()) / self.dims.dp
        loss = loss.item() if applied else float("nan")
        step_time = (time.perf_counter() - window.started) / window.steps
        samples_per_s = self.config.train.global_batch_size / step_time
        record = {
            "step": self.progress.step,
            "loss": loss,
            "lr": step.lr,
            "grad_norm": step.grad_norm.item(),
            "step_time_s": step_time,
            "samples_per_s": samples_per_s,
            # Rank 0's share of the step spent waiting for data: the loader keeps up when it is near 0.
            "data_wait_fraction": window.data_wait / (step_time * window.steps),
            "epoch": self.position.epoch,
            "world_size": self.ctx.world_size,
            "time": time.time(),
        }
        if self.nonfinite.skipped_steps:
            record["skipped_steps"] = len(self.nonfinite.skipped_steps)  # over the run, not the window
        if self.tokens_per_sample:
            record["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        record.update(evaluated)
        self.callbacks.call("on_step_end", record=record)  # callbacks may add fields to what is logged
        if self.ctx.is_main:
            metrics.log(record)
        return loss

    def _maybe_checkpoint(self, *, stopping: bool = False) -> Path | None:
        step, options = self.progress.step, self.config.checkpoint
        last = step == self.config.train.max_steps or self.callbacks.stop_reason is not None
        periodic = options.every_steps and step % options.every_steps == 0
        if not (periodic or (options.save_final and last) or stopping):
            return None
        self._settle_verdicts()  # under stop, a step with non-finite gradients ends the run before any save
        if not weights_are_finite(self.bare_model):
            raise self._diverged(f"the weights are not finite, so checkpoint step-{step} was not written", step=step)
        # The last save of a run is written before going on: the process is about to exit.
        blocking = not options.async_save or stopping or last
        path = self.checkpointer.save(step, self.checkpoint_state(), blocking=blocking, weights_finite=True)
        self.last_healthy_checkpoint = path
        logger.info("saved checkpoint %s" if blocking else "saving checkpoint %s in the background", path)
        self.callbacks.call("on_checkpoint_saved", checkpoint=path)
        return path

    def _maybe_start(self) -> None:
        """What a run does once, when training starts: its output directory, then the resume."""
        if self._started:
            return
        self._started = True
        self._prepare_output_dir()
        if self._resume_from is not None:
            self._resume(self._resume_from)

    def _choose_resume(self) -> Path | None:
        path = self.checkpointer.choose_resume(self.config.checkpoint.resume)
        if path is None:
            return None
        # Refused on every rank (a changed config would train neither run); listed by rank 0.
        changes = check_resume_config(
            read_manifest(path).get("config", {}),
            self.config.model_dump(mode="json"),
            checkpoint=path,
            allow_change=self.config.checkpoint.allow_config_change,
        )
        if self.ctx.is_main:
            log_resume_changes(changes, path)
        return path

    def _first_step_or_next(self, batch: Any) -> Any:
        """A step; the run's first is where the user's forward and loss meet real data first, so what it
        raises is reported as their code's error (the user's frames, exit code 2), not a traceback."""
        if self._stepped:
            return self.train_step(batch)
        try:
            step = self.train_step(batch)
        except (ConfigError, CheckpointError, UserCodeError, NonFiniteStop):
            raise
        except Exception as error:
            where = (
                f"the first training step (the model's forward, the loss or backward) at step {self.progress.step + 1}"
            )
            raise UserCodeError(describe_user_error(where, error)) from error
        self._stepped = True
        return step

    def load_checkpoint(self, path: Path) -> None:
        """Loads a checkpoint's model and optimizer state into this layout, as a resume does, without
        training or writing anything (``paratrain checkpoint check``)."""
        self.checkpointer.load(path, self.checkpoint_state(), optional=("rng", "grad_scaler"))

    def _resume(self, path: Path) -> None:
        # A run switched to fp16 resumes a checkpoint without a gradient scaler: its scaler starts fresh.
        self.load_checkpoint(path)
        logger.info("resumed from %s at step %d (epoch %d)", path, self.progress.step, self.position.epoch)
        self.last_healthy_checkpoint = path
        # Any samples do: only the order in which gradients become ready matters (see settle_buckets).
        if self.streaming:
            samples = self.dataset.peek(self.micro_batch_size)
        else:
            samples = [self.dataset[i] for i in range(self.micro_batch_size)]
        # A pipeline's schedule needs a whole step's micro-batches; one does elsewhere.
        step_micro_batches = self.config.train.global_batch_size // (self.micro_batch_size * self.dp_size)
        count = step_micro_batches if self.dims.pp > 1 else 1
        micro_batch = default_collate(samples)
        settle_buckets(self.model, lambda: self.engine.forward_backward([micro_batch] * count), device=self.ctx.device)

    def _build_checkpointer(self) -> Checkpointer:
        return Checkpointer(
            self.config.run.output_dir / "checkpoints",
            keep_last=self.config.checkpoint.keep_last,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            config=self.config.model_dump(mode="json"),
            async_save=self.config.checkpoint.async_save,
            device=self.ctx.device,
        )

    def _prepare_output_dir(self) -> None:
        if self.ctx.is_main:
            self.config.run.output_dir.mkdir(parents=True, exist_ok=True)
            (self.config.run.output_dir / "config.yaml").write_text(config_to_yaml(self.config))

    def _open_metrics(self) -> MetricsLogger | NoMetrics:
        if not self.ctx.is_main:
            return NoMetrics()
        run = RunInfo(
            name=self.config.run.name,
            output_dir=self.config.run.output_dir,
            hparams=self.config.model_dump(mode="json"),
        )
        return MetricsLogger(
            run,
            trackers=self.config.log.tracker_names(),
            progress_bar=self.config.log.progress_bar,
            start_step=self.progress.step,
            max_steps=self.config.train.max_steps,
        )

    def _stopped(self, signal_name: str, checkpoint: Path, *, received: str | None) -> Preempted:
        """Announces an agreed stop (its checkpoint is complete) and returns the exception to end with."""
        if received:
            logger.warning("rank %d received %s", self.ctx.rank, received)
        logger.info("stopping at step %d on %s: checkpoint %s is complete", self.progress.step, signal_name, checkpoint)
        stopped = Preempted(step=self.progress.step, checkpoint=checkpoint, signal_name=signal_name)
        # Said before announcing: once the launcher knows, it may stop this process with the group, and
        # a message left for after the exception had reached the caller was lost in about 1 run in 6.
        logger.info("%s", stopped)
        announce_stop(local_rank=self.ctx.local_rank)
        return stopped

    def _diverged(self, reason: str, *, step: int) -> NonFiniteStop:
        """The exception every rank ends with when gradients or weights are not finite (the verdict is the
        same on every rank). An asynchronous save still in flight is finished first: its weights were
        checked before it began."""
        self.checkpointer.wait()
        stopped = NonFiniteStop(step=step, reason=reason, checkpoint=self.last_healthy_checkpoint)
        # Said here, and every rank waits for it: the first rank to exit makes the launcher stop the others,
        # and rank 0 could be stopped before printing a message left for after the exception.
        logger.info("error: %s", stopped)
        barrier()
        return stopped

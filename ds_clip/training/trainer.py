"""The training loop. ``Trainer.__init__`` builds a run from settings; ``Trainer.train`` is the loop: take a
batch, train one step (``ds_clip.step``), then let each component act on its own cadence: the step meter
logs (``metrics.StepMeter``), the checkpointer saves (``checkpoint.Checkpointer``), the evaluator evaluates
(``evaluate.Evaluator``), the skip policy counts skipped updates, the stop request saves and exits.

Shape of a run: settings -> resolved DeepSpeed JSON -> model, data -> engine and step
(``ds_clip.training.wiring``, the wiring the equivalence harness and the benchmarks share) -> resume -> loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds_clip import checkpoint, distributed, evaluate
from ds_clip.checkpoint import Checkpointer
from ds_clip.checkpoint.layout import param_shapes
from ds_clip.checkpoint.save import check_output_space, check_shared_run_folder, check_writable
from ds_clip.config import (
    DEFAULT_SYNTHETIC_SAMPLES,
    DataSettings,
    LoggingSettings,
    ModelSettings,
    TrainSettings,
    settings_to_dict,
)
from ds_clip.data import StepBatch, build_train_data
from ds_clip.distributed import DistInfo, init_distributed
from ds_clip.ds_config.presets import precision_mapping_text, preset_label
from ds_clip.ds_config.resolve import derived_k_text, json_schedule_warning, write_run_files
from ds_clip.errors import RunError
from ds_clip.evaluate import Evaluator
from ds_clip.export.model_card import COMMAND_FILE, launch_command
from ds_clip.models import weights
from ds_clip.models.model import ModelBundle, check_tokenizer_fits
from ds_clip.step import ema
from ds_clip.step.cached import StepResult
from ds_clip.training import faults, remote
from ds_clip.training.engine import build_model_bundle, resolve_run
from ds_clip.training.metrics import MetricsWriter, StepMeter
from ds_clip.training.preemption import StopRequest
from ds_clip.training.schedule import RunLength, warmup_warning
from ds_clip.training.wiring import build_step
from ds_clip.versions import versions_line

logger = logging.getLogger("ds_clip")


class NonFiniteError(RunError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient."""


@dataclass
class TrainSummary:
    steps: int
    """Applied optimizer updates (what --max-steps counts)."""
    samples_seen: int
    """Pairs trained by applied updates: steps * N."""
    final_loss: float
    run_dir: Path
    skipped_steps: int = 0
    """Batches whose update was skipped (non-finite on some rank, or an fp16 overflow)."""


def _broadcast_name(name: str, info: DistInfo) -> str:
    # Every rank parses its own timestamped default name; rank 0's wins so all write one folder.
    return distributed.broadcast_object(name) if info.world_size > 1 else name


class SkipPolicy:
    """Owns ``--max-skipped-steps``: counts skipped updates, says why on rank 0, stops a run that keeps
    skipping (exit 1, nothing saved for the skipped steps: the last complete checkpoint stays the last)."""

    def __init__(self, *, max_in_a_row: int, run_dir: Path, is_main: bool) -> None:
        self.max_in_a_row, self.run_dir, self.is_main = max_in_a_row, run_dir, is_main
        self.in_a_row = self.total = 0

    def record(self, result: StepResult, step: int) -> None:
        """``step``: applied updates so far (the skipped batch was to train update step + 1)."""
        if not result.skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.is_main:
            reason = (
                "fp16 loss-scale overflow (DeepSpeed lowers the scale)"
                if result.overflow
                else "non-finite loss or gradient on at least one rank"
            )
            logger.warning(
                "step %d: %s: update skipped on every rank (%d in a row, %d in total); the next batch trains "
                "step %d",
                step + 1, reason, self.in_a_row, self.total, step + 1,
            )  # fmt: skip
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(
                f"{self.in_a_row} consecutive optimizer steps had a non-finite loss or gradient "
                f"(--max-skipped-steps {self.max_in_a_row}); stopped without saving them. The last complete "
                f"checkpoint is kept in {self.run_dir / 'checkpoints'}: lower --lr or check the data, then "
                "relaunch with --resume latest"
            )


class Trainer:
    """One training run. Every rank builds one and calls ``train()``."""

    _remote_missing: str | None = None
    """What the last remote sync left out (``_close_remote``); None when it all went up or there is no remote."""

    before_step: Callable[[list, int, int], list] | None = None
    """Hook called with (micro-batches, attempt, rank) before each step; returns the micro-batches to train.
    None in a normal run: ``faults.install`` sets it at start when DS_CLIP_INJECT_FAULT is set."""

    def __init__(self, s: TrainSettings) -> None:
        self.s = s
        self.info = info = init_distributed(timeout_s=s.dist.dist_timeout)
        # Before anything is built: an unusable output folder is a one-line error, not a crash at save time, and
        # so is a bad evaluation input, not a failure after the last step. Each rank reads them on its own host;
        # the ranks agree on what they found, so it reads once per job (distributed.agreed).
        distributed.agreed(lambda: check_writable(Path(s.logging.logs)))
        distributed.agreed(lambda: evaluate.check_train_inputs(s))
        # Resolved once, here, and handed down: the batch geometry and the DeepSpeed side of the run.
        self.geometry, self.ds = geometry, ds = resolve_run(s, info.world_size)
        ds.refuse_blocked()  # what this machine cannot run (fp16 on a CPU without it...): before building anything
        self.run_dir = run_dir = self._open_run_folder()
        _configure_logging(s.logging, info)
        self._log_precision()
        # Before the model and the engine: an unusable remote, or a checkpoint whose bytes changed since its
        # save, is one line (exit 2); a newer checkpoint on the remote is pulled for --resume latest.
        self.remote_sync = remote.start_sync(s.checkpoint, run_dir)
        # Where the weights come from (ds_clip.models.weights), decided once for every rank: a checkpoint to continue
        # from, or the model's published/local weights (also for --resume latest with nothing saved yet).
        self.start = start = weights.agree_start(run_dir, s.checkpoint.resume, is_main=info.is_main)
        if start.checkpoint is not None:
            checkpoint.verify(start.checkpoint, start.flag)
        if info.is_main:
            logger.info("%s", start.describe(s.model))

        self.bundle = bundle = build_model_bundle(
            s.model,
            seed=s.data.seed,
            local_rank=info.local_rank,
            load_published=start.loads_published,
            loss=s.loss,
        )
        check_tokenizer_fits(bundle.model, bundle.tokenizer, s.model.model)  # the data is tokenized by it
        # The parameter shapes are checked against a checkpoint before DeepSpeed loads it.
        shapes = param_shapes(bundle.model)
        check_output_space(run_dir, sum(p.numel() for p in bundle.model.parameters()), s.dist.precision)
        # The training data's checks (columns, separator, image paths, rows or shards for this geometry), agreed
        # on by the ranks as the checks above.
        self.data = distributed.agreed(
            lambda: build_train_data(
                data_section(s.data, _image_px(bundle)),
                preprocess=bundle.preprocess_train,
                tokenizer=bundle.tokenizer,
                rank=info.rank,
                geometry=geometry,
                locca_tasks=s.loss.siglip2,
            )
        )
        steps_per_epoch = self.data.steps_per_epoch
        self.length = RunLength.of(s.optim, steps_per_epoch)
        self.total_steps = self.length.total_steps
        # The engine, loss and weight EMA (--ema-decay, beside the fp32 masters; saved with and resumed from every
        # checkpoint), and the step that trains them: the one wiring the harness and the benchmarks use too.
        self.run_step = build_step(
            s, bundle, geometry, ds, rank=info.rank, total_steps=self.total_steps, steps_per_epoch=steps_per_epoch,
            image_normalize=self.data.image_normalize,
        )  # fmt: skip
        self.engine, self.ema = self.run_step.engine, self.run_step.ema
        resuming = bool(s.checkpoint.resume)
        # The "auto" keys filled from the model and the run's length (a resume writes them once it knows it trains).
        if info.is_main and ds.start_keys and not resuming:
            write_run_files(run_dir, settings_to_dict(s), ds, self.run_step.built.ds_config)

        self.checkpointer = Checkpointer(
            self.engine, run_dir, self.data, s.checkpoint, geometry=geometry, settings=settings_to_dict(s),
            meta=_checkpoint_meta(s.model, s.dist.precision, bundle), steps_per_epoch=steps_per_epoch,
            parts=[p for p in (self.ema, self.run_step.built.siglip2 and self.run_step.built.siglip2.teacher) if p],
        )  # fmt: skip
        self.evaluator = self._build_evaluator(_image_px(bundle))
        self.start_step = (
            self.checkpointer.resume(
                start.resume, shapes=shapes, is_main=info.is_main, agreed=start.checkpoint
            )
            if start.checkpoint is not None
            else 0
        )
        if info.is_main and resuming and self.start_step < self.total_steps:
            self._record_launch(self.run_step.built.ds_config if ds.start_keys else None)
        resumed = self.checkpointer.resumed_from
        if self.ema is None and resumed is not None and ema.rank_files(resumed) and info.is_main:
            logger.warning("%s holds a weight EMA; this run has no --ema-decay and does not keep it", resumed)
        self.meter = StepMeter(
            every_n_steps=s.logging.log_every_n_steps, total_steps=self.total_steps, geometry=geometry
        )
        self.skips = SkipPolicy(max_in_a_row=s.optim.max_skipped_steps, run_dir=run_dir, is_main=info.is_main)
        self._log_plan()

    def _open_run_folder(self) -> Path:
        """The run folder <logs>/<name> (rank 0's name on every rank); rank 0 writes the run files into it."""
        lg, info = self.s.logging, self.info
        lg.name = _broadcast_name(lg.name, info)
        run_dir = Path(lg.logs) / lg.name
        refusal = None
        if info.is_main and not self.s.checkpoint.resume:
            try:
                checkpoint.check_fresh_run_folder(run_dir, lg.name)
            except checkpoint.RunFolderError as exc:
                refusal = str(exc)
        # Rank 0's verdict on every rank (the folder may be on rank 0's disk only): all refuse together.
        if info.world_size > 1:
            refusal = distributed.broadcast_object(refusal)
        if refusal is not None:
            raise checkpoint.RunFolderError(refusal)
        if info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            if not self.s.checkpoint.resume:  # a resume records its launch once it knows it trains
                self._record_launch(None)
        # Every node sees the folder rank 0 made, or the run stops here (a node-local --logs on several nodes).
        check_shared_run_folder(run_dir, Path(lg.logs), local_rank=info.local_rank)
        return run_dir

    def _record_launch(self, engine_config: dict[str, Any] | None) -> None:
        """Rank 0: settings.json and ds_config.json (``engine_config``: the engine's, its start "auto" keys
        filled), and this launch's command line in command.txt for the model card of an export. A resume writes
        them only when it trains: a re-queued finished run leaves them as the run that trained wrote them."""
        run_dir = Path(self.s.logging.logs) / self.s.logging.name
        write_run_files(run_dir, settings_to_dict(self.s), self.ds, engine_config)
        # Each launch's command line and the W, k, m it trains with, for the model card of an export (a resume
        # adds its own line, on its own rank count).
        with (run_dir / COMMAND_FILE).open("a") as f:
            f.write(launch_command(sys.argv[1:], self.geometry) + "\n")

    def _log_precision(self) -> None:
        if self.info.is_main:
            logger.info("versions: %s", versions_line())  # once per start: what a bug report needs first
            logger.info(
                "--precision: DeepSpeed %s here (%s)", self.s.dist.precision, precision_mapping_text()
            )

    def _log_plan(self) -> None:
        info = self.info
        if not info.is_main:
            return
        if info.hosts is not None:
            logger.info("%s", info.hosts.describe())
        derived = derived_k_text(self.s, info.world_size)
        logger.info(
            "%s%s; %s; run folder %s", self.geometry.describe(), derived, self.length.describe(), self.run_dir
        )
        cfg = self.run_step.built.ds_config  # its "auto" keys filled: the schedule DeepSpeed runs
        warning = (
            json_schedule_warning(cfg, preset_label(self.ds.preset), self.total_steps)
            if "scheduler" in cfg
            else warmup_warning(self.s.optim, self.total_steps)
        )
        if warning:
            logger.warning("%s", warning)
        if self.ema is not None:
            logger.info("%s", self.ema.describe())
        if self.run_step.built.siglip2 is not None:
            logger.info("%s", self.run_step.built.siglip2.describe(self.s.data.dataset_type))
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restarts:
            # torchrun's elastic agent restarted the workers (a host lost or added): say what this start is.
            logger.info(
                "elastic restart %d: world size %d, continuing from step %d (the work since the last complete "
                "checkpoint is trained again)",
                restarts, info.world_size, self.start_step,
            )  # fmt: skip

    def _build_evaluator(self, image_px: int) -> Evaluator:
        ev, info = self.s.eval, self.info
        imagenet = {
            flag: folder
            for flag, folder in (("--imagenet-val", ev.imagenet_val), ("--imagenet-v2", ev.imagenet_v2))
            if folder is not None
        }
        tasks = evaluate.imagenet_tasks(imagenet, self.bundle.tokenizer)
        if ev.zeroshot_folder is not None:
            tasks.append(
                evaluate.folder_task(ev.zeroshot_folder, ev.zeroshot_classnames, ev.zeroshot_templates)
            )
        return Evaluator(
            self.engine,
            self._eval_settings(image_px),
            preprocess=self.bundle.preprocess_val,
            tokenizer=self.bundle.tokenizer,
            run_dir=self.run_dir,
            every_n_steps=ev.val_every_n_steps,
            is_main=info.is_main,
            val_every_n_epochs=ev.val_frequency,
            zeroshot_every_n_epochs=ev.zeroshot_frequency,
            steps_per_epoch=self.data.steps_per_epoch,
            zeroshot_tasks=tasks,
            batch_size=self.geometry.micro_batch_size,
            # The EMA is evaluated beside the live weights, swapped into the master partitions meanwhile.
            views={"ema/": self.ema.swapped_in} if self.ema is not None else None,
        )

    def _eval_settings(self, image_px: int) -> evaluate.EvalSettings | None:
        return evaluate.EvalSettings.from_settings(self.s, image_px)

    def _step(self, batch: StepBatch, step: int, attempt: int) -> StepResult:
        """One optimizer step (``RunStep.train``: the cached step, then open_clip's clamp)."""
        micro_batches = batch.micro_batches
        if self.before_step is not None:
            micro_batches = self.before_step(micro_batches, attempt, self.info.rank)
        return self.run_step.train(micro_batches, step=step, micro_batch_ids=batch.micro_batch_ids)

    def _log(self, step: int, epoch: int, writer: MetricsWriter | None) -> None:
        row = self.meter.row(
            step=step, epoch=epoch, skipped_samples=self._skipped_samples(), skipped_steps=self.skips.total
        )
        if writer is not None:
            writer.log(row)

    def train(self) -> TrainSummary:
        """Train (``_train``); then, with --remote-sync, a last sync that did not finish is a RunError (exit 1)
        whose one line says what is and is not on the remote; the trained run is saved locally either way."""
        summary = self._train()
        if self._remote_missing is not None:
            raise remote.RemoteIncompleteError(self._remote_missing)
        return summary

    def _close_remote(self) -> None:
        """The last sync of --remote-sync, bounded by --remote-sync-final-timeout (rank 0; no-op elsewhere)."""
        if self.remote_sync is not None:
            self._remote_missing = self.remote_sync.close(self.s.checkpoint.remote_sync_final_timeout)

    def _train(self) -> TrainSummary:
        """The loop. Counting rule (README, "Skipped steps"): ``step`` counts *applied* updates: what
        --max-steps, the LR schedule, checkpoint tags and samples_seen count. A skipped batch is consumed,
        counted by the skip policy, and the next batch trains the same update number."""
        s, info, total = self.s, self.info, self.total_steps
        step, attempt = self.start_step, 0  # attempt: batches taken by this process (fault injection)
        if step >= total:
            return self._already_finished(step)
        writer = (
            MetricsWriter(self.run_dir, s.logging.report_to, total, step, settings_to_dict(s))
            if info.is_main
            else None
        )
        tb = writer.scalar_sink() if writer is not None else None  # TensorBoard and W&B
        # Under mpirun a signalled rank's output goes to this file (mpirun no longer relays it: docs/faults.md).
        stop = StopRequest(output_on_signal=self.run_dir / f"stop-rank{info.rank}.log").install()
        self.engine.train()
        try:
            epoch, start_in_epoch = self.data.epoch, self.data.step_in_epoch
            while step < total:
                t_data = time.perf_counter()
                for batch in self.data.iter_epoch(epoch, start_in_epoch):
                    t_step = time.perf_counter()
                    result = self._step(batch, step, attempt)
                    attempt += 1
                    self.meter.record(
                        result, data_time=t_step - t_data, step_time=time.perf_counter() - t_step
                    )
                    self.skips.record(result, step)
                    if writer is not None:
                        writer.step_done()
                    if not result.skipped:
                        step += 1
                        # After the update was applied: a skipped one does not decay the average.
                        self.run_step.after_update(step)
                        if self.meter.should_log(step):
                            self._log(step, epoch, writer)
                        self.checkpointer.maybe_save(step, total)
                        self.evaluator.maybe_run(step, total, tb)
                    if step >= total:
                        break
                    if stop.agreed_stop():  # every rank, every step: they all save the same step together
                        return self._stop(step, stop)
                    t_data = time.perf_counter()
                else:
                    epoch, start_in_epoch = epoch + 1, 0
                    continue
                break
            # The final checkpoint first: whatever the final evaluation meets, the trained run is saved.
            self.checkpointer.save(step)
            self.evaluator.run(step, tb)
        finally:
            stop.uninstall()
            if writer is not None:
                writer.close()
            self._close_remote()
        summary = self._summary(step)
        bad_samples = self._skipped_samples()  # a collective: every rank gets here
        if info.is_main:
            logger.info(
                "done: %d steps, %d samples, %d skipped steps (non-finite updates), %d skipped samples (bad data), "
                "final loss %.4f, run folder %s",
                step, summary.samples_seen, summary.skipped_steps, bad_samples, summary.final_loss, self.run_dir,
            )  # fmt: skip
        return summary

    def _skipped_samples(self) -> int:
        """Bad samples the loaders of all ranks skipped so far (a collective: every rank calls it)."""
        return int(distributed.all_reduce_sum(torch.tensor(float(self.data.skipped_samples()))))

    def _already_finished(self, step: int) -> TrainSummary:
        """A finished run launched again (a re-queued job's --resume latest): nothing to train, nothing saved;
        its checkpoints stay as they are. A final evaluation that did not finish (the time limit hit it, after
        the final save) runs now: its metrics are the run's last word."""
        evaluate_now = not self.evaluator.has_results(step)  # every rank: rank 0 reads, all agree
        if self.info.is_main:
            logger.info(
                "the run already finished at step %d (%d steps in total); nothing trained, nothing saved%s: %s",
                step, self.total_steps,
                "; its final evaluation did not finish: evaluating now" if evaluate_now else "",
                self.checkpointer.resumed_from,
            )  # fmt: skip
        try:
            if evaluate_now:
                self.evaluator.run(step)
        finally:
            self._close_remote()
        return self._summary(step)

    def _stop(self, step: int, stop: StopRequest) -> TrainSummary:
        """Every rank: save ``step`` and end the run (a signal, or the launcher gone; docs/faults.md)."""
        if self.info.is_main:
            again = f"; {stop.reason} again stops at once" if stop.reason in ("SIGINT", "SIGTERM") else ""
            logger.info(
                "%s: stopping after step %d, saving a checkpoint%s (the last complete checkpoint stays usable)",
                stop.describe(), step, again,
            )  # fmt: skip
        self.checkpointer.save(step)
        if self.info.is_main:
            logger.info(
                "%s: saved checkpoint %s at step %d; resume with the same command plus --resume latest --name %s",
                stop.describe(), checkpoint.tag_for(step), step, self.s.logging.name,
            )  # fmt: skip
        return self._summary(step)

    def _summary(self, step: int) -> TrainSummary:
        return TrainSummary(
            step, step * self.geometry.global_batch, self.meter.final_loss(), self.run_dir, self.skips.total
        )


def _configure_logging(lg: LoggingSettings, info: DistInfo) -> None:
    """Rank 0 logs; --log-local: every node's local rank 0 too (open_clip's local masters); --debug: DEBUG."""
    # open_clip logs its model-building steps at INFO on the root logger: keep those quiet.
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank{info.rank}] %(levelname)s %(name)s: %(message)s"
    )
    logs_here = info.is_main or (lg.log_local and info.local_rank == 0)
    level = logging.DEBUG if lg.debug else logging.INFO
    logging.getLogger("ds_clip").setLevel(level if logs_here else logging.WARNING)


def _image_px(bundle: ModelBundle) -> int:
    image_size = bundle.model_cfg["vision_cfg"].get("image_size", 224)
    return image_size if isinstance(image_size, int) else image_size[0]  # open_clip allows (h, w)


def data_section(d: DataSettings, image_px: int) -> DataSettings:
    """The data section with the defaults only the model and the data type decide."""
    synthetic = d.dataset_type == "synthetic"
    return dataclasses.replace(
        d,
        train_num_samples=d.train_num_samples or (DEFAULT_SYNTHETIC_SAMPLES if synthetic else None),
        synthetic_image_size=d.synthetic_image_size or image_px,
    )


def _checkpoint_meta(m: ModelSettings, precision: str, bundle: ModelBundle) -> dict[str, Any]:
    """What each checkpoint records besides the batch geometry: enough to export or rebuild the model."""
    import open_clip

    return {
        "precision": precision,
        "model": m.model,
        "model_cfg": bundle.model_cfg,
        "preprocess_cfg": open_clip.get_model_preprocess_cfg(bundle.model),
    }


def train(s: TrainSettings) -> TrainSummary:
    """Build a run from ``s`` and train it (what ``ds-clip-train`` does)."""
    trainer = Trainer(s)
    faults.install(trainer)  # the fault hooks (step, evaluation, save), only when DS_CLIP_INJECT_FAULT is set
    return trainer.train()

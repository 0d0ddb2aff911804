"""The trainer's evaluator: when to evaluate and what (its cadence), on the engine; an evaluation that fails
costs the evaluation, not the run."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from ds_clip import distributed
from ds_clip.checkpoint import epochs_done_at, on_cadence
from ds_clip.evaluate.reporting import RESULTS_FILE, report
from ds_clip.evaluate.runner import engine_forward, run_on_engine
from ds_clip.evaluate.settings import EVAL_BATCH_SIZE, EvalFailed, EvalSettings
from ds_clip.evaluate.zeroshot import ClassFolderTask, classify_folders

logger = logging.getLogger("ds_clip")


class Evaluator:
    """When the trainer evaluates, and what: owns ``--val-every-n-steps`` and ``--val-frequency`` (epochs) for
    the --val-data evaluation, ``--zeroshot-frequency`` (epochs) for every zero-shot one (--imagenet-val,
    --imagenet-v2, --zeroshot-folder, and --zeroshot-classes, which classifies the --val-data samples: its
    cadence runs that pass too, reporting only the zero-shot metrics), and the final evaluation of everything. Every rank holds one and calls every method (each
    rank embeds its slice: a collective); rank 0 reports all metrics of a step in one row.

    An evaluation that fails (``EvalFailed``: the ranks agreed that one of them could not read its samples or
    run its forwards) is logged on rank 0 in one line and skipped; training goes on, and the other evaluations
    of that step still run."""

    before_read: Callable[[int, int], None] | None = None
    """Hook called with (step, rank) where each rank reads its --val-data samples; None in a normal run:
    ``faults.install`` sets it when DS_CLIP_INJECT_FAULT asks for an evaluation fault."""

    def __init__(
        self,
        engine,
        settings: EvalSettings | None,
        *,
        preprocess,
        tokenizer,
        run_dir: Path,
        every_n_steps: int | None,
        is_main: bool,
        val_every_n_epochs: int | None = None,
        zeroshot_every_n_epochs: int | None = None,
        steps_per_epoch: int | None = None,
        zeroshot_tasks: list[ClassFolderTask] | None = None,
        batch_size: int = EVAL_BATCH_SIZE,
        views: dict[str, Callable[[], AbstractContextManager]] | None = None,
    ) -> None:
        """``views``: other weights evaluated beside the live ones, metrics prefixed by the key (``"ema/"``);
        the value makes the engine compute with those weights inside its block (every rank enters it)."""
        self.views = views or {}
        self.engine, self.settings = engine, settings
        self.preprocess, self.tokenizer = preprocess, tokenizer
        self.run_dir, self.every_n_steps, self.is_main = Path(run_dir), every_n_steps, is_main
        self.val_every_n_epochs, self.zeroshot_every_n_epochs = val_every_n_epochs, zeroshot_every_n_epochs
        self.steps_per_epoch, self.zeroshot_tasks = steps_per_epoch, zeroshot_tasks or []
        self.batch_size = batch_size
        self.failures = 0
        """Evaluations that failed and were skipped in this run."""

    def run(self, step: int, tb_writer=None, *, val: bool = True, zeroshot: bool = True) -> None:
        metrics = self._metrics(step, val=val, zeroshot=zeroshot)
        for prefix, weights in self.views.items():
            if metrics:
                with weights():
                    view = self._metrics(step, val=val, zeroshot=zeroshot)
                metrics.update({prefix + k: v for k, v in view.items()})
        if metrics and self.is_main:
            try:
                report(self.run_dir, step, metrics, tb_writer)
            except OSError as exc:  # rank 0 alone, after every collective: the run goes on
                logger.warning("step %d: evaluation results not written (%s); training continues", step, exc)

    def has_results(self, step: int) -> bool:
        """Every rank: the final evaluation of ``step`` is recorded in eval_results.json, or there is nothing
        to evaluate. Rank 0 reads the file; every rank takes its answer (``run`` is a collective)."""
        if self.settings is None and not self.zeroshot_tasks:
            return True
        found = None
        if self.is_main:
            try:
                rows = json.loads((self.run_dir / RESULTS_FILE).read_text())
                found = any(row.get("step") == step for row in rows)
            except (OSError, ValueError):  # never written, or cut short while written
                found = False
        return bool(distributed.broadcast_object(found))

    def _metrics(self, step: int, *, val: bool, zeroshot: bool) -> dict[str, float]:
        metrics: dict[str, float] = {}
        s = self.settings
        if s is not None and (val or (zeroshot and s.zeroshot_classes)):
            # --zeroshot-classes labels the --val-data samples: its classifier runs on the zero-shot cadence (with
            # the pass over --val-data it needs), as every zero-shot source does, never on the val cadence alone.
            got = self._guarded(step, "--val-data", lambda st: self._val(st, zeroshot=zeroshot))
            metrics.update(got if val else {k: v for k, v in got.items() if k.startswith("zeroshot_")})
        if self.zeroshot_tasks and zeroshot:
            metrics.update(self._guarded(step, "zero-shot", self._zeroshot))
        return metrics

    def _guarded(self, step: int, what: str, fn: Callable[[int], dict[str, float]]) -> dict[str, float]:
        """``fn(step)``, or nothing when it failed on some rank (all ranks raised EvalFailed together)."""
        try:
            return fn(step)
        except EvalFailed as exc:
            self.failures += 1
            if self.is_main:
                logger.warning(
                    "step %d: %s evaluation failed, skipped (%s); training continues", step, what, exc
                )
            return {}

    def _val(self, step: int, *, zeroshot: bool) -> dict[str, float]:
        assert self.settings is not None
        hook = self.before_read
        settings = self.settings if zeroshot else dataclasses.replace(self.settings, zeroshot_classes=None)
        return run_on_engine(
            self.engine, settings, preprocess=self.preprocess, tokenizer=self.tokenizer,
            before_read=None if hook is None else (lambda: hook(step, distributed.rank())),
        )  # fmt: skip

    def _zeroshot(self, step: int) -> dict[str, float]:
        was_training = self.engine.module.training
        self.engine.eval()
        try:
            return classify_folders(
                engine_forward(self.engine), self.zeroshot_tasks, preprocess=self.preprocess,
                tokenizer=self.tokenizer, batch_size=self.batch_size, device=self.engine.device,
            )  # fmt: skip
        finally:
            if was_training:
                self.engine.train()

    def maybe_run(self, step: int, total_steps: int, tb_writer=None) -> None:
        """Evaluate what is on its cadence; the last step is evaluated by ``run`` at the end of the run, once."""
        if step >= total_steps:
            return
        epochs = epochs_done_at(step, self.steps_per_epoch)
        val = on_cadence(step, self.every_n_steps, epochs, self.val_every_n_epochs)
        zeroshot = on_cadence(step, None, epochs, self.zeroshot_every_n_epochs)
        if val or zeroshot:
            self.run(step, tb_writer, val=val, zeroshot=zeroshot)

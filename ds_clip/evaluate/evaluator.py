"""The trainer's evaluator: when to evaluate and what (its cadence), on the engine."""

from __future__ import annotations

from pathlib import Path

from ds_clip.checkpoint import epochs_done_at, on_cadence
from ds_clip.evaluate.report import report
from ds_clip.evaluate.runner import engine_forward, run_on_engine
from ds_clip.evaluate.settings import EVAL_BATCH_SIZE, EvalSettings
from ds_clip.evaluate.zeroshot import imagenet_zeroshot


class Evaluator:
    """When the trainer evaluates, and what: owns ``--val-every-n-steps`` and ``--val-frequency`` (epochs) for
    the --val-data evaluation, ``--zeroshot-frequency`` (epochs) for the zero-shot ones (--imagenet-val,
    --imagenet-v2, and --zeroshot-classes, which is computed with --val-data: its cadence runs that too), and
    the final evaluation of everything. Every rank holds one and calls every method (each rank embeds its
    slice: a collective); rank 0 reports all metrics of a step in one row."""

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
        imagenet: dict[str, str] | None = None,
        batch_size: int = EVAL_BATCH_SIZE,
    ) -> None:
        self.engine, self.settings = engine, settings
        self.preprocess, self.tokenizer = preprocess, tokenizer
        self.run_dir, self.every_n_steps, self.is_main = Path(run_dir), every_n_steps, is_main
        self.val_every_n_epochs, self.zeroshot_every_n_epochs = val_every_n_epochs, zeroshot_every_n_epochs
        self.steps_per_epoch, self.imagenet, self.batch_size = steps_per_epoch, imagenet or {}, batch_size

    def run(self, step: int, tb_writer=None, *, val: bool = True, zeroshot: bool = True) -> None:
        metrics: dict[str, float] = {}
        if self.settings is not None and (val or (zeroshot and self.settings.zeroshot_classes)):
            metrics.update(
                run_on_engine(
                    self.engine, self.settings, preprocess=self.preprocess, tokenizer=self.tokenizer
                )
            )
        if self.imagenet and zeroshot:
            was_training = self.engine.module.training
            self.engine.eval()
            try:
                metrics.update(
                    imagenet_zeroshot(
                        engine_forward(self.engine), self.imagenet, preprocess=self.preprocess,
                        tokenizer=self.tokenizer, batch_size=self.batch_size, device=self.engine.device,
                    )
                )  # fmt: skip
            finally:
                if was_training:
                    self.engine.train()
        if metrics and self.is_main:
            report(self.run_dir, step, metrics, tb_writer)

    def maybe_run(self, step: int, total_steps: int, tb_writer=None) -> None:
        """Evaluate what is on its cadence; the last step is evaluated by ``run`` at the end of the run, once."""
        if step >= total_steps:
            return
        epochs = epochs_done_at(step, self.steps_per_epoch)
        val = on_cadence(step, self.every_n_steps, epochs, self.val_every_n_epochs)
        zeroshot = on_cadence(step, None, epochs, self.zeroshot_every_n_epochs)
        if val or zeroshot:
            self.run(step, tb_writer, val=val, zeroshot=zeroshot)

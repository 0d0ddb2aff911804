"""The one wiring of a training step: settings -> batch geometry and DeepSpeed JSON -> model -> engine and loss
-> the step as ``ds-clip-train`` trains it. ``RunStep.train`` is that step: ``cached_step`` with the run's
per-micro-batch seeds, CoCa caption term, distillation teacher and on-device image normalisation, then
open_clip's logit-scale clamp after an applied update; ``RunStep.after_update`` keeps the weight EMA.

The trainer builds its step here (``build_step``, between its data and its checkpointer); the equivalence
harness, the benchmarks that time a step and the GPU check build theirs here too (``build_run_step``, with data
of their own), so what they prove and time is what users run. None of them calls ``cached_step`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds_clip.config import TrainSettings
from ds_clip.ds_config.resolve import ResolvedDeepSpeed
from ds_clip.geometry import BatchGeometry
from ds_clip.models.model import ModelBundle
from ds_clip.step import ema as ema_mod
from ds_clip.step.cached import StepResult, cached_step, micro_batch_seed
from ds_clip.step.checks import UntrainedOutputError
from ds_clip.step.clamp import clamp_logit_scale
from ds_clip.training.engine import BuiltEngine, build_engine, build_model_bundle, resolve_run

ImageNormalize = tuple[Sequence[float], Sequence[float]]


@dataclass
class RunStep:
    """The running parts of one rank's training: model, engine, loss, weight EMA, and the step."""

    settings: TrainSettings
    geometry: BatchGeometry
    ds: ResolvedDeepSpeed
    bundle: ModelBundle
    built: BuiltEngine
    rank: int
    ema: ema_mod.WeightEma | None = None
    """The weight EMA (--ema-decay); None without it."""
    image_normalize: ImageNormalize | None = None
    """uint8 images from the loader are normalised on the device with (mean, std); None: float images."""
    _aux_center: torch.Tensor | None = None
    """The last step's global center sums (--siglip2), for ``after_update``."""

    @property
    def engine(self) -> Any:
        return self.built.engine

    def train(
        self,
        micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        step: int = 0,
        micro_batch_ids: Sequence[int] | None = None,
    ) -> StepResult:
        """One optimizer step on this rank's k micro-batches of (images, token ids).

        ``step``: the updates applied before this one; ``micro_batch_ids``: each micro-batch's global index g
        (default: rank * k + j). Stochastic layers are seeded from (--seed, step, g), so a micro-batch draws the
        same dropout whatever the (ranks, k) split. After an applied update, open_clip's clamp of the learned
        temperature (on the working and the fp32 master copies)."""
        k = len(micro_batches)
        ids = micro_batch_ids if micro_batch_ids is not None else range(self.rank * k, self.rank * k + k)
        seeds = [micro_batch_seed(self.settings.data.seed, step, g) for g in ids]
        siglip2 = self.built.siglip2
        if siglip2 is not None:
            siglip2.begin_step(self.engine.module, step)
        try:
            result = cached_step(
                self.engine, micro_batches, self.built.loss_fn, micro_batch_seeds=seeds,
                caption=self.built.caption_fn, teacher=self.built.teacher, image_normalize=self.image_normalize,
                aux=None if siglip2 is None else siglip2.terms,
            )  # fmt: skip
        except UntrainedOutputError as exc:  # same on every rank: the first step's forward, before any update
            raise UntrainedOutputError(
                str(exc).replace("--model:", f"--model {self.settings.model.model}:", 1)
            ) from None
        if not result.skipped:
            clamp_logit_scale(self.engine)
        self._aux_center = result.aux_center
        return result

    def after_update(self, step: int) -> bool:
        """After applied update ``step`` (1-based; a skipped batch is not one): the weight EMA on its cadence.
        Returns whether the EMA was updated. --siglip2: its teacher's EMA and centers, after a self-supervised step."""
        if self.built.siglip2 is not None:
            self.built.siglip2.after_update(self.engine.module, self._aux_center)
        return self.ema is not None and self.ema.maybe_update(step)


def build_step(
    s: TrainSettings,
    bundle: ModelBundle,
    geometry: BatchGeometry,
    ds: ResolvedDeepSpeed,
    *,
    rank: int,
    total_steps: int,
    steps_per_epoch: int | None = None,
    image_normalize: ImageNormalize | None = None,
) -> RunStep:
    """The engine, loss and weight EMA for ``bundle`` (every rank calls it: ``deepspeed.initialize`` is a
    collective), and the step that trains them."""
    built = build_engine(
        bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed, rank=rank,
        total_steps=total_steps, steps_per_epoch=steps_per_epoch,
    )  # fmt: skip
    return RunStep(
        settings=s, geometry=geometry, ds=ds, bundle=bundle, built=built, rank=rank,
        ema=ema_mod.build_ema(built.engine, s.ema), image_normalize=image_normalize,
    )  # fmt: skip


def build_run_step(
    s: TrainSettings, *, world_size: int, rank: int, total_steps: int, local_rank: int | None = None
) -> RunStep:
    """Everything from the settings, for callers that bring their own data (the equivalence harness, the
    benchmarks): the batch geometry and DeepSpeed JSON for ``world_size`` ranks, the model seeded by --seed
    (published weights loaded as --pretrained says), then ``build_step``. ``total_steps``: the LR schedule's
    length."""
    geometry, ds = resolve_run(s, world_size)
    ds.refuse_blocked()
    bundle = build_model_bundle(s.model, seed=s.data.seed, local_rank=local_rank, loss=s.loss)
    return build_step(s, bundle, geometry, ds, rank=rank, total_steps=total_steps)

"""open_clip's learning-rate schedules (``--lr-scheduler``), counted in optimizer steps, as multipliers.

Each function returns the factor applied to a parameter group's own peak LR at optimizer step ``step``
(0-based), with the arithmetic of open_clip_train's ``scheduler.py`` (``cosine_lr``, ``const_lr``,
``const_lr_cooldown``) divided by the peak. ``build_scheduler`` wraps one in a ``LambdaLR``, which scales
every parameter group from its own peak (per-tower LRs, layer-wise decay): group g trains step s at
``peak_g * multiplier(s)``. DeepSpeed steps the scheduler once per optimizer step and saves its state in
every checkpoint (``last_epoch``), so a resumed run continues the schedule where it stopped.

    cosine          linear warmup, then cosine from the peak to 0 at the last step
    const           linear warmup, then the peak
    const-cooldown  linear warmup, the peak, then from step total - cooldown a polynomial decay
                    (--lr-cooldown-power; 1 = linear) towards --lr-cooldown-end
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds_clip.config import LR_SCHEDULERS as SCHEDULES
from ds_clip.config import OptimSettings


def _warmup(step: int, warmup: int) -> float:
    return (step + 1) / warmup


def cosine_with_warmup(step: int, *, warmup: int, total: int) -> float:
    """open_clip's ``cosine_lr`` / peak. Past ``total`` it stays at 0 (open_clip's would rise again)."""
    if step < warmup:
        return _warmup(step, warmup)
    decay = max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(step - warmup, decay) / decay))


def const_with_warmup(step: int, *, warmup: int) -> float:
    """open_clip's ``const_lr`` / peak."""
    return _warmup(step, warmup) if step < warmup else 1.0


def const_cooldown(
    step: int, *, warmup: int, total: int, cooldown: int, power: float = 1.0, end_ratio: float = 0.0
) -> float:
    """open_clip's ``const_lr_cooldown`` / peak: the cooldown starts at step ``total - cooldown`` and ends
    at ``end_ratio`` (``--lr-cooldown-end / --lr``) of the peak at step ``total``. Past ``total`` it stays
    at ``end_ratio``."""
    if step < warmup:
        return _warmup(step, warmup)
    start = total - cooldown
    if step < start:
        return 1.0
    span = total - start
    left = max(0.0, 1 - (step - start) / span) if span > 0 else 0.0
    return left**power * (1 - end_ratio) + end_ratio


@dataclass(frozen=True)
class Schedule:
    """One LR schedule in optimizer steps: ``multiplier(step)`` scales each group's peak LR."""

    kind: str = "cosine"
    warmup: int = 0
    total: int = 1
    cooldown: int = 0
    """const-cooldown: steps of the cooldown (--epochs-cooldown x steps per epoch)."""
    power: float = 1.0
    end_ratio: float = 0.0
    """const-cooldown: the LR it ends at, as a fraction of each group's peak (--lr-cooldown-end / --lr)."""

    def multiplier(self, step: int) -> float:
        if self.kind == "cosine":
            return cosine_with_warmup(step, warmup=self.warmup, total=self.total)
        if self.kind == "const":
            return const_with_warmup(step, warmup=self.warmup)
        if self.kind == "const-cooldown":
            return const_cooldown(
                step, warmup=self.warmup, total=self.total, cooldown=self.cooldown, power=self.power,
                end_ratio=self.end_ratio,
            )  # fmt: skip
        raise ValueError(f"unknown LR schedule {self.kind!r}; one of {', '.join(SCHEDULES)}")


@dataclass(frozen=True)
class RunLength:
    """How long a run trains: ``--epochs`` and ``--max-steps`` are two limits, and it stops at whichever comes
    first; --max-steps alone runs as many epochs as its steps take, neither flag one epoch."""

    total_steps: int
    steps_per_epoch: int
    limit: str
    """The flag (with its value) that ends the run, for the start line."""

    @classmethod
    def of(cls, o: OptimSettings, steps_per_epoch: int) -> RunLength:
        if o.max_steps is not None and o.epochs is None:
            return cls(o.max_steps, steps_per_epoch, f"--max-steps {o.max_steps}")
        epochs = o.epochs or 1
        by_epochs = epochs * steps_per_epoch
        if o.max_steps is None:
            return cls(by_epochs, steps_per_epoch, f"--epochs {epochs}")
        if o.max_steps < by_epochs:
            return cls(
                o.max_steps, steps_per_epoch, f"--max-steps {o.max_steps}, before --epochs {epochs} ends"
            )
        return cls(
            by_epochs, steps_per_epoch, f"--epochs {epochs}, before --max-steps {o.max_steps} is reached"
        )

    @property
    def epochs(self) -> float:
        return self.total_steps / self.steps_per_epoch

    def describe(self) -> str:
        """ "40 steps = 5 epochs of 8 steps (--max-steps 40)"."""
        e = self.epochs
        shown = f"{e:g}" if e == int(e) else f"{e:.2f}"
        return (
            f"{self.total_steps} steps = {shown} epoch{'' if e == 1 else 's'} of {self.steps_per_epoch} steps "
            f"({self.limit})"
        )


def warmup_warning(o: OptimSettings, total_steps: int) -> str | None:
    """What the start line warns of when --warmup is at least as long as the run (open_clip's warmup of 10000
    pasted into a short run): the LR climbs the whole run, never decays, and ends below --lr."""
    if o.skip_scheduler or o.warmup < total_steps or total_steps < 1:
        return None
    reached = _warmup(total_steps - 1, o.warmup)  # the multiplier of the last step
    return (
        f"--warmup {o.warmup} is not shorter than the run ({total_steps} steps): the learning rate rises all run "
        f"long, ends at {reached:.0%} of --lr {o.lr:g} and never decays; lower --warmup (open_clip's 10000 suits "
        "long runs)"
    )


def schedule_for(o: OptimSettings, *, total_steps: int, steps_per_epoch: int | None = None) -> Schedule:
    """The schedule the flags ask for, over ``total_steps`` optimizer steps. --epochs-cooldown is converted
    with ``steps_per_epoch`` (open_clip: batches per epoch // accum-freq); without it, the run's epochs
    define it (total_steps // --epochs), which holds whenever --max-steps is not set."""
    if o.skip_scheduler:  # open_clip without a scheduler: the peak from the first step, no warmup
        return Schedule("const", warmup=0, total=total_steps)
    cooldown = 0
    if o.lr_scheduler == "const-cooldown":
        if steps_per_epoch is None:
            if o.max_steps is not None:
                raise ValueError(
                    "const-cooldown with --max-steps: pass steps_per_epoch to convert --epochs-cooldown"
                )
            steps_per_epoch = total_steps // (o.epochs or 1)
        cooldown = steps_per_epoch * (o.epochs_cooldown or 0)
    return Schedule(
        o.lr_scheduler, warmup=o.warmup, total=total_steps, cooldown=cooldown, power=o.lr_cooldown_power,
        end_ratio=o.lr_cooldown_end / o.lr,
    )  # fmt: skip


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule):
    """A LambdaLR that DeepSpeed steps once per optimizer step (engine.step()); each parameter group goes
    from its own peak (its "lr" when the scheduler is built)."""
    # A plain function (not a bound method or callable object): LambdaLR then keeps it out of its
    # state_dict, so a checkpoint holds the step count alone and a resume follows the flags' schedule.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.multiplier(step))

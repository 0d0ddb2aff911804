"""Deterministic fault injection for the fault suite (tests/faults/), off unless asked for.

    DS_CLIP_INJECT_FAULT="nan@3:1"          rank 1 feeds NaN images in the 4th batch it trains (0-based)
    DS_CLIP_INJECT_FAULT="nan@2-:0"         rank 0 feeds NaN images from step 2 on
    DS_CLIP_INJECT_FAULT="kill@3:1"         rank 1 SIGKILLs itself at the start of step 3
    DS_CLIP_INJECT_FAULT="kill-in-save@4:1" rank 1 SIGKILLs itself while checkpoint 4 is half written
    DS_CLIP_INJECT_FAULT="eval-error@2:1"   rank 1 cannot read its --val-data samples in the evaluation
                                            at optimizer step 2 (an OSError, as from a store gone away)
    DS_CLIP_INJECT_FAULT="slow@0-:0"        rank 0 takes 1 s longer for every batch from step 0 on (a
                                            straggler: the other ranks wait for it in the step's collectives)

STEP is the 0-based index of the batch this process trains (its attempt count): equal to the optimizer
step index while nothing is skipped, and it keeps counting through skipped steps, so "nan@1:1" poisons one
batch, not every retry of update 2. Several faults are separated by commas. Real faults (a diverging run, a node lost, a preempted
job, a full disk) are slow and random; these make the same outcomes reproducible in CI.

One plan, three hooks, all set once at start by ``install(trainer)`` and only when the variable is set, so a
normal run pays one ``is None`` check per step, per evaluation read and per save: ``Trainer.before_step``
("nan", "kill", "slow"), ``Evaluator.before_read`` ("eval-error") and ``Checkpointer.save_hook``
("kill-in-save", at the save's "after_shards" point: between the rank files and the completion marker). Only the trainer's start
(``ds_clip.training.trainer.train``) imports this module.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

ENV = "DS_CLIP_INJECT_FAULT"
# How much longer a "slow" rank takes for a batch: long next to a tiny test step, short next to --dist-timeout.
SLOW_STEP_S = 1.0


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    open_ended: bool
    rank: int

    def fires(self, kind: str, step: int, rank: int) -> bool:
        return (
            self.kind == kind
            and self.rank == rank
            and (step >= self.step if self.open_ended else step == self.step)
        )


def _parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            kind, rest = item.split("@")
            step, rank = rest.split(":")
            open_ended = step.endswith("-")
            faults.append(Fault(kind, int(step.rstrip("-")), open_ended, int(rank)))
        except ValueError as exc:
            raise ValueError(f"{ENV}={text!r}: cannot read {item!r} (expected KIND@STEP[-]:RANK)") from exc
    return faults


def _kill(kind: str, step: int, rank: int) -> None:
    print(f"[fault injection] rank {rank}: SIGKILL at step {step} ({kind})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


MicroBatches = list[tuple[torch.Tensor, Any]]


class FaultPlan:
    """The faults DS_CLIP_INJECT_FAULT asks for, and the hooks that fire them where they reach a run."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    def asks(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.faults)

    def _fires(self, kind: str, step: int, rank: int) -> bool:
        return any(f.fires(kind, step, rank) for f in self.faults)

    def before_step(self, micro_batches: MicroBatches, attempt: int, rank: int) -> MicroBatches:
        """The trainer's ``before_step`` hook: kills this rank ("kill"), feeds NaN images in its first
        micro-batch ("nan") or holds it back for SLOW_STEP_S ("slow") at the chosen batches; otherwise hands the
        micro-batches on untouched. ``attempt``: the 0-based batch this process trains (STEP above)."""
        if self._fires("kill", attempt, rank):
            _kill("kill", attempt, rank)
        if self._fires("slow", attempt, rank):
            time.sleep(SLOW_STEP_S)  # the injected straggler itself, not a wait for a condition
        if self._fires("nan", attempt, rank):
            images, texts = micro_batches[0]
            dtype = images.dtype if images.is_floating_point() else torch.float32  # uint8 (--decode fast)
            return [(torch.full(images.shape, float("nan"), dtype=dtype), texts), *micro_batches[1:]]
        return micro_batches

    def before_read(self, step: int, rank: int) -> None:
        """The evaluator's ``before_read`` hook: raises OSError where rank ``rank`` reads its validation samples
        in the evaluation at optimizer step ``step`` ("eval-error"); STEP is that optimizer step."""
        if self._fires("eval-error", step, rank):
            print(f"[fault injection] rank {rank}: validation data unreadable at step {step}", flush=True)
            raise OSError(f"[fault injection] validation data unreadable at step {step}")

    def at_save(self, point: str, step: int, rank: int) -> None:
        """The checkpointer's ``save_hook``: kills this rank at the save of step ``step`` ("kill-in-save"), once
        its own files are written and before the folder is marked complete ("after_shards")."""
        if point == "after_shards" and self._fires("kill-in-save", step, rank):
            _kill("kill-in-save", step, rank)


def install(trainer: Any) -> None:
    """Set the hooks of the trainer and its components that the faults of DS_CLIP_INJECT_FAULT reach (a bad
    value fails here, at start): ``trainer.before_step`` whenever it is set, ``trainer.evaluator.before_read``
    for an evaluation fault, ``trainer.checkpointer.save_hook`` for a fault in a save; leave them None
    otherwise."""
    text = os.environ.get(ENV)
    if text:
        plan = FaultPlan(_parse(text))
        trainer.before_step = plan.before_step
        if plan.asks("eval-error"):
            trainer.evaluator.before_read = plan.before_read
        if plan.asks("kill-in-save"):
            trainer.checkpointer.save_hook = plan.at_save

"""Deterministic fault injection for the fault suite (tests/faults/), off unless asked for.

    DS_CLIP_INJECT_FAULT="nan@3:1"          rank 1 feeds NaN images in the 4th batch it trains (0-based)
    DS_CLIP_INJECT_FAULT="nan@2-:0"         rank 0 feeds NaN images from step 2 on
    DS_CLIP_INJECT_FAULT="kill@3:1"         rank 1 SIGKILLs itself at the start of step 3
    DS_CLIP_INJECT_FAULT="kill-in-save@4:1" rank 1 SIGKILLs itself while checkpoint 4 is half written
    DS_CLIP_INJECT_FAULT="eval-error@2:1"   rank 1 cannot read its --val-data samples in the evaluation
                                            at optimizer step 2 (an OSError, as from a store gone away)

STEP is the 0-based index of the batch this process trains (its attempt count): equal to the optimizer
step index while nothing is skipped, and it keeps counting through skipped steps, so "nan@1:1" poisons one
batch, not every retry of update 2. Several faults are separated by commas. Real faults (a diverging run, a node lost, a preempted
job, a full disk) are slow and random; these make the same outcomes reproducible in CI.

Off the hot path: ``install(trainer)`` runs once at start and sets the trainer's ``before_step`` hook only when
the variable is set, so a normal run pays one ``is None`` check per step. A checkpoint save asks
``maybe_kill("kill-in-save", ...)`` once per save, between the rank files and the completion marker.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

import torch

ENV = "DS_CLIP_INJECT_FAULT"


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


def active(kind: str, step: int, rank: int) -> bool:
    text = os.environ.get(ENV)
    return bool(text) and any(f.fires(kind, step, rank) for f in _parse(text))


def _kill(kind: str, step: int, rank: int) -> None:
    print(f"[fault injection] rank {rank}: SIGKILL at step {step} ({kind})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_kill(kind: str, step: int, rank: int) -> None:
    if active(kind, step, rank):
        _kill(kind, step, rank)


MicroBatches = list[tuple[torch.Tensor, Any]]


class StepFaults:
    """The trainer's ``before_step`` hook: kills this rank ("kill") or feeds NaN images in its first
    micro-batch ("nan") at the chosen batches; otherwise hands the micro-batches on untouched."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    def _fires(self, kind: str, attempt: int, rank: int) -> bool:
        return any(f.fires(kind, attempt, rank) for f in self.faults)

    def __call__(self, micro_batches: MicroBatches, attempt: int, rank: int) -> MicroBatches:
        """``attempt``: the 0-based batch this process trains (STEP above)."""
        if self._fires("kill", attempt, rank):
            _kill("kill", attempt, rank)
        if self._fires("nan", attempt, rank):
            images, texts = micro_batches[0]
            dtype = images.dtype if images.is_floating_point() else torch.float32  # uint8 (--decode fast)
            return [(torch.full(images.shape, float("nan"), dtype=dtype), texts), *micro_batches[1:]]
        return micro_batches


class EvalFaults:
    """The evaluator's ``before_read`` hook: raises OSError where rank ``rank`` reads its validation samples
    in the evaluation at optimizer step ``step`` ("eval-error"); STEP is that optimizer step."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    def __call__(self, step: int, rank: int) -> None:
        if any(f.fires("eval-error", step, rank) for f in self.faults):
            print(f"[fault injection] rank {rank}: validation data unreadable at step {step}", flush=True)
            raise OSError(f"[fault injection] validation data unreadable at step {step}")


def install(trainer: Any) -> None:
    """Set ``trainer.before_step`` (and, for an evaluation fault, ``trainer.evaluator.before_read``) when
    DS_CLIP_INJECT_FAULT is set (a bad value fails here, at start); leave them None otherwise."""
    text = os.environ.get(ENV)
    if text:
        faults = _parse(text)
        trainer.before_step = StepFaults(faults)
        if any(f.kind == "eval-error" for f in faults):
            trainer.evaluator.before_read = EvalFaults(faults)

"""Fault injection reaches the trainer through one hook, set at start only when asked for.

Contract: without DS_CLIP_INJECT_FAULT, ``faults.install`` leaves ``Trainer.before_step`` None (a normal run
pays one ``is None`` check per step); with it, the hook poisons exactly the chosen batch of the chosen rank
and hands every other batch on untouched; a value that cannot be read fails at start, not at that step.
(What the faults do to a real run is tests/faults/test_faults.py.)
"""

from __future__ import annotations

import pytest
import torch

from ds_clip.training import faults
from ds_clip.training.trainer import Trainer


class _Run:
    """Stands for a built Trainer: install() only sets an attribute."""

    before_step = Trainer.before_step


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(2, 3, 4, 4), torch.ones(2, 5, dtype=torch.long)) for _ in range(2)]


def test_no_hook_without_the_variable(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    run = _Run()
    faults.install(run)
    assert Trainer.before_step is None and run.before_step is None


def test_hook_poisons_the_chosen_batch_and_rank_only(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan@1:0")
    run = _Run()
    faults.install(run)
    assert run.before_step is not None
    untouched = _micro_batches()
    assert run.before_step(untouched, 0, 0) is untouched  # another batch
    assert run.before_step(untouched, 1, 1) is untouched  # another rank
    poisoned = run.before_step(_micro_batches(), 1, 0)
    assert torch.isnan(poisoned[0][0]).all() and torch.equal(poisoned[0][1], untouched[0][1])
    assert torch.equal(poisoned[1][0], untouched[1][0])  # the other micro-batches as they were


def test_unreadable_value_fails_at_install(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan@x:0")
    with pytest.raises(ValueError, match="KIND@STEP"):
        faults.install(_Run())


class _Part:
    """Stands for the evaluator or the checkpointer: install() only sets its hook."""

    before_read = None
    save_hook = None


def test_eval_and_save_faults_reach_their_own_hooks_only(monkeypatch):
    """eval-error reaches the evaluator's before_read, kill-in-save the checkpointer's save_hook (at the save's
    "after_shards" point); a fault of one kind leaves the other hook None."""
    monkeypatch.setenv(faults.ENV, "eval-error@2:1")
    run = _Run()
    run.evaluator, run.checkpointer = _Part(), _Part()
    faults.install(run)
    assert run.checkpointer.save_hook is None
    run.evaluator.before_read(2, 0)  # another rank
    run.evaluator.before_read(1, 1)  # another step
    with pytest.raises(OSError, match="unreadable at step 2"):
        run.evaluator.before_read(2, 1)
    monkeypatch.setenv(faults.ENV, "kill-in-save@4:1")
    run = _Run()
    run.evaluator, run.checkpointer = _Part(), _Part()
    faults.install(run)
    assert run.evaluator.before_read is None and run.checkpointer.save_hook is not None
    run.checkpointer.save_hook(
        "after_shards", 4, 0
    )  # another rank: no kill (the real kill is test_faults.py's)
    run.checkpointer.save_hook("after_shards", 3, 1)  # another step


def test_slow_holds_back_the_chosen_rank_only(monkeypatch):
    """slow@1-:0 holds rank 0 back by SLOW_STEP_S from batch 1 on (a straggler), and changes no batch."""
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv(faults.ENV, "slow@1-:0")
    run = _Run()
    faults.install(run)
    batches = _micro_batches()
    assert run.before_step(batches, 0, 0) is batches and slept == []  # before its step
    assert run.before_step(batches, 3, 1) is batches and slept == []  # another rank
    assert run.before_step(batches, 1, 0) is batches and run.before_step(batches, 5, 0) is batches
    assert slept == [faults.SLOW_STEP_S] * 2

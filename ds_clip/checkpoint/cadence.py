"""When the trainer saves (``Checkpointer``: the step and epoch cadences, keep and prune, failures) and
how it resumes."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ds_clip.checkpoint.layout import (
    MARKER,
    SaveError,
    _rank,
    _world,
)
from ds_clip.checkpoint.load import (
    load,
)
from ds_clip.checkpoint.save import SaveHook, save
from ds_clip.config import CheckpointSettings
from ds_clip.geometry import BatchGeometry

logger = logging.getLogger("ds_clip")


def describe_resume(state: dict[str, Any], data, *, ema: bool | None) -> str:
    """The one line a resume logs: where from and onto what, then everything it restored as the next step reads
    it (``load.restored_summary``, this rank's part): the optimizer's state keys per group, its step count,
    every group's lr for the next step, the fp16 loss scale, the scheduler's position, the data position, whose
    RNG state, the weight EMA."""
    meta, r = state["meta"], state["restored"]
    here = f"W {_world()} ZeRO-{r['stage']} {r['precision']}"
    there = f"W {meta['world_size']} ZeRO-{meta['zero_stage']}"
    keys = " | ".join(",".join(k) or "-" for k in r["state_keys"])
    steps = "/".join(str(s) for s in r["steps"]) or "none counted"
    lrs = ",".join(f"{lr:.6g}" for lr in r["lr"])
    sched = "none" if r["scheduler"] is None else f"{r['scheduler'][0]} at {r['scheduler'][1]}"
    scale = "none" if r["loss_scale"] is None else f"{r['loss_scale']:g}"
    return (
        f"resumed from {state['path']} at step {state['step']} ({there} {meta.get('precision', '?')} -> {here}"
        f"{', on a new world size / ZeRO stage' if state['resharded'] else ''}): optimizer state per group [{keys}], optimizer step "
        f"{steps}, lr per group next step [{lrs}], loss scale {scale}, scheduler {sched}, data epoch "
        f"{data.epoch} step {data.step_in_epoch} in epoch ({state.get('samples_seen')} samples), RNG of saved rank "
        f"{state['rng_from']}, EMA {'none' if ema is None else 'restored' if ema else 'not in the checkpoint'}"
    )


def epochs_done_at(step: int, steps_per_epoch: int | None) -> int | None:
    """The number of epochs completed when optimizer step ``step`` ends one, else None (epoch cadences)."""
    if not steps_per_epoch or step <= 0 or step % steps_per_epoch:
        return None
    return step // steps_per_epoch


def on_cadence(
    step: int, every_n_steps: int | None, epochs_done: int | None, every_n_epochs: int | None
) -> bool:
    """A step cadence and an epoch cadence combine: the step is on either one (0 or None: off)."""
    on_steps = bool(every_n_steps) and step % every_n_steps == 0
    return on_steps or (
        epochs_done is not None and bool(every_n_epochs) and epochs_done % every_n_epochs == 0
    )


class CheckpointPart(Protocol):
    """State beside DeepSpeed's that a checkpoint carries (the weight EMA): written by every rank into the
    checkpoint folder, read back on resume."""

    def save_to(self, path: Path) -> list[Path]: ...

    def load_from(self, path: Path, *, is_main: bool) -> bool: ...


class Checkpointer:
    """When the trainer saves, and what a save records: owns ``--save-every-n-steps``, ``--save-frequency``
    (epochs), ``--save-most-recent``, ``--keep-checkpoints`` (``--delete-previous-checkpoint``: 1) and
    ``--resume``. Every rank holds one and calls every method (saves and loads are collectives)."""

    def __init__(
        self,
        engine,
        run_dir: Path,
        data,
        section: CheckpointSettings,
        *,
        geometry: BatchGeometry,
        settings: dict[str, Any],
        meta: dict[str, Any],
        steps_per_epoch: int | None = None,
        parts: Sequence[CheckpointPart] = (),
    ) -> None:
        """``section``: the checkpoint flags; ``geometry``: the run's W, k, m (the N a resume must keep, the
        samples a step counts); ``settings``: the flat settings (settings.json) a resume checks; ``meta``: what
        else each checkpoint records (model, precision, ...)."""
        self.engine, self.run_dir, self.data = engine, Path(run_dir), data
        self.settings, self.geometry = settings, geometry
        # N is recorded as such: a resume on another world size re-derives k from it (--global-batch-size).
        self.meta = {
            "accum_freq": geometry.accum_freq,
            "micro_batch_size": geometry.micro_batch_size,
            "global_batch_size": geometry.global_batch,
            **meta,
        }
        self.every_n_steps, self.every_n_epochs = section.save_every_n_steps, section.save_frequency
        self.keep = 1 if section.delete_previous_checkpoint else section.keep_checkpoints
        self.most_recent, self.steps_per_epoch = section.save_most_recent, steps_per_epoch
        self.on_failure = section.on_save_failure
        self.parts = list(parts)
        self.resumed_from: Path | None = None
        """The checkpoint folder ``resume`` loaded (None: a fresh start)."""
        self._holds: tuple[int, Path] | None = None
        """(step, folder) of the complete checkpoint that holds the engine's state now (saved or resumed)."""
        self._recent_only: Path | None = None
        """The last checkpoint saved only for --save-most-recent: deleted once a newer one is complete."""
        self.save_hook: SaveHook | None = None
        """Called at the named points of each save (``save.SAVE_POINTS``); None in a normal run:
        ``faults.install`` sets it when DS_CLIP_INJECT_FAULT asks for a fault in a save."""

    def save(self, step: int, *, recent_only: bool = False) -> Path:
        """Save now (every rank). A failed save raises SaveError naming the checkpoint, the path and why.
        A step whose complete checkpoint already holds this state (saved by this run, or resumed from, with no
        update since: a stop signal right after a cadence save) is not written again."""
        held = self._holds
        if held is not None and held[0] == step and (held[1] / MARKER).exists():
            if not recent_only and self._recent_only == held[1]:
                self._recent_only = None  # now a checkpoint of its own cadence: kept
            return held[1]
        meta = {**self.meta, "epoch": self.data.epoch, "samples_seen": step * self.geometry.global_batch}
        try:
            path = save(
                self.engine,
                self.run_dir,
                step,
                self.data.state_dict(),
                self.settings,
                meta=meta,
                keep=self.keep,
                write_extra=self._write_parts if self.parts else None,
                hook=self.save_hook,
            )
        except SaveError as exc:
            raise SaveError(
                f"{exc}. Free space (or fix the permission) and relaunch with --resume latest; "
                "--on-save-failure continue keeps training and tries again at the next save"
            ) from None
        self._holds = (step, path)
        previous, self._recent_only = self._recent_only, (path if recent_only else None)
        if previous is not None and previous != path and _rank() == 0 and previous.exists():
            # The marker goes first (as in prune): a deletion cut short leaves a folder that reads as partial.
            (previous / MARKER).unlink(missing_ok=True)
            shutil.rmtree(previous, ignore_errors=True)
            logger.info(
                "removed %s: --save-most-recent keeps the newest epoch's checkpoint only", previous.name
            )
        return path

    def _write_parts(self, path: Path) -> list[Path]:
        return [f for part in self.parts for f in part.save_to(path)]

    def maybe_save(self, step: int, total_steps: int) -> None:
        """Save on the step or epoch cadence, or at an epoch's end for --save-most-recent; the last step is
        saved by ``save`` at the end of the run, once."""
        if step >= total_steps:
            return
        epochs = epochs_done_at(step, self.steps_per_epoch)
        try:
            if on_cadence(step, self.every_n_steps, epochs, self.every_n_epochs):
                self.save(step)
            elif epochs is not None and self.most_recent:
                self.save(step, recent_only=True)
        except SaveError as exc:
            if self.on_failure != "continue":
                raise
            if _rank() == 0:
                logger.warning(
                    "%s; training goes on (--on-save-failure continue): the next save tries again",
                    str(exc).split(". Free space", 1)[0],
                )

    def resume(
        self, resume: str, *, shapes: dict[str, list[int]], is_main: bool, agreed: Path | None = None
    ) -> int:
        """Load the checkpoint ``--resume`` names into the engine and the data position; returns the step to
        continue from. Whether there is one to load (``--resume latest`` before the run has a complete
        checkpoint starts from the model's own weights) is decided before the model is built
        (``ds_clip.models.weights.agree_start``): this is called only when there is, with ``agreed``, the
        folder the ranks agreed on then (every rank loads that one, "latest" is not looked up again)."""
        state = load(
            self.engine,
            self.run_dir,
            resume,
            shapes=shapes,
            global_batch=self.geometry.global_batch,
            settings=self.settings,
            agreed=agreed,
        )
        self.data.load_state_dict(state["data"])
        self.resumed_from = Path(state["path"])
        self._holds = (int(state["step"]), self.resumed_from)
        loaded = {
            getattr(part, "resume_label", "EMA"): part.load_from(self.resumed_from, is_main=is_main)
            for part in self.parts
        }
        if is_main:
            line = describe_resume(state, self.data, ema=loaded.pop("EMA", None))
            # Other parts (the SigLIP 2 teacher) after the EMA, in the same one line.
            line += "".join(
                f", {label} {'restored' if ok else 'not in the checkpoint'}" for label, ok in loaded.items()
            )
            logger.info("%s", line)
        return int(state["step"])

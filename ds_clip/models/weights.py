"""Where a run's weights come from: one decision, made once per start (rank 0 decides, every rank agrees).

| ``--resume``   | the run's ``checkpoints/``    | the student's weights come from                                |
|----------------|-------------------------------|----------------------------------------------------------------|
| none           | (a new run folder)            | its published or local weights (below)                         |
| ``latest``     | nothing complete saved yet    | its published or local weights: the first start of the one     |
|                |                               | command a re-queued or elastic job runs every time             |
| ``latest``     | a complete checkpoint         | that checkpoint (nothing published is fetched or loaded)       |
| ``PATH``       | -                             | the checkpoint PATH names (a folder that is none: an error)    |

"Published or local weights" are, in open_clip's order: ``--pretrained`` (an open_clip tag, ``hf-hub:ORG/REPO``,
a URL, a weights file or an exported folder), the weights of an ``hf-hub:`` or ``local-dir:`` ``--model``, and
a tower's own (``--pretrained-image``: timm's image tower; a Hugging Face text tower's); without any, the
seeded random initialisation of ``--seed``. A ``--distill-model`` teacher is never in a checkpoint: its
weights always come from ``--distill-pretrained`` or its ``local-dir:`` folder, whatever ``--resume`` says.

``plan_start`` is the table (one process, no collective); ``agree_start`` is what every rank of a run calls.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ds_clip.checkpoint import POINTER, CheckpointError, read_meta, resolve
from ds_clip.checkpoint.find import newest_complete
from ds_clip.checkpoint.save import remove_partial
from ds_clip.config import ModelSettings
from ds_clip.distributed import broadcast_object
from ds_clip.errors import UserError

logger = logging.getLogger("ds_clip")

WEIGHTS_FILE = "open_clip_model.safetensors"
"""The weights file of an exported (ds-clip-export) or open_clip model folder."""


class WeightsError(UserError):
    """A --pretrained folder that holds no weights file."""


@dataclass(frozen=True)
class StartPlan:
    """Where this start's weights come from (``plan_start``)."""

    resume: str | None
    """The --resume value (None: not given)."""
    checkpoint: Path | None = None
    """The complete checkpoint the run continues from; None: a fresh start from the model's own weights."""
    step: int | None = None
    """The optimizer step that checkpoint was saved at."""
    repointed: bool = False
    """``--resume latest`` found no ``latest_complete`` and took the newest complete step folder."""

    @property
    def loads_published(self) -> bool:
        """The student's published/local weights are fetched and loaded (no checkpoint to continue from)."""
        return self.checkpoint is None

    @property
    def flag(self) -> str:
        return f"--resume {self.resume}"

    def describe(self, m: ModelSettings) -> str:
        """One line: where the student's weights come from in this start."""
        if self.checkpoint is not None:
            return f"{self.flag}: continuing from {self.checkpoint} (step {self.step})"
        first = f"{self.flag}: no complete checkpoint in the run folder yet; " if self.resume else ""
        return f"{first}the model starts from {model_weights(m)}"


def model_weights(m: ModelSettings) -> str:
    """The student's published or local weights, in words naming their flags."""
    found = []
    if m.pretrained is not None:
        found.append(f"--pretrained {m.pretrained}")
    elif m.model.startswith("hf-hub:"):
        found.append(f"the weights of --model {m.model}")
    elif m.model.startswith("local-dir:") and _weights_in(Path(m.model[len("local-dir:") :])) is not None:
        found.append(f"the weights in --model {m.model}")
    if m.pretrained_image:
        found.append("--pretrained-image (timm's image tower)")
    return " and ".join(found) if found else "random weights (no --pretrained)"


def teacher_weights(m: ModelSettings) -> str | None:
    """The --distill-model teacher's weights, in words (None without a teacher): never from a checkpoint."""
    if m.distill_model is None:
        return None
    source = f"--distill-pretrained {m.distill_pretrained}" if m.distill_pretrained else "its own folder"
    return f"--distill-model {m.distill_model} from {source}"


def plan_start(run_dir: Path, resume: str | None) -> StartPlan:
    """The table of this module, read from the files of one process: ``--resume latest`` with no
    ``latest_complete`` and no complete step folder is a fresh start; any other --resume resolves to a complete
    checkpoint or raises CheckpointError (a pointer to a partial folder, a path that is no checkpoint).

    ``--resume latest`` without the pointer but with complete step folders (a run folder copied without it)
    continues from the newest complete one (``StartPlan.repointed``): a fresh start there would train over the
    saved run, and --keep-checkpoints would then prune the new run's checkpoints as older than the old ones."""
    if resume is None:
        return StartPlan(resume)
    if resume == "latest" and not (run_dir / "checkpoints" / POINTER).exists():
        newest = newest_complete(run_dir / "checkpoints")
        if newest is None:
            return StartPlan(resume)
        try:
            path = resolve(None, str(newest))
        except CheckpointError as exc:
            raise CheckpointError(
                f"--resume latest: {run_dir / 'checkpoints'} has no {POINTER} pointer and its newest complete "
                f"step folder {newest.name} does not check out ({exc}); resume from another with --resume DIR"
            ) from None
        return StartPlan(resume, path, int(read_meta(path)["step"]), repointed=True)
    path = resolve(run_dir, resume)
    return StartPlan(resume, path, int(read_meta(path)["step"]))


def agree_start(run_dir: Path, resume: str | None, *, is_main: bool) -> StartPlan:
    """Every rank (a collective), after any remote pull and before the model is built: rank 0 removes the
    partial checkpoint folders of saves cut short, reads the table, and every rank takes its answer (all start
    fresh or all load the same checkpoint). A --resume that names no complete checkpoint raises
    CheckpointError on every rank."""
    plan, error = None, None
    if is_main:
        if resume is not None:
            for p in remove_partial(run_dir / "checkpoints"):
                logger.warning("removed partial checkpoint %s (a save that was cut short)", p)
        try:
            plan = plan_start(run_dir, resume)
            if plan.repointed:
                _restore_pointer(plan)
        except (CheckpointError, OSError) as exc:
            error = str(exc)
    plan, error = broadcast_object((plan, error))
    if error is not None:
        raise CheckpointError(error)
    return plan


def _restore_pointer(plan: StartPlan) -> None:
    """Rank 0: ``latest_complete`` written again (atomically) for the checkpoint ``plan`` found without it, so
    this run's saves, pruning and remote copy continue from the same history."""
    assert plan.checkpoint is not None
    root = plan.checkpoint.parent
    logger.warning(
        "%s has no %s pointer: continuing from the newest complete checkpoint %s (pointer restored)",
        root, POINTER, plan.checkpoint.name,
    )  # fmt: skip
    tmp = root / f".{POINTER}.tmp"
    tmp.write_text(plan.checkpoint.name)
    os.replace(tmp, root / POINTER)


def _weights_in(folder: Path) -> Path | None:
    """The weights file of a model or exported folder: WEIGHTS_FILE, another safetensors, or open_clip's .bin."""
    for name in (
        WEIGHTS_FILE,
        *(f.name for f in sorted(folder.glob("*.safetensors"))),
        "open_clip_pytorch_model.bin",
    ):
        if (folder / name).is_file():
            return folder / name
    return None


def resolve_pretrained(pretrained: str | None) -> str | None:
    """--pretrained (or --distill-pretrained) may name an exported folder: use its weights file (files, tags and
    hub names pass through)."""
    if pretrained is None:
        return None
    p = Path(pretrained).expanduser()
    if p.is_dir():
        found = _weights_in(p)
        if found is None:
            raise WeightsError(
                f"--pretrained {pretrained}: no {WEIGHTS_FILE} (or other weights) in that folder"
            )
        return str(found)
    # A tag, hf-hub:ORG/REPO or URL passes through unchanged (open_clip and ds_clip.sources.hub resolve it).
    return str(p) if p.exists() else pretrained

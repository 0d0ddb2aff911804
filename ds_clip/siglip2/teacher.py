"""SigLIP 2's teacher: an exponential moving average of the image tower and the two self-distillation heads.

Held on every rank in fp32, outside the DeepSpeed engine (no optimizer sees it, no gradient reaches it), and run
under no_grad in eval mode. It starts as a copy of the student at the first self-supervised step (the paper
initialises it there) and moves after every applied optimizer step by ``lerp(student, 1 - momentum)``: a
function of the weight trajectory alone, the same for every (W, k) split. Under ZeRO-3 the student's partitions
are gathered for the copy (``deepspeed.zero.GatheredParameters``, every rank at the same step); under ZeRO 0-2
every rank holds the working weights already.

Its centers (DINO's: the running mean of the teacher's head outputs, subtracted before the teacher's softmax) are
updated after the step from the global batch's mean (one all-reduce in the step), so they too are split-free.

Saved in every checkpoint as ``siglip2_teacher.pt`` (rank 0; fp32 state, whole): it resumes on any world size
and ZeRO stage.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from ds_clip import distributed

logger = logging.getLogger("ds_clip")

FILE = "siglip2_teacher.pt"
FORMAT = 1
CENTER_MOMENTUM = 0.9
"""DINO's center momentum."""


class EmaTeacher:
    resume_label = "SigLIP 2 teacher"
    """How the resume line names this checkpoint part."""

    def __init__(
        self, visual: nn.Module, global_head: nn.Module, patch_head: nn.Module, momentum: float
    ) -> None:
        # A plain container (not an attribute of the model): DeepSpeed never sees these parameters.
        self.modules = nn.ModuleDict(
            {
                "visual": copy.deepcopy(visual),
                "global_head": copy.deepcopy(global_head),
                "patch_head": copy.deepcopy(patch_head),
            }
        ).float()
        self.modules.requires_grad_(False).eval()
        self.center_global = torch.zeros(global_head.prototypes.shape[0])
        self.center_patch = torch.zeros(patch_head.prototypes.shape[0])
        self.momentum = momentum
        self.ready = False
        """False until the first self-supervised step copies the student."""

    def to(self, device: torch.device) -> EmaTeacher:
        self.modules.to(device)
        self.center_global = self.center_global.to(device)
        self.center_patch = self.center_patch.to(device)
        return self

    @property
    def visual(self) -> nn.Module:
        return self.modules["visual"]

    def _pairs(self, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(teacher tensor, student parameter) by name: the image tower and the two heads."""
        student = {
            "visual": model.visual,
            "global_head": model.siglip2.global_head,
            "patch_head": model.siglip2.patch_head,
        }
        pairs = []
        for key, mine in self.modules.items():
            theirs = dict(student[key].named_parameters())
            pairs += [(p, theirs[name]) for name, p in mine.named_parameters()]
        return pairs

    def _with_student(self, model: nn.Module, update) -> None:
        import deepspeed

        pairs = self._pairs(model)
        # A no-op for parameters ZeRO-3 does not partition; a collective (all-gather) for those it does.
        with deepspeed.zero.GatheredParameters([s for _, s in pairs], modifier_rank=None), torch.no_grad():
            for t, s in pairs:
                update(t, s.detach().to(t.device, torch.float32))

    def reset_from(self, model: nn.Module) -> None:
        """The teacher becomes the student (and its centers zero): the first self-supervised step."""
        self._with_student(model, lambda t, s: t.copy_(s))
        self.center_global.zero_()
        self.center_patch.zero_()
        self.ready = True

    def update(self, model: nn.Module, center_sums: torch.Tensor | None) -> None:
        """After an applied self-supervised step: the weights' EMA, then the centers' from the step's global
        [Σ global outputs, Σ patch outputs, global count, patch count]."""
        w = 1.0 - self.momentum
        self._with_student(model, lambda t, s: t.lerp_(s, w))
        if center_sums is not None:
            k = self.center_global.numel()
            sums = center_sums.to(self.center_global.device, torch.float32)
            n_global, n_patch = sums[-2].clamp(min=1), sums[-1].clamp(min=1)
            self.center_global.lerp_(sums[:k] / n_global, 1 - CENTER_MOMENTUM)
            self.center_patch.lerp_(sums[k:-2] / n_patch, 1 - CENTER_MOMENTUM)

    # ------------------------------------------------------------------ a checkpoint part

    def save_to(self, path: Path) -> list[Path]:
        """Rank 0 writes the whole teacher (every rank holds the same one)."""
        if distributed.rank() != 0:
            return []
        file = Path(path) / FILE
        state = {
            "format": FORMAT,
            "ready": self.ready,
            "momentum": self.momentum,
            "modules": {k: v.detach().cpu() for k, v in self.modules.state_dict().items()},
            "center_global": self.center_global.cpu(),
            "center_patch": self.center_patch.cpu(),
        }
        tmp = file.with_name(f".{FILE}.tmp")
        torch.save(state, tmp)
        tmp.replace(file)
        return [file]

    def load_from(self, path: Path, *, is_main: bool) -> bool:
        """Every rank reads the checkpoint's teacher; a checkpoint saved before the self-supervised start has
        none (the teacher starts at that step). Returns whether one was loaded."""
        from ds_clip.checkpoint import CheckpointError, safe_load

        file = Path(path) / FILE
        if not file.exists():
            self.ready = False
            return False
        state = safe_load(file, flag="--resume")
        if state.get("format") != FORMAT:
            raise CheckpointError(
                f"{file}: a SigLIP 2 teacher of format {state.get('format')!r}, not {FORMAT}"
            )
        try:
            self.modules.load_state_dict(state["modules"])
        except RuntimeError as exc:
            raise CheckpointError(
                f"{file}: its teacher does not fit this model's image tower and heads (another --model or "
                f"--siglip2-prototypes / --siglip2-patch-prototypes): {str(exc).splitlines()[0]}"
            ) from None
        self.center_global.copy_(state["center_global"])
        self.center_patch.copy_(state["center_patch"])
        self.ready = bool(state["ready"])
        if is_main and state.get("momentum") != self.momentum:
            logger.info(
                "SigLIP 2 teacher: momentum %s from here on (saved with %s)", self.momentum, state["momentum"]
            )
        return True

    def describe(self) -> str:
        return "SigLIP 2 teacher " + ("restored" if self.ready else "not started yet")

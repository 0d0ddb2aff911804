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
from ds_clip.siglip2.towers import captured, token_module
from ds_clip.siglip2.views import masked_rows

logger = logging.getLogger("ds_clip")

FILE = "siglip2_teacher.pt"
FORMAT = 1
CENTER_MOMENTUM = 0.9
"""DINO's center momentum."""


class TeacherNet(nn.Module):
    """The teacher's modules and its forward: the image tower on the global view, its pooled output through the
    global head, its patch tokens at the masked positions through the patch head."""

    def __init__(self, visual: nn.Module, global_head: nn.Module, patch_head: nn.Module) -> None:
        super().__init__()
        self.visual, self.global_head, self.patch_head = visual, global_head, patch_head

    def forward(self, image: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``index`` [B, n]: each image's masked patch positions (``views.patch_mask``)."""
        module, prefix = token_module(self.visual)
        with captured(module, image.shape[0]) as grab:
            pooled = self.visual(image)
        return self.global_head(pooled), self.patch_head(masked_rows(grab.output[:, prefix:], index))


class EmaTeacher:
    resume_label = "SigLIP 2 teacher"
    """How the resume line names this checkpoint part."""

    def __init__(
        self, visual: nn.Module, global_head: nn.Module, patch_head: nn.Module, momentum: float
    ) -> None:
        visual = copy.deepcopy(visual)
        if hasattr(visual, "set_grad_checkpointing"):
            visual.set_grad_checkpointing(False)  # it runs under no_grad: nothing to recompute
        # Not an attribute of the model: the student's engine never sees these parameters.
        self.net = TeacherNet(visual, copy.deepcopy(global_head), copy.deepcopy(patch_head)).float()
        self.net.requires_grad_(False).eval()
        self.runner: nn.Module = self.net
        """What runs the forward: the module itself, or under ZeRO-3 a DeepSpeed engine holding it partitioned."""
        self.partitioned = False
        self.center_global = torch.zeros(global_head.prototypes.shape[0])
        self.center_patch = torch.zeros(patch_head.prototypes.shape[0])
        self.momentum = momentum
        self.ready = False
        """False until the first self-supervised step copies the student."""

    def start(self, engine) -> None:
        """On the student engine's device; under ZeRO-3 partitioned like the student (an engine of its own with
        no optimizer: its parameters gathered module by module in its forward, each rank keeping 1/W of them)."""
        device = torch.device(engine.device)
        self.center_global = self.center_global.to(device)
        self.center_patch = self.center_patch.to(device)
        if engine.zero_optimization_stage() == 3:
            import deepspeed

            config = {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                # No persistent parameters: a persistent one keeps a gathered copy its forward reads, which the
                # partition-local EMA update below would not reach.
                "zero_optimization": {
                    "stage": 3,
                    "stage3_param_persistence_threshold": 0,
                    "stage3_model_persistence_threshold": 0,
                },
            }
            self.runner, *_ = deepspeed.initialize(model=self.net, config=config)
            self.runner.eval()
            self.partitioned = True
        else:
            self.net.to(device)

    def __call__(self, image: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return self.runner(image.float(), index)

    @property
    def visual(self) -> nn.Module:
        return self.net.visual

    def _pairs(self, model: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(teacher parameter, student parameter) by name: the image tower and the two heads."""
        student = {
            "visual": model.visual,
            "global_head": model.siglip2.global_head,
            "patch_head": model.siglip2.patch_head,
        }
        pairs = []
        for key, theirs in student.items():
            mine = dict(getattr(self.net, key).named_parameters())
            pairs += [(mine[name], p) for name, p in theirs.named_parameters()]
        return pairs

    @torch.no_grad()
    def _with_student(self, model: nn.Module, update) -> None:
        pairs = self._pairs(model)
        if self.partitioned:
            # Both partitioned by ZeRO-3 over the same ranks, parameter by parameter in the same layout: each rank
            # updates its own partition from the student's, with no collective.
            for t, s in pairs:
                update(t.ds_tensor, s.ds_tensor.to(t.ds_tensor.device, torch.float32))
            return
        import deepspeed

        # A no-op for parameters ZeRO does not partition; an all-gather for those it does.
        with deepspeed.zero.GatheredParameters([s for _, s in pairs], modifier_rank=None):
            for t, s in pairs:
                update(t.data, s.detach().to(t.device, torch.float32))

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

    def full_state(self) -> dict[str, torch.Tensor]:
        """The teacher's weights whole, on the CPU (partitioned: gathered, a collective)."""
        import deepspeed

        params = list(self.net.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.partitioned):
            return {k: v.detach().float().cpu().clone() for k, v in self.net.state_dict().items()}

    # ------------------------------------------------------------------ a checkpoint part

    def save_to(self, path: Path) -> list[Path]:
        """Rank 0 writes the whole teacher (every rank calls it: partitioned, the weights are gathered)."""
        weights = self.full_state()
        if distributed.rank() != 0:
            return []
        file = Path(path) / FILE
        state = {
            "format": FORMAT,
            "ready": self.ready,
            "momentum": self.momentum,
            "modules": weights,
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
            self._load_weights(state["modules"])
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

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        import deepspeed

        params = list(self.net.parameters())
        # Partitioned: rank 0's values are partitioned to every rank as the context closes (a collective).
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=self.partitioned):
            if not self.partitioned or distributed.rank() == 0:
                self.net.load_state_dict(weights)

"""What ``cached_step`` refuses before its first forward: an engine, a loss, micro-batches or a model output
it would not train exactly (the full-batch gradient of every output; docs/step.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_clip import distributed
from ds_clip.errors import UserError
from ds_clip.step.loss import ContrastiveLoss, LossConfigError


class MicroBatchSizeError(UserError):
    """Ranks (or micro-batches) of one step hold different numbers of pairs: the loss's all-gather needs
    equal shapes (gloo aborts, NCCL hangs or gathers garbage), so the step refuses before gathering."""


class UntrainedOutputError(UserError):
    """The model's forward returns an output that no objective of this run trains (it would be dropped
    silently: a CoCa decoder or a SigLIP bias that never learns)."""


class EngineConfigError(UserError):
    """An engine or loss built in a way the step cannot train exactly (a user's own loop: ``step_engine_config``
    and a ``ContrastiveLoss`` of this process group avoid it; ``ds-clip-train`` builds both right)."""


# What each objective reads from the model's output dict.
CONTRASTIVE_OUTPUTS = frozenset({"image_features", "text_features", "logit_scale"})
SIGLIP_OUTPUTS = frozenset({"logit_bias"})
CAPTION_OUTPUTS = frozenset({"logits", "labels"})


def check_outputs(keys, *, siglip: bool, caption: bool) -> None:
    """Refuse (exit 2) a forward output that this run's objective does not consume."""
    used = CONTRASTIVE_OUTPUTS | (SIGLIP_OUTPUTS if siglip else frozenset())
    used |= CAPTION_OUTPUTS if caption else frozenset()
    extra = sorted(set(keys) - used)
    if not extra:
        return
    objective = "SigLIP" if siglip else "CLIP"
    hint = ""
    if "logit_bias" in extra and not siglip:
        hint = "; a model with a learnable logit_bias is trained with --siglip"
    elif CAPTION_OUTPUTS & set(extra):
        hint = (
            "; ds_clip trains a captioning (CoCa) model's decoder together with the CLIP contrastive loss, "
            "as open_clip's CoCaLoss does (not with --siglip)"
        )
    raise UntrainedOutputError(
        f"--model: the model's forward returns {', '.join(repr(k) for k in extra)}, which the {objective} "
        f"objective of this run does not train (ds_clip trains: {', '.join(sorted(used))}){hint}"
    )


def check_micro_batch_sizes(sizes: Sequence[int]) -> None:
    """Refuse a step whose micro-batches differ in size, on this rank or across ranks.

    One 2-int all-reduce (max of max and of -min) and one host sync per step; only when the sizes
    differ do the ranks exchange their lists to name them. A collective: call on every rank.
    """
    lo, hi = min(sizes), max(sizes)
    if distributed.world_size() > 1:
        local = distributed.to_device(torch.tensor([hi, -lo], dtype=torch.int64))
        agreed = distributed.all_reduce_max(local).tolist()  # the one host sync
        hi, lo = agreed[0], -agreed[1]
    if lo != hi:
        per_rank = distributed.all_gather_object(list(sizes)) if distributed.world_size() > 1 else [sizes]
        shown = "; ".join(f"rank {r}: {list(s)}" for r, s in enumerate(per_rank))
        raise MicroBatchSizeError(
            f"micro-batches of one step must all hold the same number of pairs on every rank ({shown}); "
            "the loaders drop partial batches, so this comes from a custom loader or a mismatched "
            "--batch-size between ranks"
        )


def check_engine(engine, loss_fn: ContrastiveLoss) -> None:
    """Refuse, before any forward, an engine config or loss that would train something else than the
    full-batch gradient. Python attributes only: no collective, no host sync."""
    fix = "build the engine's config with ds_clip.step_engine_config(your_config)"
    if engine.gradient_accumulation_steps() != 1:
        raise EngineConfigError(
            f"the engine has gradient_accumulation_steps={engine.gradient_accumulation_steps()} (its backward "
            f"would scale each micro-batch by 1/that); cached_step accumulates itself: {fix}"
        )
    if not engine.gradient_average:
        raise EngineConfigError(
            f"the engine sums gradients over ranks (gradient_allreduce_op); the step's scaling needs the mean: {fix}"
        )
    if engine.managed_gradient_accumulation() and not (
        engine.zero_optimization_stage() in (1, 2, 3)
        and hasattr(engine.optimizer, "_coalesce_grad_reduction")
    ):
        raise EngineConfigError(
            "the engine runs DeepSpeed's managed gradient accumulation, which the step uses only to coalesce the "
            f"reduction (ZeRO 1-3 without the BF16/FP16 optimizer wrappers): {fix}"
        )
    if getattr(engine.module, "output_dict", None) is False:  # an open_clip model that returns a tuple
        raise EngineConfigError(
            f"the model ({type(engine.module).__name__}) returns a tuple; the step reads image_features, "
            "text_features and logit_scale (logit_bias) by name: build it with output_dict=True"
        )
    # (A wrapper that only forwards calls and ``spec``, as benchmarks/bench_accum.py's CountingLoss, has no place.)
    built_for = (getattr(loss_fn, "rank", None), getattr(loss_fn, "world_size", None))
    if None not in built_for and built_for != (distributed.rank(), distributed.world_size()):
        raise LossConfigError(
            f"the loss was built for rank {built_for[0]} of {built_for[1]} but this process is rank "
            f"{distributed.rank()} of {distributed.world_size()}: it would not see the other ranks' pairs; build "
            "ContrastiveLoss(spec, rank=engine.global_rank, world_size=engine.world_size)"
        )


def check_step_call(
    engine,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: ContrastiveLoss,
    micro_batch_seeds: Sequence[int] | None,
) -> list[int]:
    """Every refusal of ``cached_step``'s arguments, in order; returns the micro-batch sizes (m each).
    A collective when W > 1 (``check_micro_batch_sizes``): call on every rank."""
    k = len(micro_batches)
    if k < 1:
        raise ValueError("cached_step needs at least one micro-batch")
    if micro_batch_seeds is not None and len(micro_batch_seeds) != k:
        raise ValueError(f"{len(micro_batch_seeds)} seeds for {k} micro-batches")
    check_engine(engine, loss_fn)
    sizes = [int(i.shape[0]) for i, _ in micro_batches]
    if any(int(t.shape[0]) != n for (_, t), n in zip(micro_batches, sizes)):
        raise MicroBatchSizeError(f"images and texts of a micro-batch differ in count: {sizes}")
    check_micro_batch_sizes(sizes)
    return sizes

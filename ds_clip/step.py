"""One optimizer step of cached-feature gradient accumulation on a DeepSpeed engine.

The engine runs with ``gradient_accumulation_steps=1`` and ``managed_gradient_accumulation=false``
(``ds_clip.ds_config.STEP_ENGINE_KEYS``): each ``engine.backward`` only accumulates locally and ``engine.step()``
is the one accumulation boundary, so DeepSpeed neither drops earlier micro-batches (the ZeRO-1/2
trap in the facts note) nor miscounts samples (``global_samples`` advances by k·m·W).

With ``--coalesce-grad-reduction`` on (ZeRO 1-3) the config turns managed accumulation on instead
(``ds_config.COALESCE_ENGINE_KEYS``) and phase 3's k backward passes run inside DeepSpeed's
``engine.coalesce_grad_reduction()``: each backward leaves its gradient on the parameters, the block's exit
reduces the sum once, and ``engine.step()`` (outside the block, as DeepSpeed requires) applies it. One
gradient reduction per step on ZeRO-2/3 too, at the price of holding the full gradient between backwards.

Phases, for k micro-batches of m pairs on each of W ranks (N = W·k·m):

1. Embed. Micro-batch 0 runs forward *with* grad and keeps its graph (it is never recomputed, so
   k = 1 is exactly a plain step). Micro-batches 1..k-1 run under ``torch.no_grad()`` with their RNG
   state (CPU and device) recorded and BatchNorm running statistics frozen. A distillation teacher
   (--distill-model) embeds every micro-batch here too, under no_grad, and nowhere else.
2. Loss once. The k·m embeddings become fp32 leaves; ``ContrastiveLoss`` gathers the other ranks'
   embeddings and computes the full-batch loss; ``autograd.grad`` gives g_j = ∂L/∂(embeddings of
   micro-batch j) and the gradients of logit_scale / logit_bias. The teacher's embeddings and scale
   enter as constants (open_clip's DistillClipLoss).
3. Push back. For each micro-batch the surrogate ⟨embeddings_j, g_j⟩ (fp32) is backpropagated
   through the encoders (micro-batch 0 through its kept graph, the others after recomputing with
   their RNG state restored). The logit_scale / logit_bias term is added once per step, to
   micro-batch 0's surrogate. Then one ``engine.step()``.

CoCa (``caption``, see ``ds_clip.caption``): the objective is w_c x the contrastive loss + w_cap x the caption
cross-entropy over the non-pad tokens of the whole global batch. Phase 1 also computes each micro-batch's
token-loss sum and token count (the decoder runs in that forward anyway); one 2-element all-reduce gives the
global count, which phase 3 divides each micro-batch's own token-loss sum by (micro-batch 0: through its kept
graph; the others: in their recompute). The contrastive part's gradients are scaled by w_c. Every output of
the model's forward must be consumed by the objective (``check_outputs``), or the step refuses it.

A fully locked tower (``--lock-image`` / ``--lock-text``: no parameter of it trainable) is embedded in phase 1
only; phase 3 runs just the other tower, with the RNG stream it had in phase 1.

Host syncs (GPU -> CPU waits) per optimizer step, whatever k is: one when W > 1 to agree on the
micro-batch sizes before the loss's all-gather, one to agree on finiteness before any backward. Nothing
per micro-batch; the loss and logit_scale stay on the device in ``StepResult`` until the loop logs them.

No I/O and no logging here: the loop owns cadence and side effects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ds_clip import distributed
from ds_clip.caption import CaptionLoss
from ds_clip.errors import UserError
from ds_clip.loss import ContrastiveLoss, LossConfigError, TeacherFeatures
from ds_clip.model import Teacher, frozen_towers


class MicroBatchSizeError(UserError):
    """Ranks (or micro-batches) of one step hold different numbers of pairs: the loss's all-gather needs
    equal shapes (gloo aborts, NCCL hangs or gathers garbage), so the step refuses before gathering."""


class UntrainedOutputError(UserError):
    """The model's forward returns an output that no objective of this run trains (it would be dropped
    silently: a CoCa decoder or a SigLIP bias that never learns)."""


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


@dataclass
class StepResult:
    loss: torch.Tensor
    """Full-batch objective of this step (detached, same on every rank)."""
    logit_scale: torch.Tensor
    """exp(logit_scale) used in this step (detached)."""
    local_samples: int
    """Pairs this rank trained on in this step (k·m)."""
    micro_batches: int
    """k."""
    skipped: bool = False
    """True when the update was not applied on any rank: a non-finite loss or embedding gradient on some
    rank (ds_clip skips before any backward), or an fp16 overflow that DeepSpeed's loss scaler caught
    (``engine.was_step_applied()`` is False). Either way the weights, the optimizer state and the LR
    schedule did not move."""
    overflow: bool = False
    """The skip was DeepSpeed's (fp16 loss-scale overflow), not ds_clip's non-finite guard."""


def micro_batch_seed(seed: int, step: int, global_micro_batch: int) -> int:
    """RNG seed of one global micro-batch: the same pairs get the same dropout masks in step ``step``
    whatever the (W, k) split, because the trainer assigns data and seeds by global index."""
    return ((seed * 1_000_003 + step) * 1_000_003 + global_micro_batch) % (2**62)


def input_dtype(engine) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


@contextlib.contextmanager
def frozen_batchnorm_stats(module: nn.Module, *, skipped_tower: str | None = None) -> Iterator[None]:
    """Train-mode BatchNorm that normalises with batch statistics but leaves running stats alone.

    With ``track_running_stats=False`` a training BatchNorm uses the batch statistics exactly as a
    tracking one does, but neither updates ``running_mean``/``running_var`` nor ``num_batches_tracked``,
    so the no-grad pass computes the same embeddings without counting the micro-batch twice.
    ``skipped_tower`` ("image" or "text"): a tower that is not recomputed keeps updating its running stats
    here, in its only pass.
    """

    def recomputed(name: str) -> bool:
        if skipped_tower is None:
            return True
        return name.startswith("visual.") != (skipped_tower == "image")

    bns = [
        m
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and recomputed(name)
    ]
    for m in bns:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in bns:
            m.track_running_stats = True


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The generator of the engine's own device (not whichever GPU is "current"): patch dropout draws
    # from the CPU generator, dropout on a GPU from that GPU's.
    device_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), device_state


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    cpu, device_state = state
    torch.set_rng_state(cpu)
    if device_state is not None:
        torch.cuda.set_rng_state(device_state, device)


def _to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    # non_blocking: a batch the DataLoader pinned is copied asynchronously (no host wait).
    return t.to(device=device, dtype=dtype, non_blocking=True)


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


class EngineConfigError(UserError):
    """An engine or loss built in a way the step cannot train exactly (a user's own loop: ``step_engine_config``
    and a ``ContrastiveLoss`` of this process group avoid it; ``ds-clip-train`` builds both right)."""


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


def _dot(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # fp32 dot so bf16/fp16 embeddings receive their gradient without a low-precision reduction.
    return (a.float() * g).sum()


def cached_step(
    engine,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: ContrastiveLoss,
    *,
    micro_batch_seeds: Sequence[int] | None = None,
    caption: CaptionLoss | None = None,
    teacher: Teacher | None = None,
) -> StepResult:
    """Train one optimizer step on k = len(micro_batches) micro-batches of (images, token ids).

    A collective: every rank calls it with its own k micro-batches of m pairs (the same k and m on every rank),
    and the step trains the full-batch gradient of all N = W·k·m pairs, then calls ``engine.step()`` once (the
    optimizer and the engine's LR scheduler advance once). ``engine`` is a DeepSpeed engine whose config went
    through ``ds_config.step_engine_config`` (``ds-clip-train`` resolves its own) and whose module's forward
    (``image=``, ``text=``, either alone too) returns a dict with ``image_features``, ``text_features`` and
    ``logit_scale`` (``logit_bias`` for SigLIP), as an open_clip model with ``output_dict=True`` does;
    ``loss_fn`` is a ``ContrastiveLoss`` of this process group's rank and world size. ``check_engine``
    refuses anything else before the first forward.

    ``micro_batch_seeds`` (optional, one per micro-batch) reseeds the RNGs before each micro-batch's
    first forward, so stochastic layers draw the same numbers for the same global micro-batch
    whatever the (W, k) split; without it the running RNG stream is used (and still restored for
    the recompute).

    ``caption`` (CoCa models, ``BuiltEngine.caption_fn``): the objective becomes
    ``caption.contrastive_weight`` x the contrastive loss + the caption term of ``ds_clip.caption``.

    ``teacher`` (--distill-model; the loss must distil): embeds each micro-batch once, in phase 1 under no_grad
    (micro-batch 0 too, never in the recompute); its embeddings enter the loss as constants.
    """
    k = len(micro_batches)
    if k < 1:
        raise ValueError("cached_step needs at least one micro-batch")
    if micro_batch_seeds is not None and len(micro_batch_seeds) != k:
        raise ValueError(f"{len(micro_batch_seeds)} seeds for {k} micro-batches")
    check_engine(engine, loss_fn)
    dtype = input_dtype(engine)
    device = torch.device(engine.device)
    sizes = [int(i.shape[0]) for i, _ in micro_batches]
    if any(int(t.shape[0]) != n for (_, t), n in zip(micro_batches, sizes)):
        raise MicroBatchSizeError(f"images and texts of a micro-batch differ in count: {sizes}")
    check_micro_batch_sizes(sizes)

    def on_device(j: int) -> dict[str, torch.Tensor]:
        # Data offload: the k micro-batches' inputs stay where the loader put them (pinned host memory on
        # GPUs) and only the one being embedded is on the device, so device memory for inputs does not
        # grow with k (k-1 extra host-to-device copies per step, asynchronous from pinned memory).
        images, texts = micro_batches[j]
        return {"image": _to_device(images, device, dtype), "text": _to_device(texts, device)}

    def seed(j: int) -> None:
        if micro_batch_seeds is not None:
            torch.manual_seed(micro_batch_seeds[j])

    # A fully locked tower (--lock-image / --lock-text, no parameter of it trainable) gets no gradient from
    # its embeddings, so phase 3 runs only the other tower's forward (through the engine's top-level
    # forward, which under ZeRO-3 gathers the root parameters): one tower's forward saved per recomputed
    # micro-batch. open_clip's forward runs the image tower first; when the image tower is the skipped one,
    # phase 1 embeds the two towers in two calls and records the RNG state between them, so the text
    # tower's recompute draws what it drew in the cache pass (the stream is the one a joint forward draws).
    image_frozen, text_frozen = frozen_towers(engine.module)
    skipped = "image" if image_frozen else ("text" if text_frozen else None)
    recompute = not (image_frozen and text_frozen)
    if caption is not None:
        # CoCa's decoder reads both towers' tokens and its forward needs the image: one joint forward in
        # both passes whatever is locked (a locked tower then runs without building a graph).
        skipped, recompute = None, True

    # Phase 1: embed. Micro-batch 0 keeps its graph; the rest are cached without one.
    # The teacher (eval mode: it draws no random numbers) embeds each micro-batch right after the student, from
    # the same device copy of the inputs, under no_grad; its embeddings are kept like the student's cache.
    teacher_out: list[dict[str, torch.Tensor]] = []

    def embed_teacher(inputs: dict[str, torch.Tensor]) -> None:
        if teacher is not None:
            teacher_out.append(teacher(inputs["image"], inputs["text"]))

    seed(0)
    inputs0 = on_device(0)
    out0 = engine(**inputs0)
    check_outputs(out0.keys(), siglip=loss_fn.spec.siglip, caption=caption is not None)
    embed_teacher(inputs0)
    del inputs0
    images = [out0["image_features"].detach()]
    texts = [out0["text_features"].detach()]
    # CoCa: [token-loss sum, token count] per micro-batch; micro-batch 0's sum keeps its graph.
    captions = [caption.sum_and_count(out0)] if caption is not None else []
    rng_states: list = [None]
    with torch.no_grad(), frozen_batchnorm_stats(engine.module, skipped_tower=skipped):
        for j in range(1, k):
            seed(j)
            inputs = on_device(j)
            if skipped == "image" and not text_frozen:
                image_j = engine(image=inputs["image"])["image_features"]
                rng_states.append(_rng_state(device))
                out = {
                    "image_features": image_j,
                    "text_features": engine(text=inputs["text"])["text_features"],
                }
            else:
                rng_states.append(_rng_state(device))
                out = engine(**inputs)
            embed_teacher(inputs)
            images.append(out["image_features"])
            texts.append(out["text_features"])
            if caption is not None:
                captions.append(caption.sum_and_count(out))
            del out
    rng_after_embed = _rng_state(device)
    # The caption term's global token count (its normaliser) and value: one 2-element all-reduce per step.
    caption_total = caption.global_sum_and_count(captions) if caption is not None else None

    # Phase 2: the loss over all N pairs, once, in fp32.
    image_leaf = torch.cat(images).float().requires_grad_(True)
    text_leaf = torch.cat(texts).float().requires_grad_(True)
    scale_out = out0["logit_scale"]
    bias_out = out0.get("logit_bias")
    leaves = [image_leaf, text_leaf, scale_out.detach().float().requires_grad_(True)]
    if bias_out is not None and loss_fn.spec.siglip:
        leaves.append(bias_out.detach().float().requires_grad_(True))
    teacher_features = None
    if teacher is not None:
        # Constants of the loss: no leaves, no gradient; the teacher's own scale scales its logits.
        teacher_features = TeacherFeatures(
            image_features=torch.cat([t["image_features"] for t in teacher_out]).float(),
            text_features=torch.cat([t["text_features"] for t in teacher_out]).float(),
            logit_scale=teacher_out[0]["logit_scale"].float(),
        )
        del teacher_out
    result = loss_fn(*leaves, teacher=teacher_features)
    grads = torch.autograd.grad(result.backward_loss, leaves)
    value = result.value
    if caption is not None:
        value = caption.contrastive_weight * value + caption.value(caption_total)

    # Non-finite guard, agreed across ranks *before* any backward, so a skipped step leaves no
    # partial gradients behind. The cache pass computes the same values as the recompute (same RNG),
    # so a NaN/inf embedding, loss or embedding gradient is seen here. (fp16 overflow inside a
    # backward is DeepSpeed's loss scaler's to catch; it skips that step itself.)
    # One host sync: every check stays on the device until any_rank reads the single flag.
    not_finite = ~torch.stack([torch.isfinite(value).all(), *(torch.isfinite(g).all() for g in grads)]).all()
    if distributed.any_rank(not_finite):
        del out0, grads, result, captions
        _set_rng_state(rng_after_embed, device)
        return StepResult(
            loss=torch.tensor(float("nan")),
            logit_scale=scale_out.detach().float().reshape(()),
            local_samples=sum(sizes),
            micro_batches=k,
            skipped=True,
        )
    weight = caption.contrastive_weight if caption is not None else 1.0
    g_images = (grads[0] * (result.encoder_grad_coef * weight)).split(sizes)
    g_texts = (grads[1] * (result.encoder_grad_coef * weight)).split(sizes)
    g_scalars = [g * (result.scalar_grad_coef * weight) for g in grads[2:]]
    caption_coef = caption.grad_coef(caption_total, loss_fn.world_size) if caption is not None else None

    # Phase 3: push the embedding gradients back through the encoders, then step once.
    # Managed accumulation is on only when the resolved config coalesces (ds_config); then the k backwards
    # run in one coalescing block (no reduction inside, one on exit) and step() follows outside it.
    coalesce = engine.managed_gradient_accumulation()
    with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
        for j in range(k if recompute else 1):
            if j == 0:
                out = out0
            else:
                _set_rng_state(rng_states[j], device)
                inputs = on_device(j)
                if skipped == "image":
                    inputs = {"text": inputs["text"]}
                elif skipped == "text":
                    inputs = {"image": inputs["image"]}
                out = engine(**inputs)
            surrogate = torch.zeros((), device=device)
            if not image_frozen:
                surrogate = surrogate + _dot(out["image_features"], g_images[j])
            if not text_frozen:
                surrogate = surrogate + _dot(out["text_features"], g_texts[j])
            if caption is not None:
                # The caption term is per sample: this micro-batch's own tokens, in its own pass (micro-batch
                # 0: the sum computed with its kept graph in phase 1).
                token_loss = captions[0][0] if j == 0 else caption.token_loss_sum(out)
                surrogate = surrogate + token_loss.float() * caption_coef
            if j == 0:
                # logit_scale (and logit_bias) enter exactly once per step.
                surrogate = surrogate + _dot(out["logit_scale"], g_scalars[0])
                if len(g_scalars) > 1:
                    surrogate = surrogate + _dot(out["logit_bias"], g_scalars[1])
            engine.backward(surrogate)
            del out, surrogate
    del out0, captions
    _set_rng_state(rng_after_embed, device)
    engine.step()
    if coalesce:
        # Managed mode counts train_batch_size = m·W samples per step(); this step trained k·m·W.
        engine.global_samples += (k - 1) * engine.train_batch_size()
    # False only when DeepSpeed's fp16 loss scaler found an overflow and skipped the update (and, as for
    # ds_clip's own skip above, did not advance the LR scheduler). A Python bool: no host sync.
    applied = engine.was_step_applied()
    return StepResult(
        loss=value.detach(),
        logit_scale=scale_out.detach().float().reshape(()),
        local_samples=sum(sizes),
        micro_batches=k,
        skipped=not applied,
        overflow=not applied,
    )

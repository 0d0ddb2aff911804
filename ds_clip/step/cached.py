"""One optimizer step of cached-feature gradient accumulation on a DeepSpeed engine: ``cached_step``.

Three named phases, as GradCache splits them (the whole story: docs/step.md): ``_embed`` (every micro-batch's
features, micro-batch 0 with its graph, the others without and with their RNG state recorded) returns a
``Cache``; ``_full_batch_grads`` computes the loss over all N = W·k·m pairs once, in fp32; ``_push_back``
backpropagates each micro-batch's surrogate; then one ``engine.step()``. What CoCa's caption term, a
distillation teacher and locked towers change in a phase is decided once per step, in a ``Plan``.
At most two host syncs per step, none per micro-batch. No I/O and no logging: the loop owns them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import record_function

from ds_clip import distributed
from ds_clip.models.model import Teacher, frozen_towers
from ds_clip.step.aux import AuxTerms
from ds_clip.step.caption import CaptionLoss
from ds_clip.step.checks import (
    EngineConfigError,
    MicroBatchSizeError,
    UntrainedOutputError,
    check_engine,
    check_micro_batch_sizes,
    check_outputs,
    check_step_call,
)
from ds_clip.step.loss import ContrastiveLoss, TeacherFeatures

__all__ = [
    # The step.
    "StepResult",
    "cached_step",
    "frozen_batchnorm_stats",
    "input_dtype",
    "micro_batch_seed",
    # Its refusals, defined in ds_clip.step.checks (re-exported: ``from ds_clip.step import ...`` keeps working).
    "EngineConfigError",
    "MicroBatchSizeError",
    "UntrainedOutputError",
    "check_engine",
    "check_micro_batch_sizes",
    "check_outputs",
]


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
    lr: float | None = None
    """The learning rate of the first parameter group in the optimizer when this step's update ran: the LR that
    trained it. Read before ``engine.step()``, which steps the LR scheduler and leaves the next step's LR in the
    optimizer. None when the update was skipped before the optimizer (a non-finite loss or gradient)."""
    parts: dict[str, torch.Tensor] | None = None
    """With aux terms (--siglip2): the contrastive loss and each term's global mean (``loss_<name>``, unweighted),
    and the extras the forward counts; detached device tensors, the same on every rank."""
    aux_center: torch.Tensor | None = None
    """With aux terms: the forward's ``aux_center`` vectors summed over the global batch (None without them)."""


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


class RngState:
    """The random streams a forward draws from, captured now and restored before its recompute: the CPU
    generator (patch dropout draws from it even on a GPU) and the generator of the engine's own device
    (dropout on a GPU draws from that device's, not from whichever GPU is "current")."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.cpu = torch.get_rng_state()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            torch.cuda.set_rng_state(self.accelerator, self.device)


@dataclass(frozen=True)
class Towers:
    """Which towers are trained and which forward phase 3 recomputes (--lock-image / --lock-text).

    A fully locked tower (no parameter of it trainable) gets no gradient from its embeddings, so phase 3 runs
    only the other tower's forward (through the engine's top-level forward, which under ZeRO-3 gathers the root
    parameters): one tower's forward saved per recomputed micro-batch. open_clip's forward runs the image tower
    first; when the image tower is the skipped one, phase 1 embeds the two towers in two calls and records the
    RNG state between them, so the text tower's recompute draws what it drew in the cache pass (the stream is
    the one a joint forward draws). CoCa's decoder reads both towers' tokens and its forward needs the image:
    one joint forward in both passes whatever is locked (a locked tower then runs without building a graph).
    """

    image_trained: bool
    text_trained: bool
    skipped: str | None
    """"image" or "text": the locked tower that phase 3 does not run; None: a joint forward."""
    recompute: bool
    """False when both towers are locked: micro-batches 1..k-1 are not run again."""

    @classmethod
    def of(cls, module: nn.Module, *, caption: bool) -> Towers:
        image_frozen, text_frozen = frozen_towers(module)
        skipped = "image" if image_frozen else ("text" if text_frozen else None)
        recompute = not (image_frozen and text_frozen)
        if caption:
            skipped, recompute = None, True
        return cls(not image_frozen, not text_frozen, skipped, recompute)

    def cache_forward(
        self, engine, inputs: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[dict, RngState]:
        """Phase 1's forward of one micro-batch (under no_grad), and the RNG state its recompute restores."""
        if self.skipped == "image" and self.text_trained:
            image = engine(image=inputs["image"])["image_features"]
            rng = RngState(device)
            return {
                "image_features": image,
                "text_features": engine(text=inputs["text"])["text_features"],
            }, rng
        rng = RngState(device)
        return engine(**inputs), rng

    def recompute_inputs(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.skipped == "image":
            return {"text": inputs["text"]}
        if self.skipped == "text":
            return {"image": inputs["image"]}
        return inputs

    def surrogate(
        self, out: dict, g_image: torch.Tensor, g_text: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """⟨features, ∂L/∂features⟩ of the trained towers, in fp32."""
        surrogate = torch.zeros((), device=device)
        if self.image_trained:
            surrogate = surrogate + _dot(out["image_features"], g_image)
        if self.text_trained:
            surrogate = surrogate + _dot(out["text_features"], g_text)
        return surrogate


AUX_OUTPUTS = frozenset({"aux", "aux_center"})
"""What a forward with aux terms returns beside its features (``ds_clip.step.aux``)."""


def _dot(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # fp32 dot so bf16/fp16 embeddings receive their gradient without a low-precision reduction.
    return (a.float() * g).sum()


@dataclass(frozen=True)
class Plan:
    """What the phases of one step run, decided once before the first forward: the inputs' device and dtype,
    the seeds, the towers (``Towers``), and the objectives that plug in (CoCa's caption term, the teacher)."""

    sizes: list[int]
    device: torch.device
    dtype: torch.dtype
    seeds: Sequence[int] | None
    siglip: bool
    coalesce: bool
    """Managed accumulation is on only when the resolved config coalesces (ds_config): phase 3's backwards then
    run in one coalescing block (no reduction inside, one on exit) and ``engine.step()`` follows outside it."""
    towers: Towers
    caption: CaptionLoss | None
    teacher: Teacher | None
    aux: AuxTerms | None = None
    """Per-sample terms the forward returns in ``out["aux"]`` (``ds_clip.step.aux``)."""
    normalize: tuple[Sequence[float], Sequence[float]] | None = None
    """(mean, std) of uint8 micro-batch images (--decode fast), applied on the device in ``inputs``."""

    @classmethod
    def decide(
        cls,
        engine,
        loss_fn: ContrastiveLoss,
        sizes: list[int],
        seeds: Sequence[int] | None,
        caption: CaptionLoss | None,
        teacher: Teacher | None,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        aux: AuxTerms | None = None,
    ) -> Plan:
        device = torch.device(engine.device)
        if normalize is not None:
            # On the device once per step, not per micro-batch: a host list copied in every embed and recompute
            # would be 2k small blocking host-to-device copies.
            normalize = tuple(torch.as_tensor(v, dtype=torch.float32, device=device) for v in normalize)
        return cls(
            sizes=sizes,
            device=device,
            dtype=input_dtype(engine),
            seeds=seeds,
            siglip=loss_fn.spec.siglip,
            coalesce=engine.managed_gradient_accumulation(),
            # The aux terms read the image tower's tokens of the joint forward, as CoCa's decoder does.
            towers=Towers.of(engine.module, caption=caption is not None or aux is not None),
            caption=caption,
            teacher=teacher,
            normalize=normalize,
            aux=aux,
        )

    @property
    def k(self) -> int:
        return len(self.sizes)

    def seed(self, j: int) -> None:
        if self.seeds is not None:
            torch.manual_seed(self.seeds[j])

    def inputs(self, micro_batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Data offload: the k micro-batches' inputs stay where the loader put them (pinned host memory on
        # GPUs) and only the one being embedded is on the device, so device memory for inputs does not
        # grow with k (k-1 extra host-to-device copies per step, asynchronous from pinned memory).
        # uint8 images (--decode fast) are normalised here, the one place a micro-batch reaches the device: the
        # cache pass and the recompute see the same pixels.
        images, texts = micro_batch
        if images.dtype == torch.uint8:
            if self.normalize is None:
                raise ValueError("uint8 images need cached_step(image_normalize=(mean, std))")
            images = normalize_images(_to_device(images, self.device), *self.normalize)
        return {"image": _to_device(images, self.device, self.dtype), "text": _to_device(texts, self.device)}

    def contrastive_weight(self) -> float:
        """CoCa scales the contrastive term, its value and all its gradients (1 without a caption term)."""
        return self.caption.contrastive_weight if self.caption is not None else 1.0


def normalize_images(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 NCHW images -> float32 on their device, with the arithmetic of torchvision's ToTensor then
    Normalize (x / 255, then (x - mean) / std per channel): the same values the CPU transform gives. ``mean`` and
    ``std`` may already be float32 tensors on the images' device (then no copy is made)."""
    m = torch.as_tensor(mean, dtype=torch.float32, device=images.device)[:, None, None]
    s = torch.as_tensor(std, dtype=torch.float32, device=images.device)[:, None, None]
    return images.to(torch.float32).div_(255).sub_(m).div_(s)


def _to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    # non_blocking: a batch the DataLoader pinned is copied asynchronously (no host wait).
    return t.to(device=device, dtype=dtype, non_blocking=True)


@dataclass
class Cache:
    """What phase 1 leaves for phases 2 and 3."""

    out0: dict[str, torch.Tensor]
    """Micro-batch 0's outputs, with their graph (it is never recomputed: k = 1 is exactly a plain step)."""
    images: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's image features, without a graph."""
    texts: list[torch.Tensor] = field(default_factory=list)
    rng: list[RngState | None] = field(default_factory=lambda: [None])
    """The state each micro-batch's recompute restores (micro-batch 0 has none)."""
    captions: list[torch.Tensor] = field(default_factory=list)
    """CoCa: [token-loss sum, token count] per micro-batch; micro-batch 0's sum keeps its graph."""
    caption_total: torch.Tensor | None = None
    """CoCa: the sum and count over the whole global batch (the count is the term's normaliser)."""
    teacher_outs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    teacher: TeacherFeatures | None = None
    """The teacher's features of all k micro-batches, constants of the loss."""
    rng_after: RngState | None = None
    """The streams after phase 1: where the step leaves them, whatever phase 3 drew."""
    aux: list[torch.Tensor] = field(default_factory=list)
    """Aux terms: each micro-batch's [sum, count, ...] vector; micro-batch 0's sums keep their graph."""
    aux_total: torch.Tensor | None = None
    """Aux terms: the vectors summed over the global batch."""
    centers: list[torch.Tensor] = field(default_factory=list)
    center_total: torch.Tensor | None = None


def _embed(engine, micro_batches, plan: Plan) -> Cache:
    """Phase 1 (GradCache's ``forward_no_grad``): micro-batch 0 forward with its graph, then micro-batches
    1..k-1 under no_grad with their RNG state recorded and BatchNorm running statistics frozen. The teacher
    and CoCa's caption sums ride along; one 2-element all-reduce gives the caption term's global count."""
    plan.seed(0)
    inputs = plan.inputs(micro_batches[0])
    out0 = engine(**inputs)
    check_outputs(out0.keys() - AUX_OUTPUTS if plan.aux is not None else out0.keys(), siglip=plan.siglip,
                  caption=plan.caption is not None)  # fmt: skip
    cache = Cache(out0=out0)
    _keep(cache, plan, inputs, out0)
    del inputs
    with torch.no_grad(), frozen_batchnorm_stats(engine.module, skipped_tower=plan.towers.skipped):
        for j in range(1, plan.k):
            plan.seed(j)
            inputs = plan.inputs(micro_batches[j])
            out, rng = plan.towers.cache_forward(engine, inputs, plan.device)
            cache.rng.append(rng)
            _keep(cache, plan, inputs, out)
            del out
    cache.rng_after = RngState(plan.device)
    if plan.caption is not None:
        cache.caption_total = plan.caption.global_sum_and_count(cache.captions)
    if plan.aux is not None:
        cache.aux_total = plan.aux.global_total(cache.aux)
        if cache.centers:  # the same on every rank: the forward returns centers on every rank or on none
            cache.center_total = AuxTerms.global_total(cache.centers)
    if plan.teacher is not None:
        cache.teacher, cache.teacher_outs = _teacher_features(cache.teacher_outs), []
    return cache


def _keep(cache: Cache, plan: Plan, inputs: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    """Cache one micro-batch: the teacher's embeddings (it is in eval mode and draws no random numbers; the
    same device copy of the inputs, under no_grad; never again in phase 3), the student's features without
    their graph, and CoCa's [token-loss sum, count] (its decoder ran in this forward anyway)."""
    if plan.teacher is not None:
        cache.teacher_outs.append(plan.teacher(inputs["image"], inputs["text"]))
    cache.images.append(out["image_features"].detach())
    cache.texts.append(out["text_features"].detach())
    if plan.caption is not None:
        cache.captions.append(plan.caption.sum_and_count(out))
    if plan.aux is not None:
        cache.aux.append(out["aux"])
        if out.get("aux_center") is not None:
            cache.centers.append(out["aux_center"].detach())


def _teacher_features(outs: list[dict[str, torch.Tensor]]) -> TeacherFeatures:
    # Constants of the loss: no leaves, no gradient; the teacher's own scale scales its logits.
    return TeacherFeatures(
        image_features=torch.cat([t["image_features"] for t in outs]).float(),
        text_features=torch.cat([t["text_features"] for t in outs]).float(),
        logit_scale=outs[0]["logit_scale"].float(),
    )


@dataclass
class Grads:
    """What phase 2 hands phase 3: the full-batch objective and its gradients, scaled for the surrogates."""

    value: torch.Tensor
    images: tuple[torch.Tensor, ...]
    """g_j = ∂L/∂(image features of micro-batch j), times encoder_grad_coef and the contrastive weight."""
    texts: tuple[torch.Tensor, ...]
    scalars: list[torch.Tensor]
    """∂L/∂logit_scale (and ∂L/∂logit_bias), times scalar_grad_coef and the contrastive weight."""
    caption_coef: torch.Tensor | None
    """CoCa: the factor on a micro-batch's token-loss sum (``CaptionLoss.grad_coef``)."""
    aux_coefs: torch.Tensor | None = None
    """Aux terms: the factor on each term's micro-batch sum (``AuxTerms.grad_coefs``)."""
    parts: dict[str, torch.Tensor] | None = None


def _full_batch_grads(cache: Cache, loss_fn: ContrastiveLoss, plan: Plan) -> Grads | None:
    """Phase 2 (GradCache's ``build_cache``): the loss over all N pairs, once, on fp32 leaves (the loss gathers
    the other ranks' features); ``autograd.grad`` gives the features' and the scalars' gradients. None when the
    objective or a gradient is not finite on some rank, agreed before any backward (one host sync)."""
    leaves = _leaves(cache, plan.siglip)
    result = loss_fn(*leaves, teacher=cache.teacher)
    grads = torch.autograd.grad(result.backward_loss, leaves)
    value = result.value
    if plan.caption is not None:
        value = plan.caption.contrastive_weight * value + plan.caption.value(cache.caption_total)
    parts = None
    if plan.aux is not None:
        parts = {"loss_contrastive": value.detach(), **plan.aux.logged(cache.aux_total)}
        value = value + plan.aux.value(cache.aux_total)
    # The cache pass computes the same values as the recompute (same RNG), so a NaN/inf embedding, loss or
    # embedding gradient is seen here, and a skipped step leaves no partial gradients behind. (fp16 overflow
    # inside a backward is DeepSpeed's loss scaler's to catch; it skips that step itself.) Every check stays
    # on the device until any_rank reads the single flag.
    not_finite = ~torch.stack([torch.isfinite(value).all(), *(torch.isfinite(g).all() for g in grads)]).all()
    if distributed.any_rank(not_finite):
        return None
    weight = plan.contrastive_weight()
    return Grads(
        value=value,
        images=(grads[0] * (result.encoder_grad_coef * weight)).split(plan.sizes),
        texts=(grads[1] * (result.encoder_grad_coef * weight)).split(plan.sizes),
        scalars=[g * (result.scalar_grad_coef * weight) for g in grads[2:]],
        caption_coef=None
        if plan.caption is None
        else plan.caption.grad_coef(cache.caption_total, loss_fn.world_size),
        aux_coefs=None if plan.aux is None else plan.aux.grad_coefs(cache.aux_total, loss_fn.world_size),
        parts=parts,
    )


def _leaves(cache: Cache, siglip: bool) -> list[torch.Tensor]:
    """The loss's inputs as fp32 leaves: the k·m features of each tower, and micro-batch 0's logit_scale
    (logit_bias for SigLIP), which every micro-batch of the step shares."""
    scale, bias = cache.out0["logit_scale"], cache.out0.get("logit_bias")
    leaves = [
        torch.cat(cache.images).float().requires_grad_(True),
        torch.cat(cache.texts).float().requires_grad_(True),
        scale.detach().float().requires_grad_(True),
    ]
    if bias is not None and siglip:
        leaves.append(bias.detach().float().requires_grad_(True))
    return leaves


def _push_back(engine, micro_batches, plan: Plan, cache: Cache, grads: Grads) -> None:
    """Phase 3 (GradCache's ``forward_backward``): each micro-batch's surrogate, backpropagated through the
    encoders: micro-batch 0 through its kept graph, the others recomputed with their RNG state restored (none
    when both towers are locked). With coalescing, the k backwards run in DeepSpeed's
    ``engine.coalesce_grad_reduction()`` block: one gradient reduction when it exits."""
    with engine.coalesce_grad_reduction() if plan.coalesce else contextlib.nullcontext():
        for j in range(plan.k if plan.towers.recompute else 1):
            out = cache.out0 if j == 0 else _recompute(engine, micro_batches[j], plan, cache.rng[j])
            surrogate = _surrogate(j, out, plan, cache, grads)
            engine.backward(surrogate)
            del out, surrogate


def _recompute(engine, micro_batch, plan: Plan, rng: RngState) -> dict[str, torch.Tensor]:
    """Micro-batch j's forward again, with grad, drawing what it drew in phase 1."""
    rng.restore()
    return engine(**plan.towers.recompute_inputs(plan.inputs(micro_batch)))


def _surrogate(j: int, out: dict[str, torch.Tensor], plan: Plan, cache: Cache, grads: Grads) -> torch.Tensor:
    """The scalar whose backward gives micro-batch j's share of the full-batch gradient."""
    surrogate = plan.towers.surrogate(out, grads.images[j], grads.texts[j], plan.device)
    if plan.caption is not None:
        # The caption term is per sample: this micro-batch's own tokens, in its own pass (micro-batch 0: the
        # sum computed with its kept graph in phase 1).
        token_loss = cache.captions[0][0] if j == 0 else plan.caption.token_loss_sum(out)
        surrogate = surrogate + token_loss.float() * grads.caption_coef
    if plan.aux is not None:
        # Per sample, as the caption term: micro-batch 0's sums from phase 1 (with their graph), the others' from
        # their recompute.
        aux = cache.aux[0] if j == 0 else out["aux"]
        surrogate = surrogate + plan.aux.surrogate(aux, grads.aux_coefs)
    if j == 0:
        # logit_scale (and logit_bias) enter exactly once per step.
        surrogate = surrogate + _dot(out["logit_scale"], grads.scalars[0])
        if len(grads.scalars) > 1:
            surrogate = surrogate + _dot(out["logit_bias"], grads.scalars[1])
    return surrogate


def cached_step(
    engine,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: ContrastiveLoss,
    *,
    micro_batch_seeds: Sequence[int] | None = None,
    caption: CaptionLoss | None = None,
    teacher: Teacher | None = None,
    image_normalize: tuple[Sequence[float], Sequence[float]] | None = None,
    aux: AuxTerms | None = None,
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
    ``caption.contrastive_weight`` x the contrastive loss + the caption term of ``ds_clip.step.caption``.

    ``teacher`` (--distill-model; the loss must distil): embeds each micro-batch once, in phase 1 under no_grad
    (micro-batch 0 too, never in the recompute); its embeddings enter the loss as constants.

    ``aux`` (--siglip2; ``ds_clip.step.aux``): the forward's per-sample terms join the objective, each a mean over
    the global batch; ``StepResult.parts`` gives each one's value.

    ``image_normalize`` ((mean, std); ``TrainData.image_normalize``): the images are uint8 (--decode fast) and
    are normalised on the device as torchvision's ToTensor + Normalize would (``normalize_images``).
    """
    sizes = check_step_call(engine, micro_batches, loss_fn, micro_batch_seeds)  # host sync 1 (W > 1)
    plan = Plan.decide(engine, loss_fn, sizes, micro_batch_seeds, caption, teacher, image_normalize, aux)
    # The phases are named ranges in torch.profiler (and in Nsight Systems under torch.autograd.profiler.emit_nvtx):
    # where a step's time goes (benchmarks/bench_exactness_cost.py --phases). Without a profiler a range costs
    # microseconds.
    with record_function("ds_clip.step.embed"):
        cache = _embed(engine, micro_batches, plan)
    scale_out, rng_after, center_total = cache.out0["logit_scale"], cache.rng_after, cache.center_total
    with record_function("ds_clip.step.loss"):
        grads = _full_batch_grads(cache, loss_fn, plan)  # host sync 2: the finiteness flag
    if grads is not None:
        with record_function("ds_clip.step.push_back"):
            _push_back(engine, micro_batches, plan, cache, grads)
    # Micro-batch 0's outputs (a CoCa decoder's logits among them) are not held through the optimizer step.
    del cache
    rng_after.restore()
    if grads is None:  # not finite on some rank: no rank ran a backward, every rank skips the update
        nan = torch.tensor(float("nan"))
        scale = scale_out.detach().float().reshape(())
        return StepResult(nan, scale, local_samples=sum(sizes), micro_batches=plan.k, skipped=True)
    # The LR this update trains with: engine.step() moves the scheduler on, and the optimizer then holds the next
    # step's LR. A Python float in the param groups (no host sync).
    lr = float(engine.get_lr()[0])
    with record_function("ds_clip.step.optimizer"):
        engine.step()
    if plan.coalesce:
        # Managed mode counts train_batch_size = m·W samples per step(); this step trained k·m·W.
        engine.global_samples += (plan.k - 1) * engine.train_batch_size()
    # False only when DeepSpeed's fp16 loss scaler found an overflow and skipped the update (and, as for
    # ds_clip's own skip, did not advance the LR scheduler). A Python bool: no host sync.
    applied = engine.was_step_applied()
    return StepResult(
        grads.value.detach(),
        scale_out.detach().float().reshape(()),
        local_samples=sum(sizes),
        micro_batches=plan.k,
        skipped=not applied,
        overflow=not applied,
        lr=lr,
        parts=grads.parts,
        aux_center=center_total,
    )

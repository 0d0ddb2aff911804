"""Train the same steps under different (W ranks, k micro-batches) splits: the runs the equivalence tests,
the equivalence report, the GPU check and the benchmarks share. Every run builds its model, engine and step
with ``ds_clip.training.wiring`` from ``ds-clip-train`` flags, so what is proven is what the trainer builds and
trains from the shipped presets: DeepSpeed's config-built AdamW (CPU Adam under offload), the LR schedule, the
resolved JSON, the cached step with its seeds and the logit-scale clamp.

Generated data is assigned by *global sample index*: optimizer step s trains samples
``s·N + [0, N)`` with N = W·k·m, and global micro-batch g (rank r, micro-batch j, g = r·k + j) holds
samples ``s·N + g·m + [0, m)``. Stochastic layers are seeded from (seed, s, g). So any split with
the same W·k·m trains the same pairs with the same dropout masks in every step, and the cached
step must make them agree to float rounding.

``run_in_group`` runs inside an initialised process group (every rank calls it); ``groups.spawn_group``
starts W local processes over gloo and runs many specs in one process group (``run_many``), because a
DeepSpeed start costs seconds to minutes on a CPU machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_clip import distributed
from ds_clip.step.loss import LossSpec


@dataclass
class RunSpec:
    """One training run of a few steps on generated data."""

    model: str
    """open_clip model name or local-dir:PATH."""
    micro_batch_size: int
    accum_freq: int
    steps: int
    zero_stage: int = 0
    precision: str = "fp32"
    offload: bool = False
    """Optimizer state (and with ZeRO-3 parameters) offloaded to the CPU."""
    loss: LossSpec = field(default_factory=LossSpec)
    grad_checkpointing: bool = False
    lr: float = 1e-3
    eps: float = 1e-8
    seed: int = 0
    capture_grads: bool = False
    """Record the full-batch gradient of every parameter at the first step (as DeepSpeed holds it)."""
    nan_at: tuple[int, int] | None = None
    """(step, rank): feed NaN images to that rank's first micro-batch at that step (fault tests)."""
    count_collectives: bool = False
    """Count DeepSpeed collectives per step with DeepSpeed's comms logger."""
    coalesce: str = "off"
    """--coalesce-grad-reduction: "on" reduces gradients once per step on ZeRO 1-3."""
    lock_image: bool = False
    """--lock-image (LiT): the image tower frozen, as open_clip locks it."""
    lock_text: bool = False
    """--lock-text --lock-text-freeze-layer-norm: the text tower frozen."""
    torchcompile: bool = False
    """--torchcompile: the model compiled (DeepSpeed's engine.compile, inductor)."""
    varied_captions: bool = False
    """Captions of different lengths (2 .. context_length - 1 tokens before the end token), for the CoCa
    caption term, whose normaliser is the token count."""
    distill_model: str | None = None
    """--distill-model: a frozen teacher (local-dir: with weights); the loss is open_clip's DistillClipLoss."""
    ema_decay: float | None = None
    """--ema-decay: keep the weight EMA (ds_clip.step.ema) beside the masters; the result holds it whole, and the EMA
    of the whole fp32 masters after every applied step computed in one place (``ema_reference``)."""
    ema_warmup: bool = False
    """--ema-warmup (timm ModelEmaV3's warm-up of the decay)."""
    optimizer: str = "adamw"
    """--opt (adamw, muon, ...)."""
    siglip2: bool = False
    """--siglip2, its self-supervised terms from step 1 (the second) on, small heads and two local views (the
    terms and their arithmetic as at the defaults, in less time), a teacher momentum that moves it visibly."""
    name: str = ""


@dataclass
class RunResult:
    spec: RunSpec
    world_size: int
    losses: list[float]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor] | None = None
    collectives: dict[str, dict[int, int]] | None = None
    """DeepSpeed collective calls in the last optimizer step: op name -> message bytes -> calls."""
    num_params: int = 0
    skipped: list[bool] = field(default_factory=list)
    """Per step: was the update skipped for a non-finite value."""
    ema: dict[str, torch.Tensor] | None = None
    """The sharded weight EMA assembled whole (``WeightEma.full_state``), with ``spec.ema_decay``."""
    ema_reference: dict[str, torch.Tensor] | None = None
    """The same average computed from the whole fp32 masters after every applied step (timm's rule)."""
    ema_probe: dict[str, Any] | None = None
    teacher: dict[str, torch.Tensor] | None = None
    """--siglip2: the EMA teacher's state (its modules and both centers) after the run."""
    parts: list[dict[str, float]] = field(default_factory=list)
    """--siglip2: each step's objective terms (``StepResult.parts``)."""
    """A probe batch embedded (eval mode) by the live engine, inside ``WeightEma.swapped_in()``, and live again
    after it: {"inputs": (images, texts), "live", "ema", "live_after": (image, text features)}."""

    def gradient_reduction_passes(self) -> float:
        """Gradient bytes reduced in one step / the model's gradient bytes (fp32 models).

        Counting bytes rather than calls makes the figure independent of DeepSpeed's bucketing;
        small messages (loss-scale and norm checks) are left out.
        """
        reduced = sum(
            size * calls
            for op in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_fn", "reduce")
            for size, calls in (self.collectives or {}).get(op, {}).items()
            if size > 1024
        )
        return reduced / (4 * self.num_params)


def generated_pairs(
    indices: Sequence[int],
    *,
    image_size: int,
    context_length: int,
    vocab_size: int,
    seed: int = 0,
    varied_lengths: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image-text pairs defined by global sample index alone (16 latent classes, so the loss can fall).
    ``varied_lengths``: caption lengths differ by sample (else all are context_length // 2)."""
    images, texts = [], []
    for idx in indices:
        g = torch.Generator().manual_seed(seed * 7_919 + int(idx))
        cls = int(idx) % 16
        proto = torch.Generator().manual_seed(seed * 104_729 + cls)
        image = torch.randn(3, image_size, image_size, generator=proto) + 0.5 * torch.randn(
            3, image_size, image_size, generator=g
        )
        length = max(2, context_length // 2)
        if varied_lengths:
            length = 2 + (int(idx) * 3) % (context_length - 2)  # 2 .. context_length - 1, then the end token
        tokens = torch.randint(1, vocab_size - 1, (length,), generator=proto)
        noise = torch.rand(length, generator=g) < 0.2
        tokens[noise] = torch.randint(1, vocab_size - 1, (int(noise.sum()),), generator=g)
        text = torch.zeros(context_length, dtype=torch.long)
        text[:length] = tokens
        text[length] = vocab_size - 1  # an "end" token with the largest id: open_clip pools at argmax
        images.append(image)
        texts.append(text)
    return torch.stack(images), torch.stack(texts)


def step_micro_batches(
    spec: RunSpec, model_cfg: dict, step: int, rank: int, world_size: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """This rank's k micro-batches of step ``step`` and their global micro-batch indices."""
    m, k = spec.micro_batch_size, spec.accum_freq
    n = world_size * k * m
    vision, text = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    size = vision["image_size"] if isinstance(vision["image_size"], int) else vision["image_size"][0]
    batches, ids = [], []
    for j in range(k):
        g = rank * k + j
        start = step * n + g * m
        batches.append(
            generated_pairs(
                range(start, start + m),
                image_size=size,
                context_length=text.get("context_length", 77),
                vocab_size=text.get("vocab_size", 49408),
                seed=spec.seed,
                varied_lengths=spec.varied_captions,
            )
        )
        ids.append(g)
    return batches, ids


# A schedule this long is flat over a few test steps (cosine(3e-6 pi) = 1 - 4e-11): the runs compare
# arithmetic, not schedules, and both splits see the same LR anyway.
FLAT_SCHEDULE_STEPS = 10**6


def train_argv(spec: RunSpec, preset_dir: str | None = None) -> list[str]:
    """The ``ds-clip-train`` flags that build the engine of ``spec`` (the shipped presets; a temporary
    preset with DeepSpeed's comms logger on when ``count_collectives``)."""
    if spec.offload:
        preset = f"zero{max(spec.zero_stage, 2)}_offload_{spec.precision}"
    else:
        preset = f"zero{spec.zero_stage}_{spec.precision}"
    if spec.count_collectives:
        assert preset_dir is not None
        from ds_clip.ds_config.resolve import load_preset

        cfg = load_preset(preset)
        cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
        path = os.path.join(preset_dir, f"{preset}_comms.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        preset = path
    argv = [
        "--model", spec.model, "--batch-size", str(spec.micro_batch_size), "--accum-freq", str(spec.accum_freq),
        "--ds-config", preset, "--zero-stage", str(spec.zero_stage), "--precision", spec.precision,
        "--lr", repr(spec.lr), "--eps", repr(spec.eps), "--beta1", "0.9", "--beta2", "0.98", "--wd", "0",
        "--warmup", "0", "--seed", str(spec.seed), "--workers", "0", "--loss-impl", spec.loss.impl,
        "--loss-tile-size", str(spec.loss.tile_size),
        "--coalesce-grad-reduction", spec.coalesce, "--opt", spec.optimizer,
    ]  # fmt: skip
    if spec.loss.siglip:
        argv.append("--siglip")
    if spec.loss.local_loss:
        argv.append("--local-loss")
    if spec.loss.gather_with_grad:
        argv.append("--gather-with-grad")
    if spec.grad_checkpointing:
        argv.append("--grad-checkpointing")
    if spec.lock_image:
        argv.append("--lock-image")
    if spec.lock_text:
        argv += ["--lock-text", "--lock-text-freeze-layer-norm"]
    if spec.torchcompile:
        argv.append("--torchcompile")
    if spec.distill_model:
        argv += ["--distill-model", spec.distill_model]
    if spec.ema_decay is not None:
        argv += ["--ema-decay", repr(spec.ema_decay)] + (["--ema-warmup"] if spec.ema_warmup else [])
    if spec.siglip2:
        argv += ["--siglip2", *SIGLIP2_TEST_FLAGS, "--siglip2-selfsup-start", repr(1.5 / FLAT_SCHEDULE_STEPS)]
    return argv


SIGLIP2_TEST_FLAGS = (
    "--siglip2-prototypes", "256", "--siglip2-patch-prototypes", "64", "--siglip2-local-views", "2",
    "--siglip2-teacher-momentum", "0.5",
)  # fmt: skip
"""Sizes that keep a CPU test short (the defaults' 65536 prototypes and eight views change no arithmetic)."""


class _GradProbe:
    """Records DeepSpeed's reduced full gradients at the first optimizer step.

    It wraps the step of the engine's basic optimizer (the torch or CPU Adam that DeepSpeed built from the
    config): DeepSpeed calls it after the gradient reduction (for ZeRO, inside its own step), the one
    moment the final averaged gradient exists on every stage. Every rank assembles every parameter's
    gradient (collectives in the same order). Observation only: the wrapped step runs unchanged.
    """

    def __init__(self, engine):
        self.engine = engine
        self.captured: dict[str, torch.Tensor] | None = None
        optimizer = engine.basic_optimizer
        inner_step = optimizer.step

        def step(*args, **kwargs):
            self.capture()
            return inner_step(*args, **kwargs)

        optimizer.step = step

    def capture(self) -> None:
        from deepspeed.utils import safe_get_full_grad

        opt = self.engine.optimizer
        names = {id(p): n for n, p in self.engine.module.named_parameters()}
        if self.captured is None:
            self.captured = {}
            self._groups_done: set[int] = set()
            if not hasattr(opt, "single_partition_of_fp32_groups"):
                for n, p in self.engine.module.named_parameters():
                    if not p.requires_grad:  # locked: no gradient anywhere (ZeRO-3 holds no optimizer for it)
                        continue
                    g = safe_get_full_grad(p)
                    self.captured[n] = g.detach().float().clone().cpu() if g is not None else None
                return
        if not hasattr(opt, "single_partition_of_fp32_groups"):
            return
        # ZeRO-1/2 step one parameter group at a time, each with only its own gradient present.
        for i, flat in enumerate(opt.single_partition_of_fp32_groups):
            if flat.grad is None or i in self._groups_done:
                continue
            self._groups_done.add(i)
            for p in opt.bit16_groups[i]:
                self.captured[names[id(p)]] = self._zero12_grad(p, flat).cpu()

    @staticmethod
    def _zero12_grad(p, flat: torch.Tensor) -> torch.Tensor:
        # ZeRO-1/2 have already moved the reduced gradient into the flat fp32 partition that the
        # optimizer steps (DeepSpeed's own accessor refuses at this point): read each rank's
        # fragment from there and sum the fragments over the ranks (ds_clip runs data parallel only).
        buf = torch.zeros(p.numel(), dtype=torch.float32)
        m = p._hp_mapping
        if m is not None:
            frag = flat.grad.narrow(0, m.hp_fragment_address.start, m.hp_fragment_address.numel)
            buf.narrow(0, m.lp_fragment_address.start, m.lp_fragment_address.numel).copy_(frag.float().cpu())
        return distributed.all_reduce_sum(buf).view(p.shape)


def full_params(engine) -> dict[str, torch.Tensor]:
    """fp32 master weights of every parameter, on every rank, in open_clip's names and shapes."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            # A locked parameter has no optimizer (no fp32 master): its value is the module's own, gathered
            # under ZeRO-3 (a collective: every rank, same order).
            with deepspeed.zero.GatheredParameters([p]):
                out[n] = p.data.detach().float().clone().cpu()
            continue
        v = safe_get_full_fp32_param(p)
        if v is None:  # ZeRO-0 without a separate master copy
            v = p.data
        out[n] = v.detach().float().clone().cpu()
    return out


def full_masters(engine) -> dict[str, torch.Tensor]:
    """The whole fp32 master of every trained parameter (ZeRO-0 bf16's included), on every rank."""
    from ds_clip.step.clamp import full_fp32_master

    return {n: full_fp32_master(engine, n) for n, p in engine.module.named_parameters() if p.requires_grad}


def run_in_group(spec: RunSpec) -> RunResult:
    """Train ``spec`` on every rank of the current process group; every rank returns the result.

    The model, engine, loss and step are ``ds_clip.training.wiring.build_run_step``'s from the flags of
    ``train_argv(spec)``: the step ``ds-clip-train`` trains (the cached step, then open_clip's logit-scale clamp,
    then the weight EMA)."""
    import torch.distributed as dist

    from ds_clip.config import parse_settings
    from ds_clip.step.ema import EmaSchedule
    from ds_clip.training.wiring import build_run_step

    rank, world_size = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as preset_dir:
        s = parse_settings(train_argv(spec, preset_dir))
        run = build_run_step(s, world_size=world_size, rank=rank, total_steps=FLAT_SCHEDULE_STEPS)
    engine, ema, bundle = run.engine, run.ema, run.bundle
    probe = _GradProbe(engine) if spec.capture_grads else None
    full_params_at_start = full_masters(engine) if ema is not None else {}
    schedule = EmaSchedule.from_settings(s.ema)
    reference: dict[str, torch.Tensor] | None = None
    applied = 0
    engine.train()
    losses, per_step_ops, skipped, parts = [], [], [], []
    comms = None
    if spec.count_collectives:
        from deepspeed import comm as ds_comm

        comms = ds_comm.comms_logger
    for step in range(spec.steps):
        batches, gids = step_micro_batches(spec, bundle.model_cfg, step, rank, world_size)
        if spec.nan_at == (step, rank):
            batches[0] = (torch.full_like(batches[0][0], float("nan")), batches[0][1])
        before = _op_counts(comms) if comms is not None else None
        # Seeded from (seed, step, g) as the trainer seeds its micro-batches; this loop's step counts batches.
        res = run.train(batches, step=step, micro_batch_ids=gids)
        if comms is not None:
            after = _op_counts(comms)
            per_step_ops.append(
                {
                    op: {size: n - before.get(op, {}).get(size, 0) for size, n in sizes.items()}
                    for op, sizes in after.items()
                }
            )
        losses.append(float(res.loss))
        skipped.append(res.skipped)
        if res.parts is not None:
            parts.append({k: float(v) for k, v in res.parts.items()})
        if not res.skipped:
            applied += 1
            if run.after_update(applied) and schedule is not None:
                # The rule on whole tensors, in one place: what the sharded average must equal.
                masters = full_masters(engine)
                weight = 1.0 - schedule.decay_at(applied)
                if reference is None:
                    reference = {n: full_params_at_start[n].clone() for n in masters}
                for n, v in masters.items():
                    reference[n].lerp_(v, weight)
    params = full_params(engine)
    ema_whole = ema.full_state() if ema is not None else None
    ema_probe = _probe_ema(engine, ema, spec, bundle.model_cfg) if ema is not None else None
    buffers = {
        n: b.detach().float().clone().cpu() for n, b in engine.module.named_buffers() if "running" in n
    }
    result = RunResult(
        spec=spec,
        world_size=world_size,
        losses=losses,
        params=params,
        buffers=buffers,
        grads=probe.captured if probe is not None else None,
        collectives=per_step_ops[-1] if per_step_ops else None,
        num_params=sum(p.numel() for p in params.values()),
        skipped=skipped,
        ema=ema_whole,
        ema_reference=reference,
        ema_probe=ema_probe,
        teacher=_teacher_state(run),
        parts=parts,
    )
    engine.destroy()
    del engine
    return result


def _teacher_state(run) -> dict[str, torch.Tensor] | None:
    rt = run.built.siglip2
    if rt is None:
        return None
    state = {f"modules.{k}": v for k, v in rt.teacher.full_state().items()}  # a collective under ZeRO-3
    state["center_global"] = rt.teacher.center_global.cpu().clone()
    state["center_patch"] = rt.teacher.center_patch.cpu().clone()
    return state


def _probe_ema(engine, ema, spec: RunSpec, model_cfg: dict) -> dict[str, Any]:
    """Embed one probe batch (the same on every rank) live, with the EMA swapped in, and live again."""
    from ds_clip.evaluate import engine_forward

    (batch,), _ = step_micro_batches(replace(spec, accum_freq=1), model_cfg, 10_000, 0, 1)
    forward = engine_forward(engine)

    def embed() -> tuple[torch.Tensor, torch.Tensor]:
        out = forward(image=batch[0], text=batch[1])
        if not isinstance(out, dict):
            out = {"image_features": out[0], "text_features": out[1]}
        return out["image_features"].float().cpu().clone(), out["text_features"].float().cpu().clone()

    engine.eval()
    with torch.no_grad():
        live = embed()
        with ema.swapped_in():
            averaged = embed()
        live_after = embed()
    engine.train()
    return {"inputs": batch, "live": live, "ema": averaged, "live_after": live_after}


def _op_counts(comms_logger) -> dict[str, dict[int, int]]:
    return {
        op: {size: v[0] for size, v in by_size.items()} for op, by_size in comms_logger.comms_dict.items()
    }


def run_many(specs: Sequence[RunSpec]) -> list[RunResult]:
    """Every rank runs every spec in order (one DeepSpeed engine at a time, one process group)."""
    return [run_in_group(s) for s in specs]


def replace(spec: RunSpec, **changes: Any) -> RunSpec:
    return dataclasses.replace(spec, **changes)

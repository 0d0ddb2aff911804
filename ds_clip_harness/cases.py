"""The equivalence matrix: which (model, ZeRO stage, precision, loss, options) cases are proven, and the
``RunSpec`` each case trains with k micro-batches. Shared by tests/test_equivalence.py and
scripts/equivalence_report.py."""

from __future__ import annotations

from dataclasses import dataclass

from ds_clip.step.loss import LossSpec
from ds_clip_harness.runs import RunSpec

M = 2  # pairs per micro-batch
# BatchNorm normalises with the statistics of each micro-batch; over 2 samples that is ill-conditioned
# enough to amplify fp32 rounding past 1e-5, so the BatchNorm tower gets 4.
BN_M = 4
STEPS = 3
# AdamW turns float noise into full-size updates where the true gradient is ~0 (attention key
# biases get exactly zero gradient: softmax ignores them). eps=1e-4 sits below the typical gradient
# entry of these models (1e-3..1e-1) so real gradients still get Adam's normalised update (a
# gradient counted twice changes the update wherever |g| is near eps), while rounding noise of
# ~1e-9 moves a parameter by at most lr*1e-5.
ADAM = {"lr": 1e-3, "eps": 1e-4}
# A decay this low moves the average visibly in 3 steps (the first update copies the weights, as timm's does).
EMA_DECAY = 0.5

GLOBAL = LossSpec()
GLOBAL_GWG = LossSpec(gather_with_grad=True)
LOCAL = LossSpec(local_loss=True, gather_with_grad=True)
SIGLIP = LossSpec(siglip=True)
TILED = LossSpec(impl="tiled", tile_size=3)
TILED_LOCAL = LossSpec(local_loss=True, gather_with_grad=True, impl="tiled", tile_size=3)
TILED_SIGLIP = LossSpec(siglip=True, impl="tiled", tile_size=3)


@dataclass(frozen=True)
class Case:
    model: str
    zero_stage: int
    precision: str = "fp32"
    loss: LossSpec = GLOBAL
    offload: bool = False
    grad_checkpointing: bool = False
    lock_image: bool = False
    coalesce: bool = False
    """--coalesce-grad-reduction on: one gradient reduction per step (ZeRO 1-3)."""
    distill: bool = False
    """--distill-model (the TEACHER folder): open_clip's DistillClipLoss, dense or tiled as ``loss`` says."""
    ema: bool = False
    """--ema-decay EMA_DECAY: the weight EMA kept beside the masters (it does not change the training)."""
    optimizer: str = "adamw"
    """--opt: "muon" is DeepSpeed's Muon on the towers' hidden matrices with its AdamW on the rest."""
    siglip2: bool = False
    """--siglip2 with its self-supervised terms from the second step on (the switch inside the run)."""

    @property
    def name(self) -> str:
        loss = "siglip" if self.loss.siglip else ("local" if self.loss.local_loss else "global")
        if self.loss.gather_with_grad and not self.loss.local_loss:
            loss += "-gwg"
        if self.loss.impl == "tiled":
            loss += "-tiled"
        extra = ("-offload" if self.offload else "") + ("-ckpt" if self.grad_checkpointing else "")
        extra += "-lock-image" if self.lock_image else ""
        extra += "-coalesce" if self.coalesce else ""
        extra += "-distill" if self.distill else ""
        extra += "-ema" if self.ema else ""
        extra += f"-{self.optimizer}" if self.optimizer != "adamw" else ""
        extra += "-siglip2" if self.siglip2 else ""
        return f"{self.model}-z{self.zero_stage}-{self.precision}-{loss}{extra}"


def _matrix() -> list[Case]:
    cases = []
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            # The weight EMA rides along on the plain cases: sharded like the masters of every stage.
            cases.append(Case("vit", stage, precision, GLOBAL, ema=True))
            cases.append(Case("vit", stage, precision, LOCAL))
            cases.append(Case("vit_siglip", stage, precision, SIGLIP))
    cases += [Case("vit", stage, "fp32", GLOBAL, offload=True, ema=True) for stage in (1, 2, 3)]
    cases += [Case("vit", stage, "fp32", GLOBAL, grad_checkpointing=True) for stage in (0, 3)]
    cases += [Case("vit", 2, "fp32", GLOBAL_GWG)]
    cases += [
        Case("vit", 0, "fp32", TILED),
        Case("vit", 2, "fp32", TILED),
        Case("vit", 3, "fp32", TILED_LOCAL),
    ]
    cases += [Case("vit_siglip", 1, "fp32", TILED_SIGLIP)]
    cases += [Case("timm_dropout", stage, "fp32", GLOBAL) for stage in (0, 3)]
    cases += [Case("resnet_bn", stage, "fp32", GLOBAL) for stage in (0, 2)]
    # LiT: a pretrained image tower locked (not recomputed in phase 3), the text tower trained.
    cases += [Case("lit", stage, "fp32", GLOBAL, lock_image=True) for stage in (1, 3)]
    # One gradient reduction per step (engine.coalesce_grad_reduction() around the k backwards).
    cases += [Case("vit", stage, "fp32", GLOBAL, coalesce=True) for stage in (1, 2, 3)]
    # CoCa: contrastive + caption (captions of different lengths), the caption mean over the global batch.
    cases += [Case("coca", stage, "fp32", GLOBAL) for stage in range(4)]
    cases += [
        Case("coca", 2, "bf16", GLOBAL),
        Case("coca", 1, "fp32", TILED),
        Case("coca", 3, "fp32", GLOBAL, lock_image=True),
    ]
    # Distillation (a frozen teacher, open_clip's DistillClipLoss): dense on every stage, tiled (global and
    # local rows), and the teacher in bf16 with a bf16 engine.
    cases += [Case("vit", stage, "fp32", GLOBAL, distill=True) for stage in range(4)]
    cases += [Case("vit", 1, "fp32", TILED, distill=True), Case("vit", 3, "fp32", TILED_LOCAL, distill=True)]
    cases += [Case("vit", 2, "bf16", GLOBAL, distill=True)]
    # Muon (DeepSpeed's MuonWithAuxAdam): its gradient is the full-batch gradient under --accum-freq like every
    # optimizer's. ZeRO-0 only: under ZeRO 1-2 DeepSpeed's Muon path changes what the gradient probe reads.
    cases += [Case("vit", 0, "fp32", GLOBAL, optimizer="muon")]
    # SigLIP 2's objective (decoder, self-distillation, masked prediction against the EMA teacher) on every stage,
    # ZeRO-3 with activation checkpointing; the self-supervised terms join at the second of the three steps.
    cases += [Case("vit_siglip", stage, "fp32", SIGLIP, siglip2=True) for stage in (0, 1, 2)]
    cases += [Case("vit_siglip", 3, "fp32", SIGLIP, siglip2=True, grad_checkpointing=True)]
    cases += [Case("vit_siglip", 2, "bf16", SIGLIP, siglip2=True)]
    return cases


def fp16_supported() -> bool:
    # DeepSpeed's CPU accelerator runs fp16 only where the CPU has AVX512-FP16 (it answers None
    # otherwise); on a GPU it is True.
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def fp16_cases_run() -> bool:
    """Where the fp16 equivalence cases run: a GPU. On a CPU with AVX512-FP16 every one of a case's 3 steps
    overflows at the presets' initial loss scale 2^16 (ds-clip-tiny skips 5 steps before its first applied one),
    so the cases would check no optimizer step; the fp16 presets and users' fp16 files still train there
    (tests/test_install.py, tests/test_public_ds_configs.py)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() != "cpu" and fp16_supported()


FP16_CASES = [Case("vit", stage, "fp16", GLOBAL) for stage in (1, 2, 3)]
CASES = _matrix() + (FP16_CASES if fp16_cases_run() else [])
# The oracle is open_clip's loss on the whole batch: SigLIP 2's other terms are proven by the (W, k) splits.
FP32_CASES = [c for c in CASES if c.precision == "fp32" and not c.siglip2]
SIGLIP2_CASES = [c for c in CASES if c.siglip2]
EMA_CASES = [c for c in CASES if c.ema]
BF16_CASES = [c for c in CASES if c.precision == "bf16" and not c.siglip2]


def spec_for(case: Case, models: dict[str, str], k: int) -> RunSpec:
    return RunSpec(
        model=models[case.model],
        micro_batch_size=BN_M if case.model == "resnet_bn" else M,
        accum_freq=k,
        steps=STEPS,
        zero_stage=case.zero_stage,
        precision=case.precision,
        offload=case.offload,
        loss=case.loss,
        grad_checkpointing=case.grad_checkpointing,
        lock_image=case.lock_image,
        coalesce="on" if case.coalesce else "off",
        varied_captions=case.model == "coca",
        distill_model=models["teacher"] if case.distill else None,
        ema_decay=EMA_DECAY if case.ema else None,
        optimizer=case.optimizer,
        siglip2=case.siglip2,
        capture_grads=not case.siglip2,
        name=case.name,
        **ADAM,
    )

"""The gradient contract, on the real DeepSpeed engine in several processes over gloo.

Two process groups are started for the whole module (a DeepSpeed start costs seconds to minutes on
a CPU machine): 2 ranks running every case with k=2 micro-batches, and 4 ranks running every case
with k=1. Each case trains 3 AdamW steps on generated data assigned by global sample index, with
stochastic layers seeded per global micro-batch, and records DeepSpeed's reduced gradient at step 0.
The single-process oracle runs open_clip's own ClipLoss / SigLipLoss on the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ds_clip.equivalence import RunSpec, oracle_first_step, run_many, spawn_group
from ds_clip.loss import LossSpec
from tests.models import write_model_dirs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

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
ADAM = {"optimizer": "adamw", "lr": 1e-3, "eps": 1e-4}

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

    @property
    def name(self) -> str:
        loss = "siglip" if self.loss.siglip else ("local" if self.loss.local_loss else "global")
        if self.loss.gather_with_grad and not self.loss.local_loss:
            loss += "-gwg"
        if self.loss.impl == "tiled":
            loss += "-tiled"
        extra = ("-offload" if self.offload else "") + ("-ckpt" if self.grad_checkpointing else "")
        return f"{self.model}-z{self.zero_stage}-{self.precision}-{loss}{extra}"


def _matrix() -> list[Case]:
    cases = []
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            cases.append(Case("vit", stage, precision, GLOBAL))
            cases.append(Case("vit", stage, precision, LOCAL))
            cases.append(Case("vit_siglip", stage, precision, SIGLIP))
    cases += [Case("vit", stage, "fp32", GLOBAL, offload=True) for stage in (1, 2, 3)]
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
    return cases


def fp16_supported() -> bool:
    # DeepSpeed's CPU accelerator runs fp16 only where the CPU has AVX512-FP16 (it answers None
    # otherwise); on a GPU it is True.
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


FP16_CASES = [Case("vit", stage, "fp16", GLOBAL) for stage in (1, 2, 3)]
CASES = _matrix() + (FP16_CASES if fp16_supported() else [])
FP32_CASES = [c for c in CASES if c.precision == "fp32"]
BF16_CASES = [c for c in CASES if c.precision == "bf16"]


def _spec(case: Case, models: dict[str, str], k: int) -> RunSpec:
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
        capture_grads=True,
        name=case.name,
        **ADAM,
    )


# Collective counts: one extra short run per stage and k, without the gradient probe.
COUNT_KS = (1, 4)


def _count_spec(models: dict[str, str], stage: int, k: int) -> RunSpec:
    return RunSpec(
        model=models["vit"],
        micro_batch_size=M,
        accum_freq=k,
        steps=2,
        zero_stage=stage,
        count_collectives=True,
        name=f"count-z{stage}-k{k}",
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return write_model_dirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def runs(models):
    """{(name, W): RunResult} for every case on 2 ranks x k=2 and 4 ranks x k=1."""
    w2_specs = [_spec(c, models, k=2) for c in CASES]
    w2_specs += [_count_spec(models, s, k) for s in range(4) for k in COUNT_KS]
    w2_specs += [_bn_spec(models, s) for s in (0, 2)]
    w2_specs += [spec for s in NAN_STAGES for spec in _nan_specs(models, s)]
    w4_specs = [_spec(c, models, k=1) for c in CASES]
    out = {}
    for r in spawn_group(2, run_many, w2_specs):
        out[(r.spec.name, 2)] = r
    for r in spawn_group(4, run_many, w4_specs):
        out[(r.spec.name, 4)] = r
    return out


@pytest.fixture(scope="module")
def oracles(models):
    cache: dict[str, tuple[dict, float]] = {}

    def get(case: Case):
        if case.name not in cache:
            spec = _spec(case, models, k=2)
            cache[case.name] = oracle_first_step(spec, world_size=2)
        return cache[case.name]

    return get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.reshape(b.shape) - b).norm() / b.norm())


def _oracle_errors(result, oracle_grads, floor: float) -> dict[str, float]:
    """Per-parameter error ||g - g_oracle|| / max(||g_oracle||, floor * ||total oracle gradient||).

    The floor matters only for parameters whose true gradient nearly cancels (attention key biases
    get exactly 0, attention-pool q/k projections ~1e-6 of the total at init): there the bare
    relative error measures float noise, not the step. Every other parameter is held to its own norm.
    """
    total = float(torch.sqrt(sum(g.pow(2).sum() for g in oracle_grads.values())))
    return {
        name: float((result.grads[name].reshape(g.shape) - g).norm()) / max(float(g.norm()), floor * total)
        for name, g in oracle_grads.items()
    }


@pytest.mark.parametrize("case", FP32_CASES, ids=lambda c: c.name)
def test_fp32_step_matches_single_process_full_batch(case, runs, oracles):
    """W=2 ranks x k=2 micro-batches: DeepSpeed's reduced gradient at step 0 equals the gradient of
    open_clip's own loss on the whole N=8 batch in one process, for every parameter including
    logit_scale and logit_bias (fp32: relative error <= 1e-5). Catches temperature counted k or W
    times, missing W scaling, dropped micro-batches, dropout masks that differ between passes."""
    oracle_grads, oracle_loss = oracles(case)
    result = runs[(case.name, 2)]
    assert result.losses[0] == pytest.approx(oracle_loss, rel=1e-5)
    errors = _oracle_errors(result, oracle_grads, floor=1e-3)
    assert errors["logit_scale"] <= 1e-5
    if case.loss.siglip:
        assert errors["logit_bias"] <= 1e-5
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.name)
def test_bf16_step_matches_single_process_full_batch(case, runs, oracles):
    """bf16 engine vs the fp32 oracle. bf16 keeps 8 significant bits (relative rounding 2^-9 per
    operation); through two encoder layers, the bf16 embeddings and the bf16 logit_scale the
    gradient picks up a few such roundings, so the per-parameter relative error bound is 3e-2: still
    far below the factor-of-2 errors a miscounted temperature or rank scaling would cause."""
    oracle_grads, oracle_loss = oracles(case)
    result = runs[(case.name, 2)]
    assert result.losses[0] == pytest.approx(oracle_loss, rel=2e-2)
    errors = _oracle_errors(result, oracle_grads, floor=1e-2)
    worst = max(errors, key=errors.get)
    assert errors["logit_scale"] <= 3e-2
    if case.loss.siglip:
        assert errors["logit_bias"] <= 3e-2
    assert errors[worst] <= 3e-2, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("case", FP16_CASES, ids=lambda c: c.name)
def test_fp16_step_matches_single_process_full_batch(case, runs, oracles):
    """fp16 (ZeRO 1-3; ZeRO-0 fp16 is refused) vs the fp32 oracle, where the device runs fp16.
    fp16 keeps 11 significant bits (relative rounding 2^-12): bound 1e-2 per parameter; DeepSpeed's
    dynamic loss scale must be undone exactly."""
    if not fp16_supported():
        pytest.skip("this device has no fp16 support in DeepSpeed (a CPU without AVX512-FP16)")
    oracle_grads, _ = oracles(case)
    errors = _oracle_errors(runs[(case.name, 2)], oracle_grads, floor=1e-2)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-2, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_two_ranks_accum2_train_like_four_ranks(case, runs, models):
    """2 ranks x k=2 and 4 ranks x k=1 (same m, same global batch) reach the same parameters after
    3 AdamW steps, and see the same loss at every step: the promise '4 GPUs x accum 2 trains like
    8 GPUs', on this ZeRO stage, precision and loss.

    fp32: every entry agrees to 1% of one AdamW step (lr); a dropped micro-batch, a miscounted
    temperature or unmatched dropout masks move entries by O(lr). bf16: gradients carry ~2^-9
    relative noise, which Adam turns into full-size updates on entries whose true gradient is zero
    (attention key biases); so the difference of the two runs, over the whole model, must stay below
    5% of how far the model moved (in norm). (Single entries cannot be bounded by lr: where ZeRO-0
    keeps no fp32 master, a bf16 weight of 0.5 has a rounding step of 2e-3.)"""
    from ds_clip.model import build_model

    a, b = runs[(case.name, 2)], runs[(case.name, 4)]
    lr = ADAM["lr"]
    if case.precision == "fp32":
        assert a.losses == pytest.approx(b.losses, rel=1e-5)
        for name, pa in a.params.items():
            diff = float((pa - b.params[name]).abs().max())
            assert diff <= 1e-2 * lr, f"{name}: max |diff| {diff:.2e}"
        return
    assert a.losses == pytest.approx(b.losses, rel=3e-2)
    start = dict(build_model(models[case.model], seed=0).model.named_parameters())
    diff2 = moved2 = 0.0
    for name, pa in a.params.items():
        pb, p0 = b.params[name], start[name].detach().reshape(pa.shape)
        diff2 += float((pa - pb).pow(2).sum())
        moved2 += float((pa - p0).pow(2).sum())
    ratio = (diff2 / moved2) ** 0.5
    assert ratio <= 5e-2, f"the two runs differ by {ratio:.1%} of how far the model moved"


@pytest.mark.parametrize("stage", [0, 2])
def test_batchnorm_running_stats_count_each_sample_once(stage, runs, models):
    """A BatchNorm tower (open_clip ModifiedResNet): after one step of k=2 micro-batches, rank 0's
    running statistics equal those of one train-mode pass over its 2 micro-batches in order. The
    no-grad cache pass must not update them; the recompute does, once per micro-batch of m."""
    from ds_clip.equivalence import micro_batch_seed, step_micro_batches
    from ds_clip.model import build_model

    spec = _bn_spec(models, stage)
    bundle = build_model(spec.model, seed=spec.seed)
    ref = bundle.model.train()
    with torch.no_grad():
        batches, gids = step_micro_batches(spec, bundle.model_cfg, 0, 0, 2)
        for (img, _), g in zip(batches, gids):
            torch.manual_seed(micro_batch_seed(spec.seed, 0, g))
            ref.visual(img)
    expected = {n: b.float() for n, b in ref.named_buffers() if "running" in n}
    fresh = {
        n: b.float()
        for n, b in build_model(spec.model, seed=spec.seed).model.named_buffers()
        if "running" in n
    }
    got = runs[(spec.name, 2)].buffers
    assert expected and set(got) == set(expected)
    for name, value in expected.items():
        assert not torch.equal(value, fresh[name]) or "var" in name  # the pass did move them
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _bn_spec(models: dict[str, str], stage: int) -> RunSpec:
    return RunSpec(
        model=models["resnet_bn"],
        micro_batch_size=M,
        accum_freq=2,
        steps=1,
        zero_stage=stage,
        name=f"bn-z{stage}",
    )


@pytest.mark.parametrize("stage", range(4))
def test_gradient_reductions_per_step(stage, runs):
    """Gradient reduction passes per optimizer step (DeepSpeed's comms logger, W=2, k=1 and k=4):
    ZeRO-0 and ZeRO-1 reduce once per step whatever k (engine.step() is the only boundary); ZeRO-2
    and ZeRO-3 keep gradients partitioned between backward passes, so they reduce once per
    micro-batch."""
    for k in COUNT_KS:
        result = runs[(f"count-z{stage}-k{k}", 2)]
        expected = 1 if stage < 2 else k
        assert result.gradient_reduction_passes() == pytest.approx(expected, rel=1e-3), result.collectives


NAN_STAGES = (0, 2, 3)


def _nan_specs(models: dict[str, str], stage: int) -> list[RunSpec]:
    common = dict(model=models["vit"], micro_batch_size=M, accum_freq=2, zero_stage=stage, **ADAM)
    return [
        RunSpec(steps=2, nan_at=(1, 1), name=f"nan-z{stage}", **common),
        RunSpec(steps=1, name=f"nan-ref-z{stage}", **common),
    ]


@pytest.mark.parametrize("stage", NAN_STAGES)
def test_non_finite_step_is_skipped_on_every_rank(stage, runs):
    """A NaN on one rank (rank 1's first micro-batch at step 1) makes every rank skip that update:
    after [step 0, skipped step 1] the parameters equal those after step 0 alone, bit for bit
    (no partial gradient, no optimizer-state or schedule change), and the skip is reported."""
    faulty, ref = runs[(f"nan-z{stage}", 2)], runs[(f"nan-ref-z{stage}", 2)]
    assert faulty.skipped == [False, True]
    for name, p in ref.params.items():
        assert torch.equal(faulty.params[name], p), name

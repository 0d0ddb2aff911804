"""What the step refuses and what it costs the host, on the trainer's own engine (ds_clip.training.engine) over gloo.

One 2-rank process group runs every case (a DeepSpeed start costs seconds here):
- micro-batches of different sizes on different ranks: a clear error naming each rank's sizes, raised on
  every rank before the loss's all-gather (gloo would abort inside the collective, NCCL hang);
- host syncs per optimizer step: the same small number for k = 1, 2, 4 (none per micro-batch);
- an fp16 overflow that DeepSpeed's loss scaler skips is reported as skipped, with the LR schedule held
  (where DeepSpeed runs fp16 on this device);
- --coalesce-grad-reduction: refused (exit 2, naming the flag and the reason) where DeepSpeed does not allow
  it, "auto" falls back there and says so once; coalescing adds no host sync and counts k·m·W samples.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SYNC_KS = (1, 2, 4)
HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")


def fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


class HostReadCounter:
    """Counts reads of a tensor's value into Python made by ds_clip code (the calls that wait for the GPU:
    ``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``...). Observes only: each wrapper calls the original."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> HostReadCounter:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(t, *args, _original=original, _name=name, **kwargs):
                caller = sys._getframe(1)
                module = caller.f_globals.get("__name__", "")
                if module.startswith("ds_clip"):
                    self.calls.append(f"{_name} at {module}:{caller.f_lineno}")
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def _engine(model: str, *extra: str):
    import torch.distributed as dist

    from ds_clip.config import parse_settings
    from ds_clip.training.engine import build_engine, build_model_bundle, resolve_run

    s = parse_settings(["--model", model, "--batch-size", "2", "--workers", "0", *extra])
    bundle = build_model_bundle(s.model, seed=s.data.seed)
    geometry, ds = resolve_run(s, dist.get_world_size())
    built = build_engine(
        bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed,
        rank=dist.get_rank(), total_steps=10,
    )  # fmt: skip
    return bundle, built


def _pairs(bundle, first: int, count: int):
    from ds_clip.data.synthetic import render_pair

    pairs = [render_pair(3, first + i, 32) for i in range(count)]
    return torch.stack([bundle.preprocess_val(im) for im, _ in pairs]), bundle.tokenizer(
        [c for _, c in pairs]
    )


def _group(model: str, fp16_config: str | None) -> dict:
    import torch.distributed as dist

    from ds_clip.step.cached import cached_step
    from ds_clip.step.checks import MicroBatchSizeError

    rank = dist.get_rank()
    out: dict = {}

    bundle, built = _engine(model, "--zero-stage", "2")
    m = 2 if rank == 0 else 3
    try:
        cached_step(built.engine, [_pairs(bundle, 0, m), _pairs(bundle, 10, m)], built.loss_fn)
        out["sizes_error"] = None
    except MicroBatchSizeError as exc:
        out["sizes_error"] = str(exc)

    # The same engine goes on training: the refused step left nothing behind.
    out["syncs"] = {}
    for k in SYNC_KS:
        batches = [_pairs(bundle, 100 * k + rank * 10 + 2 * j, 2) for j in range(k)]
        with HostReadCounter() as counter:
            result = cached_step(built.engine, batches, built.loss_fn)
        out["syncs"][k] = counter.calls
        out.setdefault("skipped", []).append(result.skipped)
    built.engine.destroy()

    # Coalesced reduction (ZeRO-2): the same host syncs, and DeepSpeed's sample counter counts k*m*W.
    bundle, built = _engine(model, "--zero-stage", "2", "--coalesce-grad-reduction", "on")
    out["coalesce_syncs"], out["coalesce_samples"] = {}, []
    for k in SYNC_KS:
        batches = [_pairs(bundle, 100 * k + rank * 10 + 2 * j, 2) for j in range(k)]
        with HostReadCounter() as counter:
            result = cached_step(built.engine, batches, built.loss_fn)
        out["coalesce_syncs"][k] = counter.calls
        out["coalesce_samples"].append(built.engine.global_samples)
        out.setdefault("coalesce_skipped", []).append(result.skipped)
    built.engine.destroy()

    # auto where DeepSpeed does not coalesce (ZeRO-0): built without it, one log line on rank 0 alone.
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    ds_clip_logger = logging.getLogger("ds_clip")
    level = ds_clip_logger.level
    ds_clip_logger.addHandler(handler)
    ds_clip_logger.setLevel(logging.INFO)  # as the trainer's logging set-up does
    try:
        bundle, built = _engine(model, "--zero-stage", "0", "--coalesce-grad-reduction", "auto")
    finally:
        ds_clip_logger.removeHandler(handler)
        ds_clip_logger.setLevel(level)
    from ds_clip import distributed

    logged = [r for r in records if "--coalesce-grad-reduction" in r]
    out["auto_zero0"] = {
        "logged": logged,
        "logged_per_rank": distributed.all_gather_object(len(logged)),
        "managed": built.engine.managed_gradient_accumulation(),
        "samples": None,
    }
    cached_step(built.engine, [_pairs(bundle, rank * 10 + 2 * j, 2) for j in range(2)], built.loss_fn)
    out["auto_zero0"]["samples"] = built.engine.global_samples
    built.engine.destroy()

    if fp16_config is not None:
        bundle, built = _engine(model, "--ds-config", fp16_config, "--precision", "fp16", "--lr", "1e-3")
        lr_before = built.engine.get_lr()[0]
        result = cached_step(built.engine, [_pairs(bundle, rank * 2, 2)], built.loss_fn)
        out["fp16"] = {
            "skipped": result.skipped,
            "overflow": result.overflow,
            "lr_before": lr_before,
            "lr_after": built.engine.get_lr()[0],
        }
        built.engine.destroy()

    out["own_engine"] = _own_engine_cases(model)
    return out


def _own_engine_cases(model_name: str) -> dict:
    """A user's own engine and loss (docs/api.md, "The step in your own loop"): each case builds a fresh model
    and engine with deepspeed.initialize from a DeepSpeed config of the user's, runs one cached step, and
    records the error (type: message) or, where the step trains, whether it was skipped."""
    import deepspeed
    import torch.distributed as dist

    from ds_clip import ContrastiveLoss, LossSpec, cached_step, prepare_for_deepspeed, step_engine_config
    from ds_clip.models.model import build_model
    from ds_clip.step.checks import EngineConfigError
    from ds_clip.step.loss import LossConfigError

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    loss = ContrastiveLoss(LossSpec(), rank=rank, world_size=world)
    fit = step_engine_config(mine)
    # name: (DeepSpeed config, loss, the model's output_dict). raw_zero0 has DeepSpeed's default managed
    # accumulation on, which the step uses only to coalesce, and ZeRO-0 cannot coalesce.
    cases = {
        "gas": ({**mine, "gradient_accumulation_steps": 2}, loss, True),
        "raw_zero0": (mine, loss, True),
        "loss_of_one_rank": (fit, ContrastiveLoss(LossSpec()), True),
        "tuple_model": (fit, loss, False),
        "fit": (fit, loss, True),
    }
    out = {}
    for name, (config, loss_fn, output_dict) in cases.items():
        bundle = build_model(model_name, seed=0)
        bundle.model.output_dict = output_dict
        prepare_for_deepspeed(bundle.model)
        engine, *_ = deepspeed.initialize(
            model=bundle.model, model_parameters=bundle.model.parameters(), config=config
        )
        batches = [_pairs(bundle, rank * 10 + 2 * j, 2) for j in range(2)]
        try:
            out[name] = {"skipped": cached_step(engine, batches, loss_fn).skipped}
        except (EngineConfigError, LossConfigError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("guards")
    (root / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    fp16_config = None
    if fp16_supported():
        # A loss scale of 2^32 overflows fp16 gradients at once: DeepSpeed must skip that update.
        fp16_config = str(root / "zero1_fp16_overflow.json")
        Path(fp16_config).write_text(
            json.dumps({"zero_optimization": {"stage": 1}, "fp16": {"initial_scale_power": 32}})
        )
    return spawn_group(2, _group, f"local-dir:{root}", fp16_config)  # rank 0's results


def test_unequal_micro_batch_sizes_are_refused_naming_each_rank(results):
    """Rank 0 holds micro-batches of 2 pairs, rank 1 of 3: every rank raises MicroBatchSizeError (the group
    would hang otherwise) naming both ranks' sizes, before any collective that needs equal shapes."""
    message = results["sizes_error"]
    assert message is not None
    assert "rank 0: [2, 2]" in message and "rank 1: [3, 3]" in message, message


def test_host_syncs_per_step_do_not_grow_with_k(results):
    """ds_clip's own host reads in one cached step on 2 ranks: the micro-batch size agreement and the
    finiteness agreement, 2 in all, for k = 1, 2 and 4 (none per micro-batch; the loss and logit_scale
    stay tensors until the loop logs them)."""
    assert results["skipped"] == [False] * len(SYNC_KS)
    for k in SYNC_KS:
        assert len(results["syncs"][k]) == 2, (k, results["syncs"][k])


def test_coalesced_reduction_adds_no_host_sync_and_counts_every_sample(results):
    """--coalesce-grad-reduction on (ZeRO-2, DeepSpeed's managed accumulation): the step reads the same 2
    values to the host for k = 1, 2, 4, and DeepSpeed's global_samples advances by k*m*W per step (managed
    mode alone would count m*W: the x-axis of DeepSpeed's monitors and the checkpointed sample count)."""
    assert results["coalesce_skipped"] == [False] * len(SYNC_KS)
    for k in SYNC_KS:
        assert len(results["coalesce_syncs"][k]) == 2, (k, results["coalesce_syncs"][k])
    m, w = 2, 2
    expected, total = [], 0
    for k in SYNC_KS:
        total += k * m * w
        expected.append(total)
    assert results["coalesce_samples"] == expected


def test_coalesce_auto_falls_back_once_where_deepspeed_refuses(results):
    """auto on ZeRO-0: the engine is built without coalescing (unmanaged accumulation, as with off), rank 0
    logs the reason once, rank 1 not at all, and the step still counts k*m*W samples."""
    auto = results["auto_zero0"]
    assert auto["managed"] is False
    assert auto["logged_per_rank"] == [1, 0]
    assert len(auto["logged"]) == 1 and "ZeRO stage 0" in auto["logged"][0], auto["logged"]
    assert auto["samples"] == 2 * 2 * 2


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--zero-stage", "0"], "ZeRO stage 0"),
        (["--ds-config", "{bf16_accum_fp32}", "--precision", "bf16"], "BF16_Optimizer"),
        (["--ds-config", "{unmanaged}"], "managed_gradient_accumulation=false"),
    ],
    ids=["zero0", "bf16-zero1-fp32-accum", "unmanaged-preset"],
)
def test_coalesce_on_is_refused_where_deepspeed_does_not_allow_it(argv, reason, tmp_path, capsys):
    """--coalesce-grad-reduction on where DeepSpeed 0.19.8's coalesce_grad_reduction() raises (ZeRO-0; the
    BF16_Optimizer wrapper it picks for bf16 ZeRO-1 with fp32 gradient accumulation; a preset that turns
    managed accumulation off): ds-clip-train exits 2 before any process starts, with one line naming the flag
    and the reason. auto resolves the same settings to an engine without coalescing."""
    from ds_clip.config import parse_settings, resolve_deepspeed_for, resolve_ds_config
    from ds_clip.train import main

    presets = {
        "bf16_accum_fp32": {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
        "unmanaged": {"zero_optimization": {"stage": 2}, "managed_gradient_accumulation": False},
    }
    paths = {}
    for name, cfg in presets.items():
        paths[name] = str(tmp_path / f"{name}.json")
        Path(paths[name]).write_text(json.dumps(cfg))
    argv = [a.format(**paths) for a in argv]
    assert main([*argv, "--coalesce-grad-reduction", "on"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--coalesce-grad-reduction on" in err and reason in err, err
    auto = parse_settings([*argv, "--coalesce-grad-reduction", "auto"])
    assert resolve_ds_config(auto, world_size=2)["managed_gradient_accumulation"] is False
    assert reason in resolve_deepspeed_for(auto, None).coalesce_fallback


def test_coalesce_on_resolves_managed_accumulation_on_zero_1_to_3():
    """Where DeepSpeed allows it (ZeRO 1-3, fp32/bf16, with optimizer offload too), on and auto resolve the
    engine with managed accumulation (what coalesce_grad_reduction() asserts) and nothing to log; off keeps
    the unmanaged boundary."""
    from ds_clip.config import parse_settings, resolve_deepspeed_for, resolve_ds_config

    for extra in (
        ["--zero-stage", "1"],
        ["--zero-stage", "2", "--precision", "bf16"],
        ["--zero-stage", "3"],
        ["--ds-config", "zero3_offload_fp32"],
    ):
        for mode, managed in (("on", True), ("auto", True), ("off", False)):
            s = parse_settings([*extra, "--coalesce-grad-reduction", mode])
            assert resolve_ds_config(s, world_size=2)["managed_gradient_accumulation"] is managed, (
                extra,
                mode,
            )
            assert resolve_deepspeed_for(s, None).coalesce_fallback is None


def test_fp16_overflow_is_a_skipped_step_with_the_schedule_held(results):
    """DeepSpeed's loss scaler skips an overflowing fp16 update: the step says skipped (overflow), and
    the LR schedule did not advance (the trainer then counts it as skipped, not trained)."""
    if not fp16_supported():
        pytest.skip("this device has no fp16 support in DeepSpeed (a CPU without AVX512-FP16)")
    f = results["fp16"]
    assert f["skipped"] and f["overflow"], f
    assert f["lr_after"] == f["lr_before"], f


def _alone(model: str) -> dict:
    from ds_clip_harness.runs import RunSpec, run_in_group

    spec = RunSpec(
        model=model, micro_batch_size=2, accum_freq=2, steps=1, zero_stage=0, capture_grads=True,
        count_collectives=True,
    )  # fmt: skip
    result = run_in_group(spec)
    return {"reduced": result.gradient_reduction_passes(), "grads": result.grads, "spec": spec}


def test_one_rank_zero0_reduces_no_gradient_and_stays_exact(tmp_path):
    """W = 1, ZeRO-0: DeepSpeed's all-reduce of the flattened gradient (the identity on one rank) is
    skipped: no gradient bytes pass through a collective, and the step's gradient still equals open_clip's
    full-batch gradient in one process (fp32, relative error <= 1e-5 per parameter)."""
    from ds_clip_harness.models import write_model_dirs
    from ds_clip_harness.oracle import oracle_errors, oracle_first_step

    models = write_model_dirs(tmp_path)
    out = spawn_group(1, _alone, models["vit"])
    assert out["reduced"] == 0
    oracle_grads, _ = oracle_first_step(out["spec"], world_size=1)

    class Result:
        grads = out["grads"]

    errors = oracle_errors(Result, oracle_grads, floor=1e-3)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]:.2e}"


def test_own_engine_built_wrong_is_refused_before_any_forward(results):
    """cached_step with a user's own engine (2 ranks): an engine built from the user's raw DeepSpeed config
    (gradient_accumulation_steps 2, whose backward would scale each micro-batch by 1/2; or DeepSpeed's default
    managed accumulation on ZeRO-0, which would fail inside DeepSpeed), a loss built for one rank (which
    would train each rank's pairs alone) and an open_clip model returning tuples are refused with one line
    naming the fix, on every rank before any collective (the group goes on); the same config through
    step_engine_config trains."""
    own = results["own_engine"]
    assert own["gas"].startswith("EngineConfigError: ") and "gradient_accumulation_steps=2" in own["gas"]
    assert own["raw_zero0"].startswith("EngineConfigError: ") and "managed" in own["raw_zero0"]
    for case in ("gas", "raw_zero0"):
        assert "step_engine_config" in own[case] and "\n" not in own[case], own[case]
    message = own["loss_of_one_rank"]
    assert message.startswith("LossConfigError: ") and "rank 0 of 1" in message and "rank 0 of 2" in message
    assert own["tuple_model"].startswith("EngineConfigError: ") and "output_dict=True" in own["tuple_model"]
    assert own["fit"] == {"skipped": False}

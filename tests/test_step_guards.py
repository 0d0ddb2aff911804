"""What the step refuses and what it costs the host, on the trainer's own engine (ds_clip.engine) over gloo.

One 2-rank process group runs every case (a DeepSpeed start costs seconds here):
- micro-batches of different sizes on different ranks: a clear error naming each rank's sizes, raised on
  every rank before the loss's all-gather (gloo would abort inside the collective, NCCL hang);
- host syncs per optimizer step: the same small number for k = 1, 2, 4 (none per micro-batch);
- an fp16 overflow that DeepSpeed's loss scaler skips is reported as skipped, with the LR schedule held
  (where DeepSpeed runs fp16 on this device).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ds_clip.testing import E2E_MODEL, spawn_group

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
    from ds_clip.engine import build_engine, build_model_bundle

    s = parse_settings(["--model", model, "--batch-size", "2", "--workers", "0", *extra])
    bundle = build_model_bundle(s)
    built = build_engine(s, bundle, rank=dist.get_rank(), world_size=dist.get_world_size(), total_steps=10)
    return bundle, built


def _pairs(bundle, first: int, count: int):
    from ds_clip.data.synthetic import render_pair

    pairs = [render_pair(3, first + i, 32) for i in range(count)]
    return torch.stack([bundle.preprocess_val(im) for im, _ in pairs]), bundle.tokenizer(
        [c for _, c in pairs]
    )


def _group(model: str, fp16_config: str | None) -> dict:
    import torch.distributed as dist

    from ds_clip.step import MicroBatchSizeError, cached_step

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


def test_fp16_overflow_is_a_skipped_step_with_the_schedule_held(results):
    """DeepSpeed's loss scaler skips an overflowing fp16 update: the step says skipped (overflow), and
    the LR schedule did not advance (the trainer then counts it as skipped, not trained)."""
    if not fp16_supported():
        pytest.skip("this device has no fp16 support in DeepSpeed (a CPU without AVX512-FP16)")
    f = results["fp16"]
    assert f["skipped"] and f["overflow"], f
    assert f["lr_after"] == f["lr_before"], f


def _alone(model: str) -> dict:
    from ds_clip.testing import RunSpec, run_in_group

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
    from ds_clip.testing import oracle_errors, oracle_first_step, write_model_dirs

    models = write_model_dirs(tmp_path)
    out = spawn_group(1, _alone, models["vit"])
    assert out["reduced"] == 0
    oracle_grads, _ = oracle_first_step(out["spec"], world_size=1)

    class Result:
        grads = out["grads"]

    errors = oracle_errors(Result, oracle_grads, floor=1e-3)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]:.2e}"

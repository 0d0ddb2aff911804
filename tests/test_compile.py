"""--torchcompile: the compiled model keeps the gradient contract (DeepSpeed's engine.compile, inductor).

One process group of 2 ranks runs every case (a DeepSpeed start and an inductor compile each cost tens of
seconds on a CPU machine): the patch-dropout ViT on ZeRO 0 and 2, k=2 micro-batches, compiled and not.
Both compiled engines trace the same graphs, so the second one reuses inductor's compiled kernels.
"""

from __future__ import annotations

import csv
import json
import math

import pytest

from ds_clip_harness.cases import ADAM, M
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import CONFIGS
from ds_clip_harness.oracle import oracle_errors, oracle_first_step
from ds_clip_harness.runs import RunSpec, run_many, train_argv
from tests import launch

STAGES = (0, 2)


def _spec(models: dict[str, str], stage: int, compiled: bool) -> RunSpec:
    return RunSpec(
        model=models["vit"],  # FLIP patch dropout: random numbers in the forward
        micro_batch_size=M,
        accum_freq=2,
        steps=2,
        zero_stage=stage,
        torchcompile=compiled,
        capture_grads=True,
        name=f"z{stage}-{'compiled' if compiled else 'eager'}",
        **ADAM,
    )


def run_and_count(specs):
    """run_many, plus what dynamo did in this process (rank 0's figures are returned)."""
    from torch._dynamo.utils import counters

    results = run_many(specs)
    graph_breaks = sum(counters["graph_break"].values())
    return results, {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": graph_breaks}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The harness's patch-dropout ViT with open_clip's full vocabulary, so that ds-clip-train's own data
    (open_clip's tokenizer) fits it too and the launcher run reuses the group's compiled graphs."""
    root = tmp_path_factory.mktemp("models")
    cfg = {**CONFIGS["vit"], "text_cfg": {**CONFIGS["vit"]["text_cfg"], "vocab_size": 49408}}
    (root / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
    return {"vit": f"local-dir:{root}"}


@pytest.fixture(scope="module")
def group(models):
    specs = [_spec(models, stage, compiled) for stage in STAGES for compiled in (True, False)]
    results, dynamo = spawn_group(2, run_and_count, specs)
    return {r.spec.name: r for r in results}, dynamo


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_step_matches_single_process_full_batch(stage, group, models):
    """W=2 ranks x k=2 micro-batches with --torchcompile: DeepSpeed's reduced gradient at step 0 equals the
    eager one-process oracle's (open_clip's ClipLoss on the whole batch) to fp32 rounding (1e-5), with
    patch dropout on. Catches compiled dropout that draws other numbers than eager (inductor's own RNG:
    ~0.5 relative error) or other numbers in the no-grad cache pass than in the recompute."""
    runs, _ = group
    result = runs[f"z{stage}-compiled"]
    oracle_grads, oracle_loss = oracle_first_step(_spec(models, stage, True), world_size=2)
    assert result.losses[0] == pytest.approx(oracle_loss, rel=1e-5)
    errors = oracle_errors(result, oracle_grads, floor=1e-3)
    assert errors["logit_scale"] <= 1e-5
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_run_trains_like_uncompiled(stage, group):
    """After 2 AdamW steps the compiled and the uncompiled run (same split, same stage) hold the same
    parameters (every entry within 1% of one step, lr) and saw the same losses (1e-5)."""
    runs, _ = group
    a, b = runs[f"z{stage}-compiled"], runs[f"z{stage}-eager"]
    assert a.losses == pytest.approx(b.losses, rel=1e-5)
    for name, pa in a.params.items():
        diff = float((pa - b.params[name]).abs().max())
        assert diff <= 1e-2 * ADAM["lr"], f"{name}: max |diff| {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.slow
def test_model_was_compiled_without_graph_breaks(group):
    """The compiled runs really ran compiled graphs: dynamo traced the whole CLIP forward as one graph per
    grad mode (the no-grad cache pass, the recompute with grad) and no more: the second step, the second
    micro-batch and the second engine (same model, parameters are graph inputs) reuse them, so nothing
    recompiles per step. No graph break (a break would run that part eagerly and split the graph)."""
    _, dynamo = group
    assert dynamo["graph_breaks"] == 0
    assert dynamo["unique_graphs"] == 2


@pytest.mark.parametrize(
    "argv",
    [["--zero-stage", "3"], ["--ds-config", "zero3_fp32"]],
    ids=["flag", "preset"],
)
def test_torchcompile_refuses_zero3(argv):
    """ZeRO-3 + --torchcompile exits 2 naming the flag (DeepSpeed 0.19.8 compiles the partitioned, empty
    parameters), whether the stage comes from --zero-stage or from the preset."""
    from ds_clip.config import SettingsError, parse_settings

    with pytest.raises(SettingsError, match="--torchcompile .*ZeRO stage 3"):
        parse_settings(["--torchcompile", *argv])
    # the same preset with --zero-stage 2 (the last --zero-stage wins) is accepted
    assert parse_settings(["--torchcompile", *argv, "--zero-stage", "2"]).model.torchcompile


def test_torchcompile_is_off_by_default():
    """open_clip_train's --torchcompile: off unless given."""
    from ds_clip.config import parse_settings

    assert parse_settings([]).model.torchcompile is False
    assert parse_settings(["--torchcompile"]).model.torchcompile is True


@pytest.mark.distributed
@pytest.mark.slow
def test_ds_clip_train_compiled_under_the_deepspeed_launcher(group, models, tmp_path):
    """`deepspeed --num_gpus 2 --module ds_clip.train --torchcompile` on ZeRO-2 trains 2 steps, logs the
    compile and a finite loss per step, then `--resume latest` continues uncompiled from its checkpoint (a
    compiled run saves the plain model's names). Same model and shapes as the group above, so inductor
    reuses the kernels it compiled there (its cache is per user) instead of compiling again."""
    base = train_argv(_spec(models, 2, True))
    run = ["--logs", str(tmp_path), "--name", "compiled", "--log-every-n-steps", "1", "--report-to", "csv"]
    proc = launch.run(launch.deepspeed(*base, *run, "--max-steps", "2"), timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "--torchcompile: model compiled" in out
    with open(tmp_path / "compiled" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2] and all(math.isfinite(float(r["loss"])) for r in rows)
    eager = [a for a in base if a != "--torchcompile"]
    proc = launch.run(launch.deepspeed(*eager, *run, "--max-steps", "3", "--resume", "latest"), timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "at step 2" in out, out[-4000:]

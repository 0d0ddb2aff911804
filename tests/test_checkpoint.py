"""Checkpoints that lose nothing: step-exact resume, resume on another world size, export, partial checkpoints.

The real trainer (`ds_clip.trainer.train`) runs inside three process groups over gloo, many runs per group
(a DeepSpeed start costs seconds here): 4 ranks (runs saved on W=4), 2 ranks (ZeRO 0-3 uninterrupted and
interrupted-at-step-2-then-resumed, resumes of the W=4 runs, an engine whose embeddings the export must
reproduce), 4 ranks again (resumes of the W=2 runs). Global batch N = W*k*m = 8 in every run (m=2; k=2 on
2 ranks, k=1 on 4), fp32, synthetic data assigned by global sample index, so every split trains the same
pairs with the same dropout seeds (see ds_clip/equivalence.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ds_clip import checkpoint as ck
from ds_clip.equivalence import spawn_group
from tests.test_e2e import E2E_MODEL

M, STEPS, SAVE_AT = 2, 4, 2
STAGES = (0, 1, 2, 3)
FROM_W4_STAGES = (1, 3)
VAL_SAMPLES = 31  # odd: the two ranks' slices differ in size
CLASSES = {"classnames": ["circle", "square", "triangle", "diamond"], "templates": ["a {c}", "a small {c}"]}


def _args(model: str, logs: Path, name: str, zero: int, k: int, *extra: str) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--accum-freq", str(k), "--max-steps", str(STEPS),
        "--log-every-n-steps", str(STEPS), "--logs", str(logs), "--name", name, "--workers", "0",
        "--zero-stage", str(zero), "--lr", "1e-3", "--wd", "0.1", "--eps", "1e-4", "--warmup", "1",
        "--save-every-n-steps", str(SAVE_AT), "--train-num-samples", "4000", *extra,
    ]  # fmt: skip


def _ckpt(logs: Path, name: str, step: int) -> Path:
    return logs / name / "checkpoints" / ck.tag_for(step)


def _train(argv: list[str], augment: bool = False) -> None:
    """One real training run. Without ``augment`` the train transform is the val transform: open_clip's
    RandomResizedCrop draws from each rank's RNG, so only without it do different (W, k) splits see
    identical pixels (the same-W resume is exact either way: the RNG states are in the checkpoint)."""
    import ds_clip.trainer as tr
    from ds_clip.config import parse_settings

    build = tr.build_model

    def build_without_augmentation(*args, **kwargs):
        bundle = build(*args, **kwargs)
        bundle.preprocess_train = bundle.preprocess_val
        return bundle

    tr.build_model = build if augment else build_without_augmentation
    try:
        tr.train(parse_settings(argv))
    finally:
        tr.build_model = build


def _group_w4_first(model: str, logs: Path) -> None:
    for z in FROM_W4_STAGES:
        _train(_args(model, logs, f"full4_z{z}", z, 1))


def _group_w2(model: str, logs: Path, classes: str) -> dict:
    val = ["--val-data", "synthetic", "--val-num-samples", str(VAL_SAMPLES), "--zeroshot-classes", classes]
    for z in STAGES:
        _train(_args(model, logs, f"full2_z{z}", z, 2, *(val if z == 3 else [])))
        _train(_args(model, logs, f"res2_z{z}", z, 2, "--resume", str(_ckpt(logs, f"full2_z{z}", SAVE_AT))))
    for z in FROM_W4_STAGES:
        _train(_args(model, logs, f"res42_z{z}", z, 2, "--resume", str(_ckpt(logs, f"full4_z{z}", SAVE_AT))))
    # With open_clip's random crops on: exact only because every rank's RNG state is restored.
    _train(_args(model, logs, "full2_aug", 1, 2), augment=True)
    _train(
        _args(model, logs, "res2_aug", 1, 2, "--resume", str(_ckpt(logs, "full2_aug", SAVE_AT))), augment=True
    )
    return _engine_embeddings(model, logs / "engine", zero=3)


def _group_w4_second(model: str, logs: Path) -> None:
    for z in STAGES:
        _train(_args(model, logs, f"res24_z{z}", z, 1, "--resume", str(_ckpt(logs, f"full2_z{z}", SAVE_AT))))


def _probe_batch(bundle) -> tuple[torch.Tensor, torch.Tensor]:
    from ds_clip.data.synthetic import render_pair

    pairs = [render_pair(7, i, 32) for i in range(5)]
    images = torch.stack([bundle.preprocess_val(im) for im, _ in pairs])
    return images, bundle.tokenizer([c for _, c in pairs])


def _engine_embeddings(model: str, run_dir: Path, zero: int) -> dict:
    """A ZeRO-3 engine after one step: its embeddings of a probe batch, and a checkpoint of it."""
    import deepspeed
    import open_clip
    import torch.distributed as dist

    from ds_clip.equivalence import RunSpec, ds_config_for, step_micro_batches
    from ds_clip.loss import ContrastiveLoss, LossSpec
    from ds_clip.model import build_model, param_groups, prepare_for_deepspeed
    from ds_clip.step import cached_step

    bundle = build_model(model, seed=0)
    prepare_for_deepspeed(bundle.model)
    spec = RunSpec(model, M, 2, 1, zero_stage=zero)
    opt = torch.optim.AdamW(param_groups(bundle.model, 0.1), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=bundle.model, optimizer=opt, config=ds_config_for(spec, 2))
    batches, _ = step_micro_batches(spec, bundle.model_cfg, 0, dist.get_rank(), 2)
    cached_step(engine, batches, ContrastiveLoss(LossSpec(), rank=dist.get_rank(), world_size=2))
    engine.eval()
    images, texts = _probe_batch(bundle)
    with torch.no_grad():
        out = engine(image=images, text=texts)
    meta = {
        "accum_freq": 2, "micro_batch_size": M, "model": model, "model_cfg": bundle.model_cfg,
        "preprocess_cfg": open_clip.get_model_preprocess_cfg(bundle.model), "epoch": 0, "samples_seen": 8,
    }  # fmt: skip
    path = ck.save(engine, run_dir, 1, {"epoch": 0, "step_in_epoch": 1}, {}, meta=meta)
    result = {
        "path": str(path),
        "image": out["image_features"].detach().clone(),
        "text": out["text_features"].detach().clone(),
        "scale": float(out["logit_scale"]),
    }
    engine.destroy()
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    classes = root / "classes.json"
    classes.write_text(json.dumps(CLASSES))
    model, logs = f"local-dir:{model_dir}", root / "logs"
    spawn_group(4, _group_w4_first, model, logs)
    engine = spawn_group(2, _group_w2, model, logs, str(classes))
    spawn_group(4, _group_w4_second, model, logs)
    return {"logs": logs, "engine": engine, "classes": str(classes), "root": root}


def _final(logs: Path, name: str) -> dict[str, torch.Tensor]:
    from ds_clip.export import consolidated_state_dict

    return consolidated_state_dict(_ckpt(logs, name, STEPS))


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", [*STAGES, "aug"])
def test_resume_is_step_exact(runs, zero):
    """Interrupted at step 2 and resumed from that checkpoint (same W): the parameters at step 4 equal the
    uninterrupted run's, ZeRO 0-3, fp32 (same arithmetic in the same order: equal to float rounding);
    "aug": ZeRO-1 with open_clip's random crops on, which only the restored RNG states make exact."""
    logs = runs["logs"]
    suffix = "aug" if zero == "aug" else f"z{zero}"
    full, resumed = _final(logs, f"full2_{suffix}"), _final(logs, f"res2_{suffix}")
    assert _max_abs_diff(resumed, full) <= 1e-7
    if zero == "aug":
        return
    meta = ck.read_meta(_ckpt(logs, f"res2_z{zero}", STEPS))
    assert (meta["step"], meta["samples_seen"], meta["world_size"], meta["zero_stage"]) == (
        STEPS,
        STEPS * 8,
        2,
        zero,
    )
    rank_state = json.loads((_ckpt(logs, f"res2_z{zero}", STEPS) / "rank1.json").read_text())
    assert rank_state["data"]["step_in_epoch"] == STEPS and len(rank_state["rng"]["torch"]) > 0


# Different world size: the global batch is the same (8), the arithmetic is not (other reduction order),
# so the two runs agree to float rounding amplified by 2 AdamW steps (eps=1e-4 keeps near-zero gradients
# from turning rounding into full-size updates; see tests/test_equivalence.py). A lost optimizer state,
# step count or learning rate moves parameters by ~lr = 1e-3 per step: 100x this bound.
CROSS_W_TOL = 1e-5


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", STAGES)
def test_resume_from_2_ranks_on_4_ranks(runs, zero):
    """Saved on 2 ranks (k=2), resumed on 4 ranks (k=1): ends where the uninterrupted 2-rank run ends."""
    logs = runs["logs"]
    assert _max_abs_diff(_final(logs, f"res24_z{zero}"), _final(logs, f"full2_z{zero}")) <= CROSS_W_TOL
    assert ck.read_meta(_ckpt(logs, f"res24_z{zero}", STEPS))["world_size"] == 4
    assert not list((logs / f"res24_z{zero}" / "checkpoints").glob(f"{ck.UNIVERSAL_PREFIX}*"))  # removed


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", FROM_W4_STAGES)
def test_resume_from_4_ranks_on_2_ranks(runs, zero):
    """The reverse: saved on 4 ranks (k=1), resumed on 2 ranks (k=2)."""
    logs = runs["logs"]
    assert _max_abs_diff(_final(logs, f"res42_z{zero}"), _final(logs, f"full4_z{zero}")) <= CROSS_W_TOL


@pytest.mark.distributed
@pytest.mark.slow
def test_export_loads_strictly_in_open_clip_and_matches_engine_embeddings(runs, tmp_path):
    """ds-clip-export of a ZeRO-3 checkpoint: open_clip loads it strictly both ways (local-dir: folder, and a
    named model with pretrained=FILE), so does the trainer's --pretrained FOLDER, with 0-dim logit_scale,
    and each embeds a probe batch as the engine did."""
    import open_clip

    from ds_clip.export import WEIGHTS_FILE, main, resolve_pretrained
    from ds_clip.model import build_model

    eng = runs["engine"]
    out = tmp_path / "export"
    assert main([eng["path"], str(out)]) == 0
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    assert model.logit_scale.shape == torch.Size([])
    # A named model: register the same config under a name, load the safetensors file as pretrained=.
    cfg_dir = tmp_path / "cfgs"
    cfg_dir.mkdir()
    (cfg_dir / "ds-clip-test-export.json").write_text(json.dumps(E2E_MODEL))
    open_clip.add_model_config(cfg_dir)
    named, _, _ = open_clip.create_model_and_transforms(
        "ds-clip-test-export", pretrained=str(out / WEIGHTS_FILE)
    )
    bundle = build_model(f"local-dir:{out}", seed=None)
    images, texts = _probe_batch(bundle)
    # What the trainer builds for --model NAME --pretrained OUT (a folder: its safetensors file).
    tuned = build_model("ds-clip-test-export", pretrained=resolve_pretrained(str(out)), seed=123).model
    for m in (model, named, tuned):
        with torch.no_grad():
            o = m.eval()(image=images, text=texts)
        o = o if isinstance(o, dict) else dict(zip(("image_features", "text_features", "logit_scale"), o))
        torch.testing.assert_close(o["image_features"], eng["image"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o["text_features"], eng["text"], rtol=1e-5, atol=1e-6)
        assert abs(float(o["logit_scale"]) - eng["scale"]) < 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_on_2_ranks_zero3_equals_ds_clip_eval_of_the_export(runs, tmp_path):
    """Evaluation inside a 2-rank ZeRO-3 run (31 samples: slices of 16 and 15) counts every sample once and
    gives the metrics ds-clip-eval computes in one process on the exported model."""
    from ds_clip.evaluate import main as eval_main
    from ds_clip.export import main as export_main

    logs = runs["logs"]
    run_dir = logs / "full2_z3"
    history = json.loads((run_dir / "eval_results.json").read_text())
    assert [h["step"] for h in history] == [STEPS]
    assert (run_dir / "val_metrics.csv").read_text().startswith("step,val_samples,val_loss")
    in_run = history[-1]
    assert in_run["val_samples"] == VAL_SAMPLES and in_run["zeroshot_samples"] == VAL_SAMPLES
    out = tmp_path / "export"
    assert export_main([str(run_dir), str(out)]) == 0  # a run folder: its latest complete checkpoint
    res = tmp_path / "eval.json"
    argv = [str(out), "--val-data", "synthetic", "--val-num-samples", str(VAL_SAMPLES), "--batch-size", "4"]
    assert eval_main([*argv, "--zeroshot-classes", runs["classes"], "--out", str(res)]) == 0
    offline = json.loads(res.read_text())
    assert offline.keys() == {k for k in in_run if k != "step"}
    for k, v in offline.items():
        assert v == pytest.approx(in_run[k], rel=1e-4, abs=1e-6), k


# ------------------------------------------------------------------------- bad checkpoints (no engine needed)


@pytest.mark.distributed
@pytest.mark.slow
def test_partial_checkpoint_is_an_error_naming_the_file(runs, tmp_path):
    """A complete-looking checkpoint with one rank's file deleted (or cut short) is refused by name."""
    src = _ckpt(runs["logs"], "full2_z2", STEPS)
    bad = tmp_path / "step_bad"
    shutil.copytree(src, bad)
    victim = next(bad.glob("zero_pp_rank_1_*optim_states.pt"))
    victim.unlink()
    with pytest.raises(ck.CheckpointError, match=f"partial.*{victim.name} is missing"):
        ck.resolve(None, str(bad))
    shutil.copytree(src, tmp_path / "short")
    f = tmp_path / "short" / "rank0.json"
    f.write_text(f.read_text()[:-5])
    with pytest.raises(ck.CheckpointError, match="rank0.json has .* bytes"):
        ck.resolve(None, str(tmp_path / "short"))
    (bad / ck.MARKER).unlink()
    with pytest.raises(ck.CheckpointError, match="no COMPLETE marker"):
        ck.resolve(None, str(bad))
    # --resume latest of a run without any checkpoint; a run folder resolves to its latest complete one.
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint"):
        ck.resolve(tmp_path / "no_run", "latest")
    assert ck.resolve(None, str(runs["logs"] / "full2_z2")) == src


@pytest.mark.distributed
@pytest.mark.slow
def test_incompatible_model_or_global_batch_is_a_clear_error(runs):
    meta = ck.read_meta(_ckpt(runs["logs"], "full2_z1", STEPS))
    shapes = dict(meta["param_shapes"])
    ck.check_compatible(meta, "--resume x", shapes=shapes, global_batch=8, world_size=4)  # fine
    other = {**shapes, "text_projection": [32, 99]}
    with pytest.raises(ck.CheckpointError, match="incompatible model.*text_projection"):
        ck.check_compatible(meta, "--resume x", shapes=other, global_batch=8, world_size=2)
    with pytest.raises(ck.CheckpointError, match="global batch.*--accum-freq 1"):
        ck.check_compatible(meta, "--resume x", shapes=shapes, global_batch=16, world_size=4)


def test_prune_keeps_the_newest_complete_and_deletes_older_only(tmp_path):
    root = tmp_path / "checkpoints"
    for step, complete in ((1, True), (2, False), (3, True), (4, True), (5, False)):
        d = root / ck.tag_for(step)
        d.mkdir(parents=True)
        if complete:
            (d / ck.MARKER).write_text(str(step))
    gone = ck.prune(root, keep=2)
    assert sorted(p.name for p in gone) == [ck.tag_for(1), ck.tag_for(2)]
    assert sorted(p.name for p in root.iterdir()) == [ck.tag_for(3), ck.tag_for(4), ck.tag_for(5)]
    assert ck.prune(root, keep=2) == []  # nothing older than the two newest complete ones


def test_rng_state_round_trips_through_json():
    import random

    import numpy as np

    state = json.loads(json.dumps(ck.rng_state()))
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ck.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a

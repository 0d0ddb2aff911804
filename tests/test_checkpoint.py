"""The product's promises through the real trainer: W·k·m splits train alike, resume is step-exact, the
temperature clamp holds in the fp32 master, checkpoints lose nothing, export and evaluation agree.

The real trainer (`ds_clip.training.trainer.train`, what `ds-clip-train` runs) with the user's defaults on: open_clip's
random train transform (RandomResizedCrop), `--workers 1` (0 and 2 too for resume), a ViT with patch
dropout. It runs inside three process groups over gloo, many runs per group (a DeepSpeed start costs
seconds here): 4 ranks (k=1 runs saved on W=4), 2 ranks (k=2: ZeRO 0-3 uninterrupted and
interrupted-at-step-2-then-resumed, resumes of the W=4 runs, webdataset resumes, a short pre-training for
the clamp test), 4 ranks again (resumes of the W=2 runs, the clamp cases). Global batch N = W*k*m = 8 in
every run (m=2; k=2 on 2 ranks, k=1 on 4): the same pairs (synthetic: by global sample index), the same
crops (a function of seed, epoch and sample) and the same dropout seeds in every split. A distilled run
(--distill-model, ZeRO-3) is trained and resumed in the 2-rank group too.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_clip import checkpoint as ck
from ds_clip.checkpoint.layout import UNIVERSAL_PREFIX
from ds_clip.checkpoint.load import check_compatible, check_resume_settings
from ds_clip.checkpoint.rng import rng_state, set_rng_state
from ds_clip.checkpoint.save import prune
from ds_clip.errors import UserError
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL, E2E_TEACHER, write_pretrained_dir

M, STEPS, SAVE_AT = 2, 4, 2
STAGES = (0, 1, 2, 3)
FROM_W4_STAGES = (1, 3)
RESUME_WORKERS = (0, 2)  # besides the default 1, on ZeRO-3
WDS_WORKERS = (0, 1, 2)
VAL_SAMPLES = 31  # odd: the two ranks' slices differ in size
CLASSES = {"classnames": ["circle", "square", "triangle", "diamond"], "templates": ["a {c}", "a small {c}"]}
# The user's kind of model: open_clip ViT with FLIP-style patch dropout (random in both passes of a step).
MODEL = {**E2E_MODEL, "vision_cfg": {**E2E_MODEL["vision_cfg"], "patch_dropout": 0.25}}
CLAMP_BATCH = 16  # 4 ranks x 4 pairs
CLAMP_CASES = [(z, p) for z in STAGES for p in ("fp32", "bf16")]


def _args(model: str, logs: Path, name: str, zero: int, k: int, *extra: str, workers: int = 1) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--accum-freq", str(k), "--max-steps", str(STEPS),
        "--log-every-n-steps", str(STEPS), "--logs", str(logs), "--name", name, "--workers", str(workers),
        "--zero-stage", str(zero), "--lr", "1e-3", "--wd", "0.1", "--eps", "1e-4", "--warmup", "1",
        "--save-every-n-steps", str(SAVE_AT), "--train-num-samples", "4000", *extra,
    ]  # fmt: skip


def _ckpt(logs: Path, name: str, step: int) -> Path:
    return logs / name / "checkpoints" / ck.tag_for(step)


def _train(argv: list[str]) -> None:
    """One run of the real trainer, exactly as `ds-clip-train ARGV` runs it (nothing swapped or patched)."""
    from ds_clip.config import parse_settings
    from ds_clip.training.trainer import train

    train(parse_settings(argv))


def _resume(argv: list[str], logs: Path, name: str) -> list[str]:
    return [*argv, "--resume", str(_ckpt(logs, name, SAVE_AT))]


def _group_w4_first(model: str, logs: Path) -> None:
    for z in STAGES:
        _train(_args(model, logs, f"full4_z{z}", z, 1))


def _group_w2(model: str, logs: Path, classes: str, shards: str, moved: str, teacher: str) -> dict:
    val = ["--val-data", "synthetic", "--val-num-samples", str(VAL_SAMPLES), "--zeroshot-classes", classes]
    for z in STAGES:
        _train(_args(model, logs, f"full2_z{z}", z, 2, *(val if z == 3 else [])))
        _train(_resume(_args(model, logs, f"res2_z{z}", z, 2), logs, f"full2_z{z}"))
    # Distilled (a frozen teacher beside the ZeRO-3 engine), uninterrupted and resumed at step 2.
    distill = ["--distill-model", teacher]
    _train(_args(model, logs, "distill2_z3", 3, 2, *distill))
    _train(_resume(_args(model, logs, "distillres2_z3", 3, 2, *distill), logs, "distill2_z3"))
    for workers in RESUME_WORKERS:
        _train(_args(model, logs, f"full2_z3_w{workers}", 3, 2, workers=workers))
        _train(
            _resume(
                _args(model, logs, f"res2_z3_w{workers}", 3, 2, workers=workers), logs, f"full2_z3_w{workers}"
            )
        )
    wds = ["--train-data", shards, "--dataset-type", "webdataset"]
    for workers in WDS_WORKERS:
        argv = [a for a in _args(model, logs, f"wds2_w{workers}", 3, 2, *wds, workers=workers)]
        _train(argv)
        _train(
            _resume(
                _args(model, logs, f"wdsres2_w{workers}", 3, 2, *wds, workers=workers),
                logs,
                f"wds2_w{workers}",
            )
        )
    # The same shards at another path, and through a pipe: command: straight, and resumed from the run that
    # read them at the first path (a re-queued job on a node that mounts the data elsewhere).
    for name, data in (("wdsmoved", moved), ("wdspipe", f"pipe:cat {moved}")):
        _train(_args(model, logs, name, 3, 2, "--train-data", data, "--dataset-type", "webdataset"))
    moved_args = _args(
        model, logs, "wdsmovedres", 3, 2, "--train-data", moved, "--dataset-type", "webdataset"
    )
    _train(_resume(moved_args, logs, "wds2_w1"))
    for z in FROM_W4_STAGES:
        _train(_resume(_args(model, logs, f"res42_z{z}", z, 2), logs, f"full4_z{z}"))
    out = _engine_embeddings(model, logs / "engine", zero=3)
    # A resume with another peak LR is refused before the load: the saved optimizer and scheduler state
    # would silently restore the old one.
    try:
        _train(_resume(_args(model, logs, "res2_lr", 1, 2, "--visual-lr", "2e-3"), logs, "full2_z1"))
    except ck.ResumeSettingsError as exc:
        out["lr_refusal"] = str(exc)
    return out


def _group_w4_second(model: str, logs: Path, clamp_model: str) -> list[dict]:
    for z in STAGES:
        _train(_resume(_args(model, logs, f"res24_z{z}", z, 1), logs, f"full2_z{z}"))
    return [_clamp_case(clamp_model, z, precision) for z, precision in CLAMP_CASES]


def _clamp_pairs(bundle, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ds_clip.data.synthetic import render_pair

    pairs = [render_pair(11, first + i, 32) for i in range(count)]
    return torch.stack([bundle.preprocess_val(im) for im, _ in pairs]), bundle.tokenizer(
        [c for _, c in pairs]
    )


def _clamp_case(model: str, zero: int, precision: str) -> dict:
    """One optimizer step of the trainer's own engine (its builders, cached_step, then the clamp it applies
    after an applied step) from logit_scale = ln 100 - 1e-3 (bf16: 4.59375, the bf16 value below) with lr 5e-2, on the batch _clamp_model fitted
    the model to (its full-batch loss wants a larger scale): AdamW's first step moves it by ~lr,
    past ln 100. Reads the fp32 master the optimizer will update next, and the working copy."""
    import torch.distributed as dist

    from ds_clip.config import parse_settings
    from ds_clip.step.cached import cached_step, input_dtype
    from ds_clip.step.clamp import clamp_logit_scale, full_fp32_master
    from ds_clip.training.engine import build_engine, build_model_bundle, resolve_run

    rank, world = dist.get_rank(), dist.get_world_size()
    s = parse_settings(
        ["--model", model, "--zero-stage", str(zero), "--precision", precision, "--batch-size", "4",
         "--lr", "5e-2", "--warmup", "0", "--workers", "0", "--logs", "/tmp/unused"]
    )  # fmt: skip
    bundle = build_model_bundle(s.model, seed=s.data.seed)
    geometry, ds = resolve_run(s, world)
    built = build_engine(
        bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed,
        rank=rank, total_steps=10,
    )  # fmt: skip
    engine = built.engine
    before = float(full_fp32_master(engine, "logit_scale").reshape(()))
    images, texts = _clamp_pairs(bundle, rank * (CLAMP_BATCH // world), CLAMP_BATCH // world)
    result = cached_step(engine, [(images, texts)], built.loss_fn)
    if not result.skipped:
        clamp_logit_scale(engine)
    master = float(full_fp32_master(engine, "logit_scale").reshape(()))
    with torch.no_grad():
        probe = images[:1].to(input_dtype(engine))
        working = float(engine(image=probe, text=texts[:1])["logit_scale"].float().log().reshape(-1)[0])
    engine.destroy()
    return {"zero": zero, "precision": precision, "before": before, "master": master, "working": working}


def _probe_batch(bundle, offset: int = 100, count: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    from ds_clip.data.synthetic import render_pair

    pairs = [render_pair(7, offset + i, 32) for i in range(count)]
    images = torch.stack([bundle.preprocess_val(im) for im, _ in pairs])
    return images, bundle.tokenizer([c for _, c in pairs])


def _engine_embeddings(model: str, run_dir: Path, zero: int) -> dict:
    """The trainer's ZeRO-3 engine after one step: its embeddings of a probe batch, and a checkpoint of it."""
    import open_clip
    import torch.distributed as dist

    from ds_clip.config import parse_settings
    from ds_clip.step.cached import cached_step
    from ds_clip.training.engine import build_engine, build_model_bundle, resolve_run

    rank = dist.get_rank()
    s = parse_settings(["--model", model, "--zero-stage", str(zero), "--batch-size", str(M), "--lr", "1e-2"])
    bundle = build_model_bundle(s.model, seed=s.data.seed)
    geometry, ds = resolve_run(s, 2)
    built = build_engine(
        bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed,
        rank=rank, total_steps=10,
    )  # fmt: skip
    engine = built.engine
    images, texts = _probe_batch(bundle, offset=rank * M, count=M)
    cached_step(engine, [(images, texts)], built.loss_fn)
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


def _clamp_model(root: Path) -> str:
    """A tiny model (no dropout, so the engine sees the gradient computed here) fitted in one process to the
    16 pairs of the clamp batch until open_clip's full-batch loss wants a larger temperature at
    logit_scale = ln 100 - 1e-3 (a negative gradient), saved with that logit_scale as an open_clip folder."""
    import open_clip
    from safetensors.torch import save_file

    from ds_clip.models.model import build_model

    folder = root / "clamp_model"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    bundle = build_model(f"local-dir:{folder}", seed=0)
    model = bundle.model.train()
    images, texts = _clamp_pairs(bundle, 0, CLAMP_BATCH)
    towers = torch.optim.Adam([p for n, p in model.named_parameters() if n != "logit_scale"], lr=3e-3)
    # Fitted at temperature 10 first (at 100 from the start the towers collapse), then at ln 100 - 1e-3
    # until the gradient is clearly negative (a margin bf16's rounding does not flip).
    for i in range(600):
        with torch.no_grad():
            model.logit_scale.fill_(math.log(10) if i < 100 else math.log(100) - 1e-3)
        out = model(image=images, text=texts)
        loss = open_clip.ClipLoss()(out["image_features"], out["text_features"], out["logit_scale"])
        towers.zero_grad()
        model.logit_scale.grad = None
        loss.backward()
        if i >= 100 and float(model.logit_scale.grad) < -0.01:
            break
        towers.step()
    else:
        raise AssertionError("the clamp model did not come to want a larger logit_scale in 600 steps")
    save_file(
        {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
        str(folder / "open_clip_model.safetensors"),
    )
    return f"local-dir:{folder}"


def _make_shards(root: Path) -> str:
    made = subprocess.run(
        [sys.executable, "-m", "ds_clip.shards", "--synthetic", "160", "--image-size", "32",
         "--samples-per-shard", "20", "--output", str(root / "shards")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    return str(root / "shards" / "{00000..00007}.tar")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": MODEL, "preprocess_cfg": {}}))
    classes = root / "classes.json"
    classes.write_text(json.dumps(CLASSES))
    shards = _make_shards(root)
    shutil.copytree(root / "shards", root / "mounted" / "elsewhere")
    moved = str(root / "mounted" / "elsewhere" / Path(shards).name)
    model, logs = f"local-dir:{model_dir}", root / "logs"
    teacher = write_pretrained_dir(root / "teacher", E2E_TEACHER)
    spawn_group(4, _group_w4_first, model, logs)
    engine = spawn_group(2, _group_w2, model, logs, str(classes), shards, moved, teacher)
    clamp = spawn_group(4, _group_w4_second, model, logs, _clamp_model(root))
    return {"logs": logs, "engine": engine, "classes": str(classes), "root": root, "clamp": clamp}


def _final(logs: Path, name: str) -> dict[str, torch.Tensor]:
    from ds_clip.export.openclip import consolidated_state_dict

    return consolidated_state_dict(_ckpt(logs, name, STEPS))


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", STAGES)
def test_resume_is_step_exact(runs, zero):
    """Interrupted at step 2 and resumed from that checkpoint (same W, --workers 1, random crops, patch
    dropout): the parameters at step 4 equal the uninterrupted run's, ZeRO 0-3, fp32 (same arithmetic in the
    same order: equal to float rounding)."""
    logs = runs["logs"]
    full, resumed = _final(logs, f"full2_z{zero}"), _final(logs, f"res2_z{zero}")
    assert _max_abs_diff(resumed, full) <= 1e-6
    meta = ck.read_meta(_ckpt(logs, f"res2_z{zero}", STEPS))
    assert (meta["step"], meta["samples_seen"], meta["world_size"], meta["zero_stage"]) == (
        STEPS,
        STEPS * 8,
        2,
        zero,
    )
    rank_state = json.loads((_ckpt(logs, f"res2_z{zero}", STEPS) / "rank1.json").read_text())
    assert rank_state["data"]["step_in_epoch"] == STEPS and len(rank_state["rng"]["torch"]) > 0


@pytest.mark.distributed
@pytest.mark.slow
def test_distilled_resume_is_step_exact_and_the_teacher_is_in_no_checkpoint(runs, tmp_path):
    """--distill-model (a frozen local-dir: teacher) on ZeRO-3: interrupted at step 2 and resumed, the student
    at step 4 equals the uninterrupted distilled run's; the teacher moved it (it differs from the same run
    without a teacher); the checkpoint holds the student alone (same parameters and, to a few KB of
    settings, the same bytes as the run without a teacher), and ds-clip-export writes the student, loaded
    strictly by open_clip."""
    import open_clip

    from ds_clip.export.openclip import main as export_main

    logs = runs["logs"]
    full, resumed = _final(logs, "distill2_z3"), _final(logs, "distillres2_z3")
    assert _max_abs_diff(resumed, full) <= 1e-6
    plain = _final(logs, "full2_z3")
    assert full.keys() == plain.keys()
    assert _max_abs_diff(full, plain) > 1e-4  # the distill term changed what was trained
    meta = ck.read_meta(_ckpt(logs, "distillres2_z3", STEPS))
    assert meta["param_shapes"] == ck.read_meta(_ckpt(logs, "full2_z3", STEPS))["param_shapes"]

    def size(name: str) -> int:
        return sum(f.stat().st_size for f in _ckpt(logs, name, STEPS).iterdir() if f.suffix == ".pt")

    assert abs(size("distill2_z3") - size("full2_z3")) < 64 * 1024  # the teacher alone is ~10 MB
    out = tmp_path / "export"
    assert export_main([str(logs / "distill2_z3"), str(out)]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(out / "open_clip_model.safetensors"))
    student = open_clip.create_model(f"local-dir:{out}")  # loads strictly
    assert exported.keys() == student.state_dict().keys()
    assert {tuple(v.shape) for v in exported.values()} == {
        tuple(v.shape) for v in student.state_dict().values()
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("workers", RESUME_WORKERS)
def test_resume_is_step_exact_with_other_worker_counts(runs, workers):
    """The same promise with --workers 0 (loading in the training process) and 2, ZeRO-3."""
    logs = runs["logs"]
    full, resumed = _final(logs, f"full2_z3_w{workers}"), _final(logs, f"res2_z3_w{workers}")
    assert _max_abs_diff(resumed, full) <= 1e-6


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("workers", WDS_WORKERS)
def test_resume_on_webdataset_shards_is_step_exact(runs, workers):
    """Real tar shards read by the webdataset pipeline (shuffled shard order, shuffle buffer, crops seeded by
    shard name and key), --workers 0, 1 and 2, ZeRO-3: resumed at step 2, equal at step 4."""
    logs = runs["logs"]
    full, resumed = _final(logs, f"wds2_w{workers}"), _final(logs, f"wdsres2_w{workers}")
    assert _max_abs_diff(resumed, full) <= 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_the_same_shards_at_another_path_train_the_same_run(runs):
    """The shards copied to another folder, and read through `pipe:cat`, train bit for bit what the first
    path trained (crops are keyed by shard name and sample key); a run saved with the data at one path and
    resumed with it at the other equals the straight run. With the path in the key, each run differed."""
    logs = runs["logs"]
    straight = _final(logs, "wds2_w1")
    for name in ("wdsmoved", "wdspipe"):
        assert _max_abs_diff(_final(logs, name), straight) == 0.0, name
    assert _max_abs_diff(_final(logs, "wdsmovedres"), straight) <= 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_worker_count_does_not_change_what_is_trained(runs):
    """Synthetic data with --workers 0, 1, 2 trains the same pairs with the same crops: equal weights."""
    logs = runs["logs"]
    ref = _final(logs, "full2_z3")
    for workers in RESUME_WORKERS:
        assert _max_abs_diff(_final(logs, f"full2_z3_w{workers}"), ref) <= 1e-6


# Different world size: the global batch is the same (8), the arithmetic is not (other reduction order),
# so the two runs agree to float rounding amplified by the AdamW steps (eps=1e-4 keeps near-zero gradients
# from turning rounding into full-size updates; see tests/test_equivalence.py). A lost optimizer state,
# step count, learning rate, crop or dropout mask moves parameters by ~lr = 1e-3 per step: 100x this bound.
CROSS_W_TOL = 1e-5


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", STAGES)
def test_2_ranks_accum_2_train_like_4_ranks(runs, zero):
    """The product's promise through the trainer: `--accum-freq 2` on 2 ranks ends where 4 ranks with k=1
    end after 4 AdamW steps, ZeRO 0-3, fp32, random crops and patch dropout on, --workers 1."""
    logs = runs["logs"]
    assert _max_abs_diff(_final(logs, f"full2_z{zero}"), _final(logs, f"full4_z{zero}")) <= CROSS_W_TOL


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CLAMP_CASES)), ids=[f"zero{z}-{p}" for z, p in CLAMP_CASES])
def test_logit_scale_clamp_holds_in_the_fp32_master(runs, case):
    """A step that pushes logit_scale past ln 100 leaves the fp32 master (what the next step updates) and
    the working copy at ln 100, on ZeRO 0-3 x fp32/bf16 (ZeRO-0 bf16 keeps a separate fp32 copy that a
    clamp of the working copy alone would miss)."""
    r = runs["clamp"][case]
    bound = math.log(100)
    # bf16: DeepSpeed makes the fp32 master from the bf16 working copy, so it starts at 4.59375.
    start = bound - 1e-3 if r["precision"] == "fp32" else 4.59375
    assert r["before"] == pytest.approx(start, abs=1e-6), r
    # Exactly the bound (float32 of ln 100): the step pushed it up (by ~lr = 5e-2) and the clamp held.
    assert r["master"] == pytest.approx(bound, abs=1e-6), r
    tol = 1e-6 if r["precision"] == "fp32" else 2e-2  # bf16 working copy: 8 bits of mantissa
    assert r["working"] <= bound + tol, r


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", STAGES)
def test_resume_from_2_ranks_on_4_ranks(runs, zero):
    """Saved on 2 ranks (k=2), resumed on 4 ranks (k=1): ends where the uninterrupted 2-rank run ends."""
    logs = runs["logs"]
    assert _max_abs_diff(_final(logs, f"res24_z{zero}"), _final(logs, f"full2_z{zero}")) <= CROSS_W_TOL
    assert ck.read_meta(_ckpt(logs, f"res24_z{zero}", STEPS))["world_size"] == 4
    assert not list((logs / f"res24_z{zero}" / "checkpoints").glob(f"{UNIVERSAL_PREFIX}*"))  # removed


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

    from ds_clip.export.openclip import WEIGHTS_FILE, main, resolve_pretrained
    from ds_clip.models.model import build_model

    eng = runs["engine"]
    out = tmp_path / "export"
    assert main([eng["path"], str(out)]) == 0
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    assert model.logit_scale.shape == torch.Size([])
    # A named model: register the same config under a name, load the safetensors file as pretrained=.
    cfg_dir = tmp_path / "cfgs"
    cfg_dir.mkdir()
    (cfg_dir / "ds-clip-test-export.json").write_text(json.dumps(MODEL))
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
    from ds_clip.export.openclip import main as export_main

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


def test_the_export_model_is_built_without_a_random_weights_warning(caplog, capfd):
    """ds-clip-export builds open_clip's model from the config, then loads the checkpoint into it: open_clip's
    "No pretrained weights loaded ... initialized randomly" would tell the user the opposite of what happened.
    The filter is gone afterwards (the warning still reaches a user who builds a random model themselves)."""
    import logging

    from ds_clip.export.openclip import build_open_clip_model

    with caplog.at_level(logging.WARNING):
        build_open_clip_model(MODEL)
    err = capfd.readouterr().err
    assert "randomly" not in caplog.text + err and "no CLIP weights" not in caplog.text + err
    assert not logging.getLogger().filters


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
    check_compatible(meta, "--resume x", shapes=shapes, global_batch=8, world_size=4)  # fine
    other = {**shapes, "text_projection": [32, 99]}
    with pytest.raises(ck.CheckpointError, match="incompatible model.*text_projection"):
        check_compatible(meta, "--resume x", shapes=other, global_batch=8, world_size=2)
    with pytest.raises(ck.CheckpointError, match="global batch.*--accum-freq 1"):
        check_compatible(meta, "--resume x", shapes=shapes, global_batch=16, world_size=4)


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_refuses_optimizer_flags_the_load_would_undo(runs):
    """ds-clip-train --resume with --visual-lr changed exits 2 naming the flag (ResumeSettingsError is a
    UserError); the same values spelled differently (--visual-lr = --lr) and schedule flags are accepted."""
    assert issubclass(ck.ResumeSettingsError, UserError)
    assert "--visual-lr 0.001 there, 0.002 here" in runs["engine"]["lr_refusal"]
    saved = ck.read_meta(_ckpt(runs["logs"], "full2_z1", STEPS))["settings"]
    check_resume_settings(saved, {**saved, "visual_lr": saved["lr"], "warmup": 5, "epochs": 9}, "--resume x")
    for name, flag in (("wd", "--wd"), ("beta2", "--beta2"), ("text_ld", "--text-ld")):
        with pytest.raises(ck.ResumeSettingsError, match=f"{flag} "):
            check_resume_settings(saved, {**saved, name: 0.5}, "--resume x")


def _relaunch_a_finished_run(model: str, logs: Path) -> dict:
    """One rank: a 2-step run with --val-data whose final evaluation never finished (its results removed, as a
    time limit after the final save leaves it), relaunched twice with --resume latest, the first time with the
    run folder's latest_complete gone too (copied without it)."""
    args = [
        "--model", model, "--batch-size", "2", "--max-steps", "2", "--logs", str(logs), "--name", "fin",
        "--workers", "0", "--train-num-samples", "64", "--val-data", "synthetic", "--val-num-samples", "8",
    ]  # fmt: skip
    _train(args)
    run = logs / "fin"
    for name in ("eval_results.json", "val_metrics.csv"):
        (run / name).unlink()
    (run / "checkpoints" / ck.POINTER).unlink()
    launch_files = ("settings.json", "ds_config.json", "command.txt")
    before = {n: (run / n).read_bytes() for n in launch_files}
    weights = (run / "checkpoints" / ck.tag_for(2) / "mp_rank_00_model_states.pt").read_bytes()
    _train([*args, "--resume", "latest"])
    first = json.loads((run / "eval_results.json").read_text())
    _train([*args, "--resume", "latest"])
    return {
        "first": first,
        "second": json.loads((run / "eval_results.json").read_text()),
        "launch_files_kept": before == {n: (run / n).read_bytes() for n in launch_files},
        "steps": sorted(p.name for p in (run / "checkpoints").iterdir()),
        "weights_kept": weights
        == (run / "checkpoints" / ck.tag_for(2) / "mp_rank_00_model_states.pt").read_bytes(),
    }


@pytest.mark.distributed
def test_a_relaunched_finished_run_evaluates_what_it_had_not_and_records_no_launch(tmp_path):
    """A re-queued run whose final evaluation did not finish (after its final save) runs that evaluation: its
    metrics appear once, and a further relaunch evaluates nothing again. Nothing is trained or saved, and
    settings.json, ds_config.json and command.txt stay as the run that trained wrote them (the model card lists
    no launch that trained nothing). The first relaunch finds no latest_complete: it continues from the newest
    complete step (the finished run), never a fresh start that would train over it."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": MODEL, "preprocess_cfg": {}}))
    out = spawn_group(1, _relaunch_a_finished_run, f"local-dir:{model_dir}", tmp_path / "logs")
    assert [row["step"] for row in out["first"]] == [2] and "val_loss" in out["first"][0]
    assert out["second"] == out["first"]
    assert out["launch_files_kept"] and out["weights_kept"]
    assert out["steps"] == sorted([ck.tag_for(2), ck.POINTER])


def test_prune_keeps_the_newest_complete_and_deletes_older_only(tmp_path):
    root = tmp_path / "checkpoints"
    for step, complete in ((1, True), (2, False), (3, True), (4, True), (5, False)):
        d = root / ck.tag_for(step)
        d.mkdir(parents=True)
        if complete:
            (d / ck.MARKER).write_text(str(step))
    gone = prune(root, keep=2)
    assert sorted(p.name for p in gone) == [ck.tag_for(1), ck.tag_for(2)]
    assert sorted(p.name for p in root.iterdir()) == [ck.tag_for(3), ck.tag_for(4), ck.tag_for(5)]
    assert prune(root, keep=2) == []  # nothing older than the two newest complete ones


def test_prune_after_a_resume_from_an_older_step_keeps_the_runs_new_checkpoints(tmp_path):
    """Resumed from step 2 of a history that went on to steps 6 and 8, the run saves its own step 4: the
    abandoned steps neither count among the kept ones nor go (by step number alone, 6 and 8 were kept and
    the run's only new checkpoint, step 4, was deleted under --keep-checkpoints 2)."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        (root / ck.tag_for(step)).mkdir(parents=True)
        (root / ck.tag_for(step) / ck.MARKER).write_text(str(step))
    assert prune(root, keep=2, newest=4) == []
    assert prune(root, keep=1, newest=4) == [root / ck.tag_for(2)]
    assert sorted(p.name for p in root.iterdir()) == [ck.tag_for(s) for s in (4, 6, 8)]


def test_rng_state_round_trips_through_json():
    import random

    import numpy as np

    state = json.loads(json.dumps(rng_state()))
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a

"""SigLIP 2's objective (--siglip2) through the real trainer (`ds_clip.training.trainer.train`, what `ds-clip-train`
runs) on 2 ranks over gloo, on webdataset shards whose samples carry box annotations (half of them), with the user's
defaults otherwise (random crops, --workers 1).

One process group trains every run: on each ZeRO stage an uninterrupted run of 4 steps (k=2, m=2) whose
self-supervised terms join at step 3 (--siglip2-selfsup-start 0.5), and a run resumed from its checkpoint at step
2 (before the switch: the resumed run crosses it) or step 3 (after it: the teacher is restored). The
(W, k) splits of the same objective are proven in tests/test_equivalence.py (its siglip2 cases). The heads are small
and two local views are drawn (SIGLIP2_TEST_FLAGS): the arithmetic of the defaults, in less time.
"""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import pytest
import torch

from ds_clip import checkpoint as ck
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL
from ds_clip_harness.runs import SIGLIP2_TEST_FLAGS
from tests.data.test_regions import png, write_shards

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

M, STEPS = 2, 4
STAGES = (0, 1, 2, 3)
RESUME_AT = {0: 2, 1: 3, 2: 2, 3: 3}  # 2: before the self-supervised start (step 3); 3: after it
MODEL = {**E2E_MODEL, "init_logit_bias": -10.0}
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
PARTS = ("siglip2.decoder.", "siglip2.global_head.", "siglip2.patch_head.", "siglip2.masker.")


def _args(model: str, logs: Path, shards: str, name: str, zero: int, *extra: str) -> list[str]:
    return [
        "--model", model, "--siglip2", "--batch-size", str(M), "--accum-freq", "2", "--max-steps", str(STEPS),
        "--log-every-n-steps", "1", "--logs", str(logs), "--name", name, "--zero-stage", str(zero),
        "--lr", "1e-3", "--eps", "1e-4", "--warmup", "1",
        "--train-data", shards, "--dataset-type", "webdataset", "--report-to", "csv",
        "--siglip2-selfsup-start", "0.5", *SIGLIP2_TEST_FLAGS, *extra,
    ]  # fmt: skip


def _ckpt(logs: Path, name: str, step: int) -> Path:
    return logs / name / "checkpoints" / ck.tag_for(step)


def _train(argv: list[str]) -> None:
    from ds_clip.config import parse_settings
    from ds_clip.training.trainer import train

    train(parse_settings(argv))


def _group(model: str, logs: Path, shards: str) -> None:
    for z in STAGES:
        report = ["--report-to", "csv,tensorboard,wandb"] if z == 3 else []
        # Saved where the resumed run starts (and at the end, as every run is).
        _train(
            _args(model, logs, shards, f"full_z{z}", z, "--save-every-n-steps", str(RESUME_AT[z]), *report)
        )
        resume = ["--resume", str(_ckpt(logs, f"full_z{z}", RESUME_AT[z]))]
        _train(_args(model, logs, shards, f"res_z{z}", z, *resume))


def _shards(root: Path) -> str:
    rng = random.Random(0)
    samples = []
    for i in range(64):
        meta = {"url": f"http://127.0.0.1/{i}.png"}
        if i % 2 == 0:
            x0, y0 = rng.randrange(0, 24), rng.randrange(0, 24)
            meta["regions"] = [{"box": [x0, y0, x0 + 20, y0 + 20], "caption": f"square {i % 5}"}]
        samples.append({"key": f"{i:04d}", "image": png(48, 48, (10, 10, 30, 30)), "caption": f"a picture {i}",
                        "json": meta})  # fmt: skip
    return write_shards(root / "shards", samples, per_shard=16)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("siglip2")
    model_dir = root / "model"
    model_dir.mkdir()
    # The trainer's tiny open_clip ViT with SigLIP's learnable bias.
    (model_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": MODEL, "preprocess_cfg": {}}))
    model, logs = f"local-dir:{model_dir}", root / "logs"
    with pytest.MonkeyPatch.context() as env:
        for k, v in WANDB_ENV.items():  # the spawned ranks inherit it: W&B writes offline into the run folder
            env.setenv(k, v)
        spawn_group(2, _group, model, logs, _shards(root))
    return {"logs": logs, "model": model}


def _final(logs: Path, name: str) -> dict[str, torch.Tensor]:
    from ds_clip.export.openclip import consolidated_state_dict

    return consolidated_state_dict(_ckpt(logs, name, STEPS))


def _teacher(logs: Path, name: str) -> dict:
    return torch.load(_ckpt(logs, name, STEPS) / "siglip2_teacher.pt", weights_only=True)


@pytest.mark.parametrize("zero", STAGES)
def test_resume_with_every_term_on_is_step_exact_across_the_self_supervised_start(runs, zero):
    """Resumed before the self-supervised start (ZeRO 0 and 2: the resumed run copies the teacher at step 3) or
    after it (ZeRO 1 and 3: the saved teacher and centers are restored), the weights of every part and the teacher
    at step 4 equal the uninterrupted run's."""
    logs = runs["logs"]
    full, resumed = _final(logs, f"full_z{zero}"), _final(logs, f"res_z{zero}")
    assert full.keys() == resumed.keys()
    assert any(k.startswith("siglip2.decoder.") for k in full)
    assert max(float((full[n] - resumed[n]).abs().max()) for n in full) <= 1e-6
    t_full, t_res = _teacher(logs, f"full_z{zero}"), _teacher(logs, f"res_z{zero}")
    assert t_full["ready"] and t_res["ready"]
    for name, value in t_full["modules"].items():
        assert float((value - t_res["modules"][name]).abs().max()) <= 1e-6, name
    for name in ("center_global", "center_patch"):
        assert float((t_full[name] - t_res[name]).abs().max()) <= 1e-6
        assert float(t_full[name].abs().sum()) > 0


def _rows(logs: Path, name: str) -> list[dict[str, str]]:
    with (logs / name / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_each_term_trains_and_is_logged_apart_in_csv_tensorboard_and_wandb(runs):
    """Every term of the objective is its own column / scalar: the contrastive (sigmoid) loss and the decoder's from
    step 1, self-distillation and masked prediction from the self-supervised start (NaN before: not trained); the
    decoder trained on the samples' boxes (the log's region count). Every part's parameters moved, the teacher's
    image tower is not the student's (an EMA of it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ds_clip.config import parse_settings
    from ds_clip.training.engine import build_model_bundle

    logs = runs["logs"]
    rows = _rows(logs, "full_z3")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert math.isfinite(float(r["loss_contrastive"])) and math.isfinite(float(r["loss_locca"]))
        assert int(float(r["locca_regions"])) > 0  # half the samples carry a box: ARef and GCap rows
    assert [math.isnan(float(r["loss_silc"])) for r in rows] == [True, True, False, False]
    assert [math.isnan(float(r["loss_tips"])) for r in rows] == [True, True, False, False]
    weights = (1.0, 0.25, 0.0625)  # LocCa, and SILC and TIPS x the size factor of a narrow tower (0.25)
    for r in rows[2:]:
        total = float(r["loss_contrastive"]) + sum(
            w * float(r[f"loss_{t}"]) for w, t in zip(weights, ("locca", "silc", "tips"))
        )
        assert float(r["loss"]) == pytest.approx(total, rel=1e-4)
    events = EventAccumulator(str(logs / "full_z3" / "tensorboard"))
    events.Reload()
    for tag in ("train/loss_contrastive", "train/loss_locca", "train/loss_silc", "train/loss_tips"):
        assert tag in events.Tags()["scalars"], events.Tags()["scalars"]
    from tests.test_remote import _wandb_run

    (folder,) = (logs / "full_z3" / "wandb").glob("offline-run-*")
    _, history = _wandb_run(folder)
    last = [h for h in history if "train/loss_tips" in h][-1]
    assert math.isfinite(float(last["train/loss_tips"])) and math.isfinite(float(last["train/loss_silc"]))

    settings = parse_settings(["--model", runs["model"], "--siglip2", *SIGLIP2_TEST_FLAGS])
    start = build_model_bundle(settings.model, seed=settings.data.seed, loss=settings.loss).model.state_dict()
    final = _final(logs, "full_z3")
    for part in PARTS:
        assert any(not torch.equal(v, start[k]) for k, v in final.items() if k.startswith(part)), part
    teacher = _teacher(logs, "full_z3")["modules"]
    visual = {k[len("visual.") :]: v for k, v in teacher.items() if k.startswith("visual.")}
    assert any(not torch.equal(v, final[f"visual.{k}"]) for k, v in visual.items())


def test_the_export_holds_the_encoders_and_loads_in_open_clip(runs, tmp_path):
    """ds-clip-export of the trained run: the encoders only (no siglip2 tensor), loaded strictly by open_clip."""
    import open_clip
    from safetensors.torch import load_file

    from ds_clip.export.openclip import main as export_main

    out = tmp_path / "export"
    assert export_main([str(runs["logs"] / "full_z3"), str(out)]) == 0
    state = load_file(str(out / "open_clip_model.safetensors"))
    assert not [k for k in state if k.startswith("siglip2")]
    model = open_clip.create_model(f"local-dir:{out}")
    model.load_state_dict(state, strict=True)
    assert "SigLIP 2 objective" in (out / "README.md").read_text()


def test_the_plan_line_says_which_tasks_train_and_a_model_without_a_bias_is_refused():
    """Synthetic (or CSV) data has no boxes: the start line says the decoder trains captioning only. A model
    without SigLIP's logit_bias is refused by name (exit 2) before any engine starts."""
    from ds_clip.config import parse_settings
    from ds_clip.siglip2.objective import Siglip2Error, runtime_of
    from ds_clip.training.engine import build_model_bundle

    s = parse_settings(["--model", "ds-clip-tiny-siglip", "--siglip2"])
    rt = runtime_of(build_model_bundle(s.model, seed=0, loss=s.loss).model)
    assert "captioning only: synthetic data has no box annotations" in rt.describe("synthetic")
    assert "where a sample's json has 'regions'" in rt.describe("webdataset")
    s = parse_settings(["--model", "ds-clip-tiny", "--siglip2"])
    with pytest.raises(Siglip2Error, match="--siglip2 trains a SigLIP model"):
        build_model_bundle(s.model, seed=0, loss=s.loss)

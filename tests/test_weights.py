"""Where a run's weights come from (ds_clip.models.weights): one decision, its table case by case, on run folders as
``checkpoint.save`` leaves them. The weights end to end (a first start with --resume latest loads the published
tower, under the launcher): tests/test_hub.py and tests/test_feature_pairs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_clip import checkpoint as ck
from ds_clip.checkpoint.manifest import _manifest
from ds_clip.config import ModelSettings
from ds_clip.models import weights
from ds_clip_harness.models import E2E_MODEL, write_pretrained_dir


def _saved(run_dir: Path, step: int, *, complete: bool = True, point: bool = True) -> Path:
    """A checkpoint folder as a save leaves it (files, meta, manifest, marker, pointer); no engine needed."""
    root = run_dir / "checkpoints"
    path = root / ck.tag_for(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"w" * 64)
    (path / ck.META).write_text(json.dumps({"step": step}))
    (path / ck.MANIFEST).write_text(json.dumps(_manifest(path, {})))
    if complete:
        (path / ck.MARKER).write_text(str(step))
    if point:
        (root / ck.POINTER).write_text(path.name)
    return path


def test_the_table_none_latest_before_and_after_a_save_and_a_path(tmp_path):
    """--resume none, latest with nothing saved yet, latest with a complete checkpoint, a checkpoint PATH and a
    run folder PATH: only the last three continue from a checkpoint; the first two load the model's own weights.
    A pointer or PATH naming a partial folder is an error, never a fresh start."""
    run = tmp_path / "run"
    assert weights.plan_start(run, None) == weights.StartPlan(None)
    first = weights.plan_start(run, "latest")
    assert first.loads_published and first.checkpoint is None  # nothing saved yet: the published weights
    (run / "checkpoints").mkdir(parents=True)
    assert weights.plan_start(run, "latest").loads_published  # a checkpoints folder with nothing complete

    saved = _saved(run, 4)
    latest = weights.plan_start(run, "latest")
    assert (latest.checkpoint, latest.step, latest.loads_published) == (saved, 4, False)
    for given in (saved, run):
        plan = weights.plan_start(tmp_path / "other", str(given))
        assert (plan.checkpoint, plan.step, plan.loads_published) == (saved, 4, False)
    # A run folder with checkpoints, started without --resume: still the model's weights (the trainer refuses
    # the reused --name before this is asked).
    assert weights.plan_start(run, None).loads_published

    _saved(run, 6, complete=False)  # the pointer names a folder without COMPLETE
    with pytest.raises(ck.CheckpointError, match="partial"):
        weights.plan_start(run, "latest")
    with pytest.raises(ck.CheckpointError, match="partial"):
        weights.plan_start(run, str(run / "checkpoints" / ck.tag_for(6)))


def test_agree_start_removes_partial_folders_and_says_where_the_weights_come_from(tmp_path):
    """One process (no process group): rank 0's view is the answer. A save cut short (a folder without COMPLETE,
    not named by the pointer) is removed before the decision; the line names the flag of the weights."""
    run = tmp_path / "run"
    m = ModelSettings(model="ViT-B-32", pretrained="laion2b_s34b_b79k")
    plan = weights.agree_start(run, "latest", is_main=True)
    line = plan.describe(m)
    assert "--resume latest: no complete checkpoint" in line and "--pretrained laion2b_s34b_b79k" in line

    _saved(run, 2)
    cut = _saved(run, 4, complete=False, point=False)
    plan = weights.agree_start(run, "latest", is_main=True)
    assert not cut.exists() and plan.step == 2 and "continuing from" in plan.describe(m)
    assert "step 2" in plan.describe(m)


def test_latest_without_its_pointer_continues_from_the_newest_complete_step_never_fresh(tmp_path):
    """A run folder copied without ``latest_complete`` (complete step folders beside it): --resume latest
    continues from the newest complete step (a partial newer one is not it) and rank 0 writes the pointer
    again, so saves and --keep-checkpoints pruning go on from that history; a fresh start there would train
    over the saved run. A newest complete folder that does not check out is refused naming it."""
    run = tmp_path / "run"
    _saved(run, 2, point=False)
    newest = _saved(run, 4, point=False)
    _saved(run, 6, complete=False, point=False)
    plan = weights.plan_start(run, "latest")
    assert (plan.checkpoint, plan.step, plan.loads_published) == (newest, 4, False)
    assert not (run / "checkpoints" / ck.POINTER).exists()  # plan_start reads only (--dry-run asks it too)
    agreed = weights.agree_start(run, "latest", is_main=True)
    assert (agreed.checkpoint, agreed.step) == (newest, 4)
    assert (run / "checkpoints" / ck.POINTER).read_text() == newest.name
    assert ck.resolve(run, "latest") == newest

    (run / "checkpoints" / ck.POINTER).unlink()
    (newest / "mp_rank_00_model_states.pt").unlink()  # complete-marked, but a file of its manifest is gone
    with pytest.raises(ck.CheckpointError, match=f"no latest_complete pointer.*{newest.name}.*missing"):
        weights.plan_start(run, "latest")


def test_the_model_sources_in_words(tmp_path):
    """Each kind of published or local weights is named by its flag; a teacher's never come from a
    checkpoint."""
    local = write_pretrained_dir(tmp_path / "local", E2E_MODEL)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "open_clip_config.json").write_text("{}")
    cases = [
        (ModelSettings(model="ViT-B-32", pretrained="laion2b_s34b_b79k"), "--pretrained laion2b_s34b_b79k"),
        (ModelSettings(model="hf-hub:org/repo"), "the weights of --model hf-hub:org/repo"),
        (ModelSettings(model=local), f"the weights in --model {local}"),
        (ModelSettings(model=f"local-dir:{tmp_path / 'bare'}"), "random weights"),
        (ModelSettings(model="ds-clip-tiny"), "random weights"),
        (ModelSettings(model="ds-clip-tiny", pretrained_image=True), "--pretrained-image"),
    ]
    for m, said in cases:
        assert said in weights.model_weights(m), (m.model, weights.model_weights(m))
    teacher = ModelSettings(distill_model="ViT-B-32", distill_pretrained="laion2b_s34b_b79k")
    assert (
        weights.teacher_weights(teacher)
        == "--distill-model ViT-B-32 from --distill-pretrained laion2b_s34b_b79k"
    )
    assert weights.teacher_weights(ModelSettings()) is None


def test_resolve_pretrained_takes_an_exported_folders_weights(tmp_path):
    """--pretrained FOLDER: its weights file; a folder without one is one line; tags pass through."""
    local = write_pretrained_dir(tmp_path / "local", E2E_MODEL)
    folder = Path(local[len("local-dir:") :])
    assert weights.resolve_pretrained(str(folder)) == str(folder / weights.WEIGHTS_FILE)
    assert weights.resolve_pretrained("laion2b_s34b_b79k") == "laion2b_s34b_b79k"
    assert weights.resolve_pretrained(None) is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(weights.WeightsError, match="--pretrained"):
        weights.resolve_pretrained(str(tmp_path / "empty"))


def test_a_resumed_start_builds_the_model_without_open_clips_random_init_warning(tmp_path, caplog, capfd):
    """Continuing from a checkpoint (load_published False), ds_clip has just said "continuing from ... (step N)":
    open_clip's "No pretrained weights loaded ... Model initialized randomly" (and its local-dir twin) would say
    the opposite, so they are left out. A fresh start without weights still shows them (true there), and the
    filter is gone after the build."""
    import logging

    from ds_clip.training.engine import build_model_bundle

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    settings = ModelSettings(model=f"local-dir:{model_dir}")
    with caplog.at_level(logging.WARNING):
        build_model_bundle(settings, seed=0, load_published=False)
    said = caplog.text + capfd.readouterr().err
    assert "initialized randomly" not in said and "no CLIP weights" not in said, said
    assert not logging.getLogger().filters
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        build_model_bundle(settings, seed=0, load_published=True)
    assert "initialized randomly" in caplog.text + capfd.readouterr().err

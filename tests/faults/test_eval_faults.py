"""Evaluation never costs the run, and one run owns one folder: the real CLI under the real `deepspeed`
launcher on 2 CPU ranks (docs/faults.md has the same table for users).

    python -m pytest tests/faults/test_eval_faults.py -ra          # about 2 minutes on 2 CPU cores

- A bad --val-data (a CSV without the --csv-img-key column) is one error line per rank and exit 2 before any
  step: no checkpoint, no run files beyond the folder.
- An evaluation that fails on one rank mid-run (an unreadable store, injected with DS_CLIP_INJECT_FAULT) is
  logged in one line and skipped on every rank; training goes on, and the final checkpoint is saved before
  the final evaluation, so a final evaluation that fails too still leaves the run complete (exit 0). A CSV
  --val-data and a --zeroshot-folder are evaluated by the trainer at the other steps.
- A reused --name whose folder holds checkpoints is refused without --resume (exit 2, the folder and the two
  ways out named; the old checkpoints untouched); with --resume latest the same command continues.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from ds_clip_harness.models import E2E_MODEL
from tests.faults.test_faults import (  # noqa: F401 - _shm_op_built: the suite's autouse fixture
    _args,
    _deepspeed,
    _error_lines,
    _latest,
    _shm_op_built,
    _tag,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("eval_fault_model")
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{d}"


COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def _val_csv(tmp_path: Path, rows: int = 6, header: str = "filepath,title") -> Path:
    lines = [header]
    for i in range(rows):
        img = tmp_path / "val_img" / f"{i}.png"
        img.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 32), list(COLORS.values())[i % 3]).save(img)
        lines.append(f"{img},a {list(COLORS)[i % 3]} circle")
    f = tmp_path / "val.csv"
    f.write_text("\n".join(lines) + "\n")
    return f


def _class_tree(root: Path) -> Path:
    for name, rgb in COLORS.items():
        (root / name).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (32, 32), rgb).save(root / name / f"{i}.png")
    return root


def test_bad_val_data_exits_2_before_the_first_step(model_dir, tmp_path):
    val = _val_csv(tmp_path, header="path,title")  # open_clip's --csv-img-key default is "filepath"
    ran = _deepspeed(
        _args(model_dir, tmp_path, "badval", "--val-data", str(val), "--csv-separator", ",", steps=2)
    )
    assert ran.returncode == 2, ran.out[-4000:]
    errors = _error_lines(ran.stderr)
    assert errors and all("--csv-img-key 'filepath'" in e and str(val) in e for e in errors), ran.out[-3000:]
    assert "Traceback" not in ran.out
    assert "step 1/" not in ran.out and not (tmp_path / "badval" / "checkpoints").exists()


def test_failed_evaluations_are_logged_and_the_run_finishes_and_saves(model_dir, tmp_path):
    """Rank 1's evaluation at step 2 and rank 0's final one at step 4 cannot read --val-data: both are logged
    and skipped; steps 1 and 3 evaluate the CSV (every row once), the final zero-shot folder still runs."""
    val, tree = _val_csv(tmp_path), _class_tree(tmp_path / "colors")
    args = _args(
        model_dir, tmp_path, "evalfail", "--val-data", str(val), "--csv-separator", ",", "--val-every-n-steps",
        "1", "--zeroshot-folder", str(tree), "--zeroshot-templates", "simple", steps=4,
    )  # fmt: skip
    ran = _deepspeed(args, fault="eval-error@2:1,eval-error@4:0")
    assert ran.returncode == 0, ran.out[-4000:]
    assert "Traceback" not in ran.out and not _error_lines(ran.stderr)
    failed = [line for line in ran.out.splitlines() if "evaluation failed, skipped" in line]
    assert len(failed) == 2, ran.out[-4000:]
    assert "step 2: --val-data evaluation failed" in failed[0] and "rank 1: --val-data" in failed[0]
    assert "OSError" in failed[0] and "training continues" in failed[0]
    assert "step 4: --val-data evaluation failed" in failed[1] and "rank 0: --val-data" in failed[1]
    run = tmp_path / "evalfail"
    assert _latest(run) == _tag(4)
    history = {h["step"]: h for h in json.loads((run / "eval_results.json").read_text())}
    assert sorted(history) == [1, 3, 4]
    assert history[1]["val_samples"] == history[3]["val_samples"] == 6
    assert "val_loss" not in history[4] and history[4]["zeroshot-folder-samples"] == 6
    assert 0 <= history[4]["zeroshot-folder-top1"] <= 1


def test_reused_name_is_refused_without_resume(model_dir, tmp_path):
    first = _deepspeed(_args(model_dir, tmp_path, "again", steps=2))
    assert first.returncode == 0, first.out[-3000:]
    run = tmp_path / "again"
    settings = (run / "settings.json").read_text()

    ran = _deepspeed(_args(model_dir, tmp_path, "again", "--lr", "1e-3", steps=4))
    assert ran.returncode == 2, ran.out[-4000:]
    errors = _error_lines(ran.stderr)
    assert errors and all(str(run) in e and "--resume latest" in e and "another --name" in e for e in errors)
    assert "Traceback" not in ran.out
    assert _latest(run) == _tag(2) and (run / "settings.json").read_text() == settings

    resumed = _deepspeed(_args(model_dir, tmp_path, "again", "--resume", "latest", steps=3))
    assert resumed.returncode == 0, resumed.out[-3000:]
    assert _latest(run) == _tag(3)

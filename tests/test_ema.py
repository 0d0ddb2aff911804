"""The weight EMA (--ema-decay, ds_clip.step.ema) through the real trainer: kept per rank beside the fp32 master
partition, saved in every checkpoint and resumed exactly (same world size, and resharded on another), evaluated
beside the live weights (ema/ metrics, the same numbers ds-clip-eval gives on ds-clip-export --ema), and a resume
of a checkpoint saved without one starts the average from the resumed weights and says so once.

Two process groups over gloo: 2 ranks (k=2) run the trainings, 4 ranks (k=1) resume one of them on another
world size. Global batch N = 8 everywhere. Split invariance (W2k2 == W4k1) of the EMA and its equality with the
rule applied to the whole masters are proven on the equivalence matrix (tests/test_equivalence.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from ds_clip import checkpoint as ck
from ds_clip.checkpoint.manifest import manifest_files
from ds_clip.config import SettingsError, parse_settings
from ds_clip.step.ema import EmaSchedule, full_state_from_files, rank_files
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL

M, STEPS, SAVE_AT, DECAY = 2, 4, 2, 0.5
VAL = ["--val-data", "synthetic", "--val-num-samples", "16", "--val-every-n-steps", str(SAVE_AT)]


# ------------------------------------------------------------------------------------ rules (no engine)


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize(("gamma", "power"), [(1.0, 2 / 3), (3.0, 0.75)])
def test_decay_is_timms_model_ema_v3(warmup, gamma, power):
    """The decay at each step is timm's ModelEmaV3.get_decay(step): 0 at step 1 (the average becomes the
    weights), the constant decay after, or the warm-up curve capped by it."""
    timm_ema = pytest.importorskip("timm.utils.model_ema")
    ref = timm_ema.ModelEmaV3(
        torch.nn.Linear(1, 1), decay=0.999, use_warmup=warmup, warmup_gamma=gamma, warmup_power=power
    )
    ours = EmaSchedule(0.999, warmup=warmup, warmup_gamma=gamma, warmup_power=power)
    for step in [0, 1, 2, 3, 10, 100, 10_000, 10**6]:
        assert ours.decay_at(step) == pytest.approx(ref.get_decay(step), rel=1e-12, abs=0), step


def test_update_cadence_counts_applied_steps():
    schedule = EmaSchedule(0.9, update_every=3)
    assert [s for s in range(10) if schedule.should_update(s)] == [3, 6, 9]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ema-decay", "1"], "--ema-decay must be in (0, 1)"),
        (["--ema-decay", "0"], "--ema-decay must be in (0, 1)"),
        (["--ema-decay", "-0.5"], "--ema-decay must be in (0, 1)"),
        (["--ema-decay", "0.99", "--ema-update-every", "0"], "--ema-update-every must be >= 1"),
        (["--ema-decay", "0.99", "--ema-warmup-gamma", "0"], "--ema-warmup-gamma must be > 0"),
        (["--ema-update-every", "5"], "--ema-update-every set without --ema-decay"),
        (["--ema-warmup"], "--ema-warmup set without --ema-decay"),
    ],
)
def test_bad_ema_flags_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(SettingsError) as exc:
        parse_settings(argv)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_cli_exit_2_on_decay_outside_0_1(capsys):
    from ds_clip.train import main

    assert main(["--ema-decay", "1.5", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ds-clip-train: error: --ema-decay must be in (0, 1) (the weight the average keeps per update, "
                   "e.g. 0.9999), got 1.5"]  # fmt: skip


# ------------------------------------------------------------------------------ the trainer, 2 and 4 ranks


def _args(model: str, logs: Path, name: str, zero: int, k: int, *extra: str) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--accum-freq", str(k), "--max-steps", str(STEPS),
        "--log-every-n-steps", str(STEPS), "--logs", str(logs), "--name", name, "--workers", "0",
        "--zero-stage", str(zero), "--lr", "1e-3", "--wd", "0.1", "--eps", "1e-4", "--warmup", "1",
        "--save-every-n-steps", str(SAVE_AT), "--train-num-samples", "4000", *extra,
    ]  # fmt: skip


def _ckpt(logs: Path, name: str, step: int) -> Path:
    return logs / name / "checkpoints" / ck.tag_for(step)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(argv: list[str]) -> list[str]:
    """One run of the real trainer (what `ds-clip-train ARGV` runs); returns ds_clip's log lines on this rank."""
    from ds_clip.training.trainer import train

    handler = _Lines()
    logging.getLogger("ds_clip").addHandler(handler)
    try:
        train(parse_settings(argv))
    finally:
        logging.getLogger("ds_clip").removeHandler(handler)
    return handler.lines


def _group_w2(model: str, logs: Path) -> dict:
    ema = ["--ema-decay", str(DECAY)]
    lines = {}
    for z in (2, 3):
        _train(_args(model, logs, f"ema_z{z}", z, 2, *ema, *VAL))
        lines[f"res_z{z}"] = _train([*_args(model, logs, f"res_z{z}", z, 2, *ema, *VAL),
                                     "--resume", str(_ckpt(logs, f"ema_z{z}", SAVE_AT))])  # fmt: skip
    # The same run with neither EMA nor evaluation: the EMA's swaps must leave the training untouched.
    _train(_args(model, logs, "plain_z2", 2, 2, "--save-every-n-steps", "1"))
    # A checkpoint saved without an EMA, resumed with --ema-decay: the average starts from its weights.
    lines["late_z2"] = _train(
        [*_args(model, logs, "late_z2", 2, 2, *ema), "--resume", str(_ckpt(logs, "plain_z2", SAVE_AT))]
    )
    # A checkpoint with an EMA, resumed without --ema-decay: said once, not kept.
    lines["dropped_z2"] = _train(
        [*_args(model, logs, "dropped_z2", 2, 2), "--resume", str(_ckpt(logs, "ema_z2", SAVE_AT))]
    )
    return lines


def _group_w4(model: str, logs: Path) -> dict:
    ema = ["--ema-decay", str(DECAY)]
    return {
        "res24_z2": _train(
            [*_args(model, logs, "res24_z2", 2, 1, *ema), "--resume", str(_ckpt(logs, "ema_z2", SAVE_AT))]
        )
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ema")
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    model, logs = f"local-dir:{model_dir}", root / "logs"
    lines = spawn_group(2, _group_w2, model, logs)
    lines.update(spawn_group(4, _group_w4, model, logs))
    return {"logs": logs, "lines": lines}


def _ema(logs: Path, name: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    return full_state_from_files(_ckpt(logs, name, step))


def _weights(logs: Path, name: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    from ds_clip.export.openclip import consolidated_state_dict

    return consolidated_state_dict(_ckpt(logs, name, step))


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names=None) -> float:
    """Over ``names`` (default: a's keys), which both hold."""
    names = list(a) if names is None else names
    return max(float((a[n] - b[n].view_as(a[n])).abs().max()) for n in names)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_ema_resume_is_step_exact(runs, zero):
    """Interrupted at step 2 and resumed: the EMA at step 4 equals the uninterrupted run's (each rank's
    partition loaded as saved), as the weights do; and it is an average, not the weights."""
    logs = runs["logs"]
    full, resumed = _ema(logs, f"ema_z{zero}"), _ema(logs, f"res_z{zero}")
    assert _max_abs_diff(resumed, full) <= 1e-6
    assert _max_abs_diff(full, _weights(logs, f"ema_z{zero}")) > 1e-5  # over the trained parameters
    assert len(rank_files(_ckpt(logs, f"ema_z{zero}", STEPS))) == 2  # one file per rank, in the manifest
    manifest = manifest_files(json.loads((_ckpt(logs, f"ema_z{zero}", STEPS) / ck.MANIFEST).read_text()))
    assert {"ema_rank0.pt", "ema_rank1.pt"} <= manifest.keys()
    assert all(ck.CHECKSUM in manifest[f"ema_rank{r}.pt"] for r in (0, 1))  # hashed by the rank that wrote it
    assert any("resumed the weight EMA (2 updates)" in line for line in runs["lines"][f"res_z{zero}"])


@pytest.mark.distributed
@pytest.mark.slow
def test_ema_resumed_on_another_world_size(runs):
    """Saved on 2 ranks x k=2 (ZeRO-2), resumed on 4 ranks x k=1: every rank assembles its new partition of the
    average from the saved ones; at step 4 it equals the uninterrupted 2-rank run's (the 4x1 steps equal the
    2x2 ones to float rounding)."""
    logs = runs["logs"]
    assert _max_abs_diff(_ema(logs, "res24_z2"), _ema(logs, "ema_z2")) <= 1e-6
    assert any("on a new world size" in line and "weight EMA" in line for line in runs["lines"]["res24_z2"])


@pytest.mark.distributed
@pytest.mark.slow
def test_ema_and_its_evaluation_leave_the_training_untouched(runs):
    """The run with --ema-decay and an EMA evaluation every 2 steps (the EMA swapped into the masters and
    back) trains the same weights as the run with neither."""
    logs = runs["logs"]
    trained = list(_ema(logs, "ema_z2"))
    assert _max_abs_diff(_weights(logs, "ema_z2"), _weights(logs, "plain_z2"), trained) <= 1e-7


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_without_ema_starts_the_average_from_the_resumed_weights(runs):
    """--ema-decay on a checkpoint saved without an EMA: one warning line naming the checkpoint, and the
    average starts from the weights at step 2: with decay 0.5, EMA(4) = w2/4 + w3/4 + w4/2."""
    logs = runs["logs"]
    said = [line for line in runs["lines"]["late_z2"] if "saved without a weight EMA" in line]
    assert len(said) == 1 and str(_ckpt(logs, "plain_z2", SAVE_AT)) in said[0]
    w2, w3, w4 = (_weights(logs, "plain_z2", s) for s in (2, 3, 4))
    ema = _ema(logs, "late_z2")
    expected = {n: 0.25 * w2[n] + 0.25 * w3[n] + 0.5 * w4[n] for n in ema}
    assert _max_abs_diff(ema, expected) <= 1e-6
    dropped = [line for line in runs["lines"]["dropped_z2"] if "does not keep it" in line]
    assert len(dropped) == 1 and not rank_files(_ckpt(logs, "dropped_z2", STEPS))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_ema_metrics_equal_ds_clip_eval_of_the_ema_export(runs, zero, tmp_path):
    """The ema/ metrics of the run's last evaluation (2 ranks, ZeRO-2 and ZeRO-3: the EMA swapped into the
    partitions) equal what ds-clip-eval computes in one process on `ds-clip-export --ema` of the last
    checkpoint; the live metrics stay those of the live weights (they differ)."""
    from ds_clip.evaluate import main as eval_main
    from ds_clip.export.openclip import main as export_main

    run_dir = runs["logs"] / f"ema_z{zero}"
    history = json.loads((run_dir / "eval_results.json").read_text())
    assert [h["step"] for h in history] == [SAVE_AT, STEPS]
    last = history[-1]
    assert "ema/val_loss" in last and last["ema/val_loss"] != last["val_loss"]
    header = (run_dir / "val_metrics.csv").read_text().splitlines()[0].split(",")
    assert "val_loss" in header and "ema/val_loss" in header
    out, res = tmp_path / "export", tmp_path / "eval.json"
    assert export_main([str(run_dir), str(out), "--ema"]) == 0
    argv = [
        str(out),
        "--val-data",
        "synthetic",
        "--val-num-samples",
        "16",
        "--batch-size",
        "4",
        "--out",
        str(res),
    ]
    assert eval_main(argv) == 0
    offline = json.loads(res.read_text())
    for k, v in offline.items():
        assert v == pytest.approx(last[f"ema/{k}"], rel=1e-4, abs=1e-6), k


@pytest.mark.distributed
@pytest.mark.slow
def test_export_ema_is_the_average_and_refuses_a_checkpoint_without_one(runs, tmp_path, capsys):
    """ds-clip-export --ema writes the assembled average (open_clip's names and 0-dim logit_scale), loaded
    strictly by open_clip; on a checkpoint saved without an EMA it is one line, exit 2."""
    from safetensors.torch import load_file

    from ds_clip.export.openclip import WEIGHTS_FILE, main

    logs = runs["logs"]
    out = tmp_path / "ema"
    assert main([str(_ckpt(logs, "ema_z3", STEPS)), str(out), "--ema"]) == 0
    written = load_file(str(out / WEIGHTS_FILE))
    for name, value in _ema(logs, "ema_z3").items():
        assert torch.equal(written[name].reshape(-1), value.reshape(-1)), name
    assert written["logit_scale"].shape == torch.Size([])
    capsys.readouterr()
    assert main([str(_ckpt(logs, "plain_z2", STEPS)), str(tmp_path / "none"), "--ema"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no weight EMA in this checkpoint" in err[0]

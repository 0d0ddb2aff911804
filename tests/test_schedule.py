"""LR schedules (--lr-scheduler cosine | const | const-cooldown): ds_clip's multiplier is open_clip_train's
scheduler function step by step; the flags are checked; a run of the real trainer interrupted at step 3 and
resumed with --resume latest logs the LR of the straight run at every step."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from ds_clip import checkpoint as ck
from ds_clip.config import parse_settings
from ds_clip.training.schedule import SCHEDULES, Schedule, build_scheduler, cosine_with_warmup, schedule_for
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL

open_clip_scheduler = pytest.importorskip("open_clip_train.scheduler")

BASE_LR = 1e-3


def _open_clip_lrs(
    kind: str, warmup: int, total: int, cooldown: int, power: float, end: float, last: int | None = None
) -> list[float]:
    """The LR open_clip_train's own scheduler function assigns at steps 0..last (default total - 1)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    if kind == "cosine":
        adjust = open_clip_scheduler.cosine_lr(opt, BASE_LR, warmup, total)
    elif kind == "const":
        adjust = open_clip_scheduler.const_lr(opt, BASE_LR, warmup, total)
    else:
        adjust = open_clip_scheduler.const_lr_cooldown(opt, BASE_LR, warmup, total, cooldown, power, end)
    return [adjust(step) for step in range((total - 1 if last is None else last) + 1)]


CASES = [
    # kind, warmup, total, cooldown steps, power, end lr
    ("cosine", 0, 10, 0, 1.0, 0.0),
    ("cosine", 3, 17, 0, 1.0, 0.0),
    ("const", 0, 10, 0, 1.0, 0.0),
    ("const", 4, 12, 0, 1.0, 0.0),
    ("const-cooldown", 0, 12, 4, 1.0, 0.0),
    ("const-cooldown", 2, 20, 8, 0.5, 1e-4),
    ("const-cooldown", 3, 20, 5, 2.0, 2.5e-4),
    ("const-cooldown", 5, 12, 10, 1.0, 0.0),  # the cooldown starts inside the warmup (open_clip's arithmetic)
]


@pytest.mark.parametrize("kind,warmup,total,cooldown,power,end", CASES)
def test_multiplier_is_open_clip_scheduler_step_by_step(kind, warmup, total, cooldown, power, end):
    """peak x multiplier(step) is what open_clip's cosine_lr / const_lr / const_lr_cooldown assign, and the
    LambdaLR DeepSpeed steps puts exactly that into every group, each from its own peak."""
    expected = _open_clip_lrs(kind, warmup, total, cooldown, power, end)
    sched = Schedule(
        kind, warmup=warmup, total=total, cooldown=cooldown, power=power, end_ratio=end / BASE_LR
    )
    assert [BASE_LR * sched.multiplier(s) for s in range(total)] == pytest.approx(
        expected, rel=1e-12, abs=1e-18
    )
    peaks = [BASE_LR, 3 * BASE_LR, 0.0]  # per-tower peaks: each group scaled from its own
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": p} for p in peaks])
    lambda_lr = build_scheduler(opt, sched)
    for step in range(total):
        for group, peak in zip(opt.param_groups, peaks):
            assert group["lr"] == pytest.approx(peak / BASE_LR * expected[step], rel=1e-12, abs=1e-18)
        opt.step()
        lambda_lr.step()


def test_schedule_names_are_the_flag_choices():
    assert SCHEDULES == ("cosine", "const", "const-cooldown")


def test_epochs_cooldown_is_converted_with_steps_per_epoch():
    """open_clip: cooldown steps = steps per epoch x --epochs-cooldown; the cooldown starts that many steps
    before the end. Without --max-steps the run's epochs give the steps per epoch."""
    s = parse_settings(
        ["--lr-scheduler", "const-cooldown", "--epochs", "4", "--epochs-cooldown", "1", "--lr-cooldown-end",
         "1e-4", "--lr-cooldown-power", "2", "--lr", "1e-3"]
    )  # fmt: skip
    sched = schedule_for(s.optim, total_steps=40)
    assert (sched.cooldown, sched.total, sched.power, sched.end_ratio) == (10, 40, 2.0, pytest.approx(0.1))
    assert schedule_for(s.optim, total_steps=40, steps_per_epoch=7).cooldown == 7
    assert sched.multiplier(29) == 1.0 and sched.multiplier(30) == 1.0 and sched.multiplier(31) < 1.0
    s = parse_settings(["--lr-scheduler", "const-cooldown", "--epochs-cooldown", "2", "--max-steps", "50"])
    assert schedule_for(s.optim, total_steps=50, steps_per_epoch=5).cooldown == 10


BAD = [
    (["--epochs-cooldown", "1"], "--epochs-cooldown"),
    (["--lr-scheduler", "const-cooldown"], "--epochs-cooldown"),
    (["--lr-scheduler", "const-cooldown", "--epochs-cooldown", "0"], "--epochs-cooldown"),
    (["--lr-scheduler", "const-cooldown", "--epochs-cooldown", "3", "--epochs", "2"], "--epochs-cooldown"),
    (
        ["--lr-scheduler", "const-cooldown", "--epochs-cooldown", "1", "--lr-cooldown-power=-1"],
        "--lr-cooldown-power",
    ),  # fmt: skip
    (
        ["--lr-scheduler", "const-cooldown", "--epochs-cooldown", "1", "--lr-cooldown-end=-1e-5"],
        "--lr-cooldown-end",
    ),  # fmt: skip
    (
        [
            "--lr-scheduler",
            "const-cooldown",
            "--epochs-cooldown",
            "1",
            "--lr",
            "1e-4",
            "--lr-cooldown-end",
            "1e-3",
        ],
        "--lr-cooldown-end",
    ),  # fmt: skip
    (["--lr-cooldown-power", "2"], "--lr-cooldown-power"),
    (["--lr-scheduler", "const", "--lr-cooldown-end", "1e-5"], "--lr-cooldown-end"),
    (["--lr-scheduler", "linear"], "--lr-scheduler"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_schedule_flags_exit_2_naming_the_flag(argv, flag, capsys):
    from ds_clip.train import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal (an unknown choice)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert flag in err and "error" in err and "expected one argument" not in err, err


# ------------------------------------------------------------------- resume through the real trainer

M, SAMPLES, EPOCHS, STOP_AT = 2, 16, 2, 3  # N = 2 ranks x 2 = 4 pairs a step: 4 steps an epoch, 8 in all
RESUME_SCHEDULES = {
    "cosine": ["--lr-scheduler", "cosine", "--warmup", "4"],
    "const-cooldown": ["--lr-scheduler", "const-cooldown", "--epochs-cooldown", "1", "--warmup", "2",
                       "--lr-cooldown-power", "2", "--lr-cooldown-end", "1e-4"],
}  # fmt: skip
# A DeepSpeed JSON scheduler block (one LR for every group: no per-tower LRs with it), 8 steps: warmup, then decay.
JSON_SCHEDULERS = {
    "WarmupDecayLR": {
        "total_num_steps": 8, "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
        "warmup_type": "linear",
    },
}  # fmt: skip


def _args(model: str, logs: Path, name: str, schedule: list[str], *, towers: bool = True) -> list[str]:
    # Several groups with their own peaks (--visual-lr, --text-ld): the logged LR is group 0's (--lr).
    own = ["--visual-lr", "2e-3", "--text-ld", "0.5"] if towers else []
    return [
        "--model", model, "--batch-size", str(M), "--epochs", str(EPOCHS), "--train-num-samples", str(SAMPLES),
        "--lr", "1e-3", *own, "--workers", "0", "--logs", str(logs), "--name", name, "--log-every-n-steps", "1",
        "--report-to", "csv,tensorboard", "--save-every-n-steps", str(STOP_AT), "--zero-stage", "1", *schedule,
    ]  # fmt: skip


def _train(argv: list[str]) -> list[float]:
    """One run of the real trainer; returns the LR of group 0 that each optimizer update ran with, read from the
    optimizer's param groups as the update starts (what trained, whatever any log says)."""
    from ds_clip.training.trainer import Trainer

    trainer = Trainer(parse_settings(argv))
    applied: list[float] = []
    optimizer = trainer.engine.basic_optimizer
    first = optimizer.param_groups[0]

    def read(opt, args, kwargs) -> None:
        # ZeRO-1/2 step the torch optimizer once per group, each time with that group alone in param_groups.
        if opt.param_groups[0] is first:
            applied.append(float(first["lr"]))

    optimizer.register_step_pre_hook(read)
    trainer.train()
    return applied


def _interrupted_copy(logs: Path, straight: str, name: str) -> None:
    """The run folder a run stopped right after step 3 leaves: its complete checkpoint of step 3 as the
    latest, and the metrics it logged up to step 3."""
    src, dst = logs / straight, logs / name
    (dst / "checkpoints").mkdir(parents=True)
    tag = ck.tag_for(STOP_AT)
    shutil.copytree(src / "checkpoints" / tag, dst / "checkpoints" / tag)
    (dst / "checkpoints" / ck.POINTER).write_text(tag)
    lines = (src / "metrics.csv").read_text().splitlines(keepends=True)
    (dst / "metrics.csv").write_text("".join(lines[: 1 + STOP_AT]))


def _group_resume(model: str, logs: Path) -> dict[str, list[float]]:
    import torch.distributed as dist

    applied = {}
    for kind, schedule in RESUME_SCHEDULES.items():
        applied[f"straight-{kind}"] = _train(_args(model, logs, f"straight-{kind}", schedule))
        if dist.get_rank() == 0:
            _interrupted_copy(logs, f"straight-{kind}", f"resumed-{kind}")
        dist.barrier()
        applied[f"resumed-{kind}"] = _train(
            [*_args(model, logs, f"resumed-{kind}", schedule), "--resume", "latest"]
        )
    for kind, params in JSON_SCHEDULERS.items():
        cfg = logs / f"{kind}.json"
        if dist.get_rank() == 0:
            cfg.write_text(json.dumps({"scheduler": {"type": kind, "params": params}}))
        dist.barrier()
        applied[kind] = _train(_args(model, logs, kind, ["--ds-config", str(cfg)], towers=False))
    return applied


def _rows(run: Path) -> list[dict]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def _tensorboard_lrs(run: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/lr")}


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("schedule_resume")
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    logs = root / "logs"
    applied = spawn_group(2, _group_resume, f"local-dir:{model_dir}", logs)
    return {"logs": logs, "applied": applied}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(RESUME_SCHEDULES))
def test_resume_continues_the_schedule_exactly(resumed_runs, kind):
    """2 ranks, ZeRO-1, 8 optimizer steps (2 epochs of 4): the run resumed (--resume latest) from its
    checkpoint of step 3 logs at every step the LR of the straight run, which is open_clip's schedule: the row
    of step s holds the LR step s trained at (open_clip's schedule at step s - 1, 0-based), as the optimizer's
    param groups held it when the update ran; and the same losses. TensorBoard's train/lr is the same value."""
    logs, applied = resumed_runs["logs"], resumed_runs["applied"]
    straight, resumed = _rows(logs / f"straight-{kind}"), _rows(logs / f"resumed-{kind}")
    total = EPOCHS * SAMPLES // (2 * M)
    assert [int(r["step"]) for r in straight] == list(range(1, total + 1))
    assert [int(r["step"]) for r in resumed] == list(range(1, total + 1))
    assert [float(r["lr"]) for r in resumed] == [float(r["lr"]) for r in straight]
    assert [float(r["loss"]) for r in resumed[STOP_AT:]] == pytest.approx(
        [float(r["loss"]) for r in straight[STOP_AT:]], rel=1e-6
    )
    steps_per_epoch = SAMPLES // (2 * M)
    cooldown = steps_per_epoch if kind == "const-cooldown" else 0
    warmup = 4 if kind == "cosine" else 2
    expected = _open_clip_lrs(kind, warmup, total, cooldown, 2.0, 1e-4)
    assert [float(r["lr"]) for r in straight] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert applied[f"straight-{kind}"] == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert applied[f"resumed-{kind}"] == pytest.approx(expected[STOP_AT:], rel=1e-12, abs=1e-18)
    if kind == "cosine":  # --warmup 4 --lr 1e-3, 8 steps: what open_clip_train's own log prints
        assert [float(r["lr"]) for r in straight] == pytest.approx(
            [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 8.535534e-4, 5e-4, 1.464466e-4], rel=1e-6
        )
    tb = _tensorboard_lrs(logs / f"straight-{kind}")
    assert sorted(tb) == list(range(1, total + 1))
    assert [tb[s] for s in sorted(tb)] == pytest.approx(expected, rel=1e-6)  # stored as float32


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(JSON_SCHEDULERS))
def test_a_json_scheduler_logs_the_lr_each_step_trained_at(resumed_runs, kind):
    """A DeepSpeed JSON scheduler block (DeepSpeed builds it and steps it in engine.step()): the LR in the row of
    step s, in metrics.csv and TensorBoard alike, is the one the optimizer's param groups held when update s ran,
    not the one the scheduler set for the next step."""
    logs, applied = resumed_runs["logs"], resumed_runs["applied"][kind]
    rows = _rows(logs / kind)
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert len(applied) == 8
    assert [float(r["lr"]) for r in rows] == pytest.approx(applied, rel=1e-9, abs=1e-15)
    tb = _tensorboard_lrs(logs / kind)
    assert [tb[s] for s in range(1, 9)] == pytest.approx(applied, rel=1e-6, abs=1e-12)
    assert len(set(applied)) > 2, applied  # a schedule that moves: a row one step off would differ


def test_a_resume_trains_its_first_step_at_the_rebuilt_schedule():
    """A checkpoint holds the LR its own schedule set for the next step; resumed with a longer run (the schedule
    rebuilt from the new flags, as open_clip does), the first resumed step trains at the new schedule's LR."""
    from ds_clip.checkpoint.load import schedule_next_lr

    def built(total: int):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
        return opt, build_scheduler(opt, Schedule("cosine", warmup=1, total=total))

    opt, sched = built(2)
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.0  # the 2-step cosine's end: what the checkpoint holds
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    opt, sched = built(3)
    opt.load_state_dict(saved_opt)
    sched.load_state_dict(saved_sched)
    schedule_next_lr(sched, opt.param_groups)  # what every resume runs after the load (checkpoint.load)
    want = BASE_LR * cosine_with_warmup(2, warmup=1, total=3)
    assert opt.param_groups[0]["lr"] == pytest.approx(want) == pytest.approx(BASE_LR / 2)
    assert sched.get_last_lr() == pytest.approx([want])

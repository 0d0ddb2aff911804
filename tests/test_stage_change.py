"""A checkpoint resumes on any number of ranks under any ZeRO stage, the default or a chosen one, and ends where a
straight run on the new rank count ends (same --global-batch-size), fp32 and bf16.

    python -m pytest -q tests/test_stage_change.py        # a few minutes on 2 CPU cores

The default stage follows the rank count (fp32: ZeRO-0 up to 4 ranks, ZeRO-1 above; bf16: ZeRO-0 on one rank,
ZeRO-1 on more), so a job that comes back on another number of ranks with the defaults changes stage: bf16
1 -> 2 ranks is ZeRO-0 -> ZeRO-1 with nothing chosen. Every source stage (0-3, saved on 1 rank) resumes under
every other stage on 2 ranks, both precisions. The real trainer (what `ds-clip-train` runs) in two process
groups over gloo (1 rank, then 2), many runs each; N = 8, m = 2 (k = 4 on 1 rank, 2 on 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_clip import checkpoint as ck
from ds_clip.checkpoint.layout import UNIVERSAL_PREFIX
from ds_clip_harness.cases import fp16_supported
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL

M, N, STEPS, SAVE_AT = 2, 8, 4, 2
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16")
# The stage ds-clip-train picks without --zero-stage (ds_clip.ds_config.resolve.default_preset).
DEFAULT_STAGE = {("fp32", 1): 0, ("fp32", 2): 0, ("bf16", 1): 0, ("bf16", 2): 1}
# Every saved stage resumed under every other one: (precision, saved on 1 rank, resumed on 2 ranks).
MOVES = [(p, s, t) for p in PRECISIONS for s in STAGES for t in STAGES if s != t]
# fp32: the same arithmetic in the same order up to the reduction's rounding, and AdamW at eps 1e-4 keeps that
# rounding from turning into lr-sized updates (as tests/test_checkpoint.py); a lost moment, step count, learning
# rate or data position moves parameters by ~lr = 1e-3 per step, 100x this bound.
TOL = 1e-5

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# The resume matrix, (optimizer, saved stage on 1 rank, resumed stage on 2 ranks, schedule), inside the same two
# process groups: every optimizer (adamw, sgd, muon), stage change (0->3, 3->1, 1->2, each with another W) and
# schedule (the flags', a JSON WarmupLR, a JSON WarmupCosineLR) at least once, not the cross product.
MATRIX = [
    ("sgd", 0, 3, "WarmupLR"),
    ("adamw", 0, 3, "WarmupCosineLR"),
    ("sgd", 3, 1, "WarmupLR"),
    ("muon", 1, 2, "flags"),
]
SCHEDULES = {
    # Linear warm-up from 1e-4: each of the 4 steps trains at another lr, none at 0.
    "WarmupLR": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                "warmup_num_steps": 3, "warmup_type": "linear"}},
    "WarmupCosineLR": {"type": "WarmupCosineLR", "params": {"total_num_steps": STEPS, "warmup_num_steps": 2,
                                                            "warmup_min_ratio": 0.1}},
}  # fmt: skip
# Muon orthogonalizes each update (every element moves by ~lr whatever the gradient's size), which turns the
# reduction's rounding into ~1e-5 here; a lost momentum changes the update's direction, ~lr = 1e-3 per step.
MATRIX_TOL = {"adamw": TOL, "sgd": TOL, "muon": 1e-4}


def _flag(precision: str, world: int, zero: int) -> int | None:
    """--zero-stage for ``zero``, or None (no flag) where it is the default on ``world`` ranks."""
    return None if DEFAULT_STAGE[(precision, world)] == zero else zero


def _args(model: str, logs: Path, name: str, precision: str, zero: int | None, *extra: str) -> list[str]:
    stage = [] if zero is None else ["--zero-stage", str(zero)]
    return [
        "--model", model, "--batch-size", str(M), "--global-batch-size", str(N), "--max-steps", str(STEPS),
        "--log-every-n-steps", str(STEPS), "--logs", str(logs), "--name", name, "--workers", "0",
        "--precision", precision, "--lr", "1e-3", "--wd", "0.1", "--eps", "1e-4", "--warmup", "1",
        "--save-every-n-steps", str(SAVE_AT), "--train-num-samples", "4000", *stage, *extra,
    ]  # fmt: skip


def _train(argv: list[str]) -> dict[str, torch.Tensor] | None:
    """One run of the real trainer, exactly as `ds-clip-train ARGV` runs it (``ds_clip.training.trainer.train``: build,
    then train); with --resume, the optimizer state the load left, read between the two."""
    from ds_clip.config import parse_settings
    from ds_clip.training.trainer import Trainer

    trainer = Trainer(parse_settings(argv))
    loaded = _optimizer_state(trainer.engine) if "--resume" in argv else None
    trainer.train()
    return loaded


def _matrix_args(model: str, logs: Path, name: str, case: tuple, zero: int, *extra: str) -> list[str]:
    opt, schedule = case[0], case[3]
    sched = (
        ["--warmup", "1"] if schedule == "flags" else ["--ds-config", str(logs.parent / f"{schedule}.json")]
    )
    # AdamW at eps 1e-4 keeps the reduction's rounding from turning into lr-sized updates (as above); SGD with
    # momentum, so that it has a state to carry.
    sched += {"adamw": ["--eps", "1e-4"], "sgd": ["--momentum", "0.9"]}.get(opt, [])
    return [
        "--model", model, "--batch-size", str(M), "--global-batch-size", str(N), "--max-steps", str(STEPS),
        "--log-every-n-steps", str(STEPS), "--logs", str(logs), "--name", name, "--workers", "0",
        "--precision", "fp32", "--lr", "1e-3", "--wd", "0.1", "--opt", opt, "--zero-stage", str(zero),
        "--save-every-n-steps", str(SAVE_AT), "--train-num-samples", "4000", *sched, *extra,
    ]  # fmt: skip


def _train_watched(argv: list[str]) -> dict:
    """A run of the real trainer that records, before each optimizer step, every group's lr (what the step trains
    with), and the line a resume logs."""
    import logging

    from ds_clip.config import parse_settings
    from ds_clip.training.trainer import Trainer

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ds_clip").addHandler(handler)
    try:
        trainer = Trainer(parse_settings(argv))
        lrs, step = [], trainer.run_step.train

        def train(*args, **kwargs):
            lrs.append([g["lr"] for g in trainer.engine.optimizer.param_groups])
            return step(*args, **kwargs)

        trainer.run_step.train = train  # observed only: the same call, after reading the groups
        trainer.train()
    finally:
        logging.getLogger("ds_clip").removeHandler(handler)
    return {"lrs": lrs, "resumed": [line for line in lines if line.startswith("resumed from")]}


def _matrix_saved(model: str, logs: Path) -> dict:
    """On 1 rank, each case's straight run under its saved stage: 4 steps, saved at step 2; and an fp16 run on
    ZeRO-1 (where the CPU runs fp16), whose loss scale has dropped from its start by then (the first steps
    overflow on a CPU and are skipped)."""
    out = {
        case: _train_watched(_matrix_args(model, logs, _name(case, "src"), case, case[1])) for case in MATRIX
    }
    if fp16_supported():
        out["fp16"] = _train_watched(_args(model, logs, "fp16_z1", "fp16", 1))
    return out


def _matrix_resumed(model: str, logs: Path) -> dict:
    """On 2 ranks, each case resumed from its straight run's step 2 under its other stage."""
    out = {}
    for case in MATRIX:
        ckpt = logs / _name(case, "src") / "checkpoints" / ck.tag_for(SAVE_AT)
        out[case] = _train_watched(
            _matrix_args(model, logs, _name(case, "res"), case, case[2], "--resume", str(ckpt))
        )
    if fp16_supported():
        ckpt = str(logs / "fp16_z1" / "checkpoints" / ck.tag_for(SAVE_AT))
        out["fp16"] = _train_watched(_args(model, logs, "fp16_z1_to_z3", "fp16", 3, "--resume", ckpt))
        try:
            _train(_args(model, logs, "fp16_z1_to_bf16", "bf16", 2, "--resume", ckpt))
            out["bf16"] = None
        except ck.CheckpointError as exc:
            out["bf16"] = str(exc)
    return out


def _name(case: tuple, kind: str) -> str:
    return f"{kind}_{case[0]}_z{case[1]}_z{case[2]}_{case[3]}"


def _optimizer_state(engine) -> dict[str, torch.Tensor]:
    """What the next optimizer step reads: every trainable parameter's fp32 master and Adam moments (whole, in the
    engine's names), the step count and each group's learning rate. A collective on ZeRO 1-3."""
    from deepspeed.utils import safe_get_full_optimizer_state

    from ds_clip.step.clamp import full_fp32_master

    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # the torch optimizer inside DeepSpeed's wrappers
    # ZeRO-0: the torch optimizer's own state; with bf16, that of the wrapper's fp32 copy of the parameter.
    masters = {id(lp): hp for lps, hps in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", []))
               for lp, hp in zip(lps, hps)}  # fmt: skip
    if getattr(opt, "_hp_optimizer_states_linked", True) is False:
        # ZeRO-1/2 and bf16 link each parameter to its slice of the moments at their first step; DeepSpeed's
        # reader needs that link (views only: the step makes the same).
        opt._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"{name}/fp32"] = full_fp32_master(engine, name)
        for key in ("exp_avg", "exp_avg_sq"):
            if engine.zero_optimization_stage() >= 1:
                value = safe_get_full_optimizer_state(p, key)
            else:
                value = base.state[masters.get(id(p), p)][key]
            out[f"{name}/{key}"] = (
                value.detach()
                .float()
                .cpu()
                .reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                .clone()
            )
    out["step"] = torch.tensor(sorted({float(st["step"]) for st in base.state.values() if "step" in st}))
    out["lr"] = torch.tensor([g["lr"] for g in opt.param_groups])
    return out


def _saved(model: str, logs: Path) -> None:
    """On 1 rank: every stage, both precisions (ZeRO-0 with the defaults: no --zero-stage), saving at step 2;
    then each resumed from its own step 2 as saved (DeepSpeed's plain load): the state every move must load."""
    for p in PRECISIONS:
        for z in STAGES:
            _train(_args(model, logs, f"one_{p}_z{z}", p, _flag(p, 1, z)))
            ckpt = logs / f"one_{p}_z{z}" / "checkpoints" / ck.tag_for(SAVE_AT)
            state = _train(_args(model, logs, f"same_{p}_z{z}", p, _flag(p, 1, z), "--resume", str(ckpt)))
            torch.save(state, logs / f"loaded_{p}_z{z}.pt")


def _resumed(model: str, logs: Path) -> dict:
    """On 2 ranks: the straight run of every stage, then every saved stage resumed under every other one (the
    default stage without --zero-stage)."""
    for p in PRECISIONS:
        for z in STAGES:
            _train(_args(model, logs, f"two_{p}_z{z}", p, _flag(p, 2, z)))
    loaded = {}
    for p, s, t in MOVES:
        ckpt = logs / f"one_{p}_z{s}" / "checkpoints" / ck.tag_for(SAVE_AT)
        moved = _train(_args(model, logs, f"res_{p}_z{s}_to_z{t}", p, _flag(p, 2, t), "--resume", str(ckpt)))
        want = torch.load(logs / f"loaded_{p}_z{s}.pt", weights_only=True)
        # Every entry that is not bit for bit the checkpoint's own load, with its largest difference.
        loaded[(p, s, t)] = {
            "keys": sorted(moved) == sorted(want),
            "differ": {
                k: float((moved[k] - want[k]).abs().max()) for k in want if not torch.equal(moved[k], want[k])
            },
            "step": moved["step"].tolist(),
        }
    return loaded


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stages")
    (root / "model").mkdir()
    (root / "model" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    for schedule, block in SCHEDULES.items():
        (root / f"{schedule}.json").write_text(json.dumps({"scheduler": block}))
    model, logs = f"local-dir:{root / 'model'}", root / "logs"
    straight = spawn_group(1, _both, _saved, _matrix_saved, model, logs)
    moved, resumed = spawn_group(2, _both, _resumed, _matrix_resumed, model, logs)
    return {"logs": logs, "moved": moved, "straight": straight, "resumed": resumed}


def _both(first, second, model: str, logs: Path):
    """Two sets of runs in one process group; the second's result (and the first's, where it has one)."""
    done = first(model, logs)
    result = second(model, logs)
    return result if done is None else (done, result)


def _final(logs: Path, name: str) -> dict[str, torch.Tensor]:
    from ds_clip.export.openclip import consolidated_state_dict

    return consolidated_state_dict(logs / name / "checkpoints" / ck.tag_for(STEPS))


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_the_default_stage_follows_the_rank_count(runs):
    """What the user never chose changes: bf16 is ZeRO-0 on 1 rank and ZeRO-1 on 2 (fp32 stays ZeRO-0 up to 4)."""
    for p in PRECISIONS:
        for world, kind in ((1, "one"), (2, "two")):
            stage = DEFAULT_STAGE[(p, world)]
            meta = ck.read_meta(runs["logs"] / f"{kind}_{p}_z{stage}" / "checkpoints" / ck.tag_for(STEPS))
            assert meta["zero_stage"] == stage and meta["settings"].get("zero_stage") is None


@pytest.mark.parametrize("precision, saved, resumed", MOVES, ids=[f"{p}-z{s}-to-z{t}" for p, s, t in MOVES])
def test_a_checkpoint_of_one_stage_loads_exactly_under_another_on_another_rank_count(
    runs, precision, saved, resumed
):
    """Saved at step 2 on 1 rank under ZeRO-`saved`, resumed on 2 ranks under ZeRO-`resumed` (the default where it
    is one: bf16 ZeRO-0 -> ZeRO-1 with no flag): the fp32 masters, Adam moments, step count and learning rates
    the next step reads are bit for bit those of the checkpoint loaded back on its own rank count and stage."""
    moved = runs["moved"][(precision, saved, resumed)]
    assert moved["keys"] and not moved["differ"], moved["differ"]
    # DeepSpeed's bf16 ZeRO-0 optimizer takes one step with zero gradients when it is built: its Adam count runs
    # one ahead of the trainer's steps, and a move carries it as saved.
    assert moved["step"] == [SAVE_AT + (precision == "bf16" and saved == 0)]


@pytest.mark.parametrize("saved, resumed", [(s, t) for p, s, t in MOVES if p == "fp32"])
def test_fp32_a_resume_under_another_stage_ends_where_the_straight_run_of_that_stage_ends(
    runs, saved, resumed
):
    """fp32: after the move, 2 more steps on 2 ranks: the weights at step 4 equal the straight 2-rank run of
    ZeRO-`resumed` (same N) within 1e-5; its own checkpoints are of its own stage and world size, and the
    converted copy is gone, with no `latest_universal` left naming it. (bf16 rounds differently on each stage and
    rank count, straight runs included: their weights differ by a bf16 rounding step, ~4e-3 here, so bf16 is held
    to the exact load above.)"""
    logs = runs["logs"]
    name = f"res_fp32_z{saved}_to_z{resumed}"
    meta = ck.read_meta(logs / name / "checkpoints" / ck.tag_for(STEPS))
    assert (meta["world_size"], meta["zero_stage"], meta["step"]) == (2, resumed, STEPS)
    diff = _max_abs_diff(_final(logs, name), _final(logs, f"two_fp32_z{resumed}"))
    assert diff <= TOL, diff
    assert not list((logs / name / "checkpoints").glob(f"{UNIVERSAL_PREFIX}*"))
    # Nor the pointer DeepSpeed's ds_to_universal writes to it (it would name the deleted folder).
    assert not (logs / name / "checkpoints" / "latest_universal").exists()


def _four(model: str, logs: Path) -> None:
    _train(_args(model, logs, "four", "fp32", None, "--batch-size", "1", "--global-batch-size", "20"))


def _five(model: str, logs: Path) -> None:
    ckpt = logs / "four" / "checkpoints" / ck.tag_for(SAVE_AT)
    _train(_args(model, logs, "five", "fp32", None, "--batch-size", "1", "--global-batch-size", "20"))
    _train(
        _args(model, logs, "four_to_five", "fp32", None, "--batch-size", "1", "--global-batch-size", "20",
              "--resume", str(ckpt))
    )  # fmt: skip


def test_fp32_with_the_defaults_4_ranks_come_back_as_5(tmp_path):
    """The user's case: fp32 with no stage chosen is ZeRO-0 on 4 ranks and ZeRO-1 on 5. A job saved on 4 ranks
    (N = 20, m = 1: k = 5) comes back on 5 (k = 4) with the same command: it resumes, and ends where a straight
    5-rank run ends (<= 1e-5)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    model, logs = f"local-dir:{tmp_path / 'model'}", tmp_path / "logs"
    spawn_group(4, _four, model, logs)
    spawn_group(5, _five, model, logs)
    stages = [
        ck.read_meta(logs / n / "checkpoints" / ck.tag_for(STEPS))["zero_stage"] for n in ("four", "five")
    ]
    assert stages == [0, 1]
    assert ck.read_meta(logs / "four_to_five" / "checkpoints" / ck.tag_for(STEPS))["zero_stage"] == 1
    diff = _max_abs_diff(_final(logs, "four_to_five"), _final(logs, "five"))
    assert diff <= TOL, diff


@pytest.mark.parametrize("case", MATRIX, ids=["-".join(map(str, c)) for c in MATRIX])
def test_a_resume_onto_another_stage_and_world_size_is_the_straight_run(runs, case):
    """Saved at step 2 on 1 rank under one stage, resumed on 2 ranks under another, for SGD with momentum (its
    ``momentum_buffer`` and no step count), AdamW and Muon (``momentum_buffer`` beside its AdamW's moments), with
    the flags' schedule or a JSON WarmupLR / WarmupCosineLR: every step after the move trains at the lr the straight
    run trained that step at (DeepSpeed's schedulers restore only their position; the lr they set at construction,
    written into the groups, trained the first step after the move), and the weights at step 4 are the straight
    run's within the gradient contract's rounding. The one resume line says what was restored."""
    straight, resumed = runs["straight"][case], runs["resumed"][case]
    assert resumed["lrs"] == straight["lrs"][SAVE_AT:], (resumed["lrs"], straight["lrs"])
    logs = runs["logs"]
    diff = _max_abs_diff(_final(logs, _name(case, "res")), _final(logs, _name(case, "src")))
    assert diff <= MATRIX_TOL[case[0]], diff
    (line,) = resumed["resumed"]
    lrs = ",".join(f"{lr:.6g}" for lr in straight["lrs"][SAVE_AT])
    keys = {
        "sgd": "[momentum_buffer | momentum_buffer]",
        "adamw": "[exp_avg,exp_avg_sq,step | exp_avg,exp_avg_sq,step]",
    }
    assert (
        f"(W 1 ZeRO-{case[1]} fp32 -> W 2 ZeRO-{case[2]} fp32, on a new world size / ZeRO stage)" in line
    ), line
    assert f"lr per group next step [{lrs}]" in line and "loss scale none" in line, line
    assert f"data epoch 0 step {SAVE_AT} in epoch" in line and "EMA none" in line, line
    if case[0] == "muon":
        assert "momentum_buffer" in line and "exp_avg,exp_avg_sq,step" in line, line
    else:
        assert f"optimizer state per group {keys[case[0]]}" in line, line
    assert ("optimizer step none counted" if case[0] == "sgd" else f"optimizer step {SAVE_AT}") in line, line
    if case[3] != "flags":
        assert f"scheduler {case[3]} at {SAVE_AT - 1}" in line, line


@pytest.mark.skipif(
    not fp16_supported(), reason="this CPU runs no fp16 (DeepSpeed's CPU accelerator needs AVX512-FP16)"
)
def test_the_fp16_loss_scale_moves_with_the_checkpoint_or_the_resume_is_refused(runs):
    """fp16 saved on ZeRO-1 (1 rank), resumed on ZeRO-3 (2 ranks): the dynamic loss scale is the saved one (not the
    start value a new engine has) and the steps after the move train at the straight run's lr; resumed in bf16, the
    scale has no home and the resume is refused in one line naming it."""
    saved = ck.safe_load(
        runs["logs"]
        / "fp16_z1"
        / "checkpoints"
        / ck.tag_for(SAVE_AT)
        / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )["optimizer_state_dict"]["loss_scaler"]
    resumed = runs["resumed"]["fp16"]
    (line,) = resumed["resumed"]
    assert (
        "(W 1 ZeRO-1 fp16 -> W 2 ZeRO-3 fp16, on a new world size / ZeRO stage)" in line
        and f"loss scale {saved.cur_scale:g}," in line
    )
    assert saved.cur_scale < 2**16, saved.cur_scale  # it moved from the start value, so carrying it is seen
    assert resumed["lrs"] == runs["straight"]["fp16"]["lrs"][-len(resumed["lrs"]) :]
    refusal = runs["resumed"]["bf16"]
    assert refusal is not None and "dynamic loss scale" in refusal and "--precision fp16" in refusal, refusal

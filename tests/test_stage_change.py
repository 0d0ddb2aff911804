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
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL

M, N, STEPS, SAVE_AT = 2, 8, 4, 2
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16")
# The stage ds-clip-train picks without --zero-stage (ds_clip.ds_config.default_preset).
DEFAULT_STAGE = {("fp32", 1): 0, ("fp32", 2): 0, ("bf16", 1): 0, ("bf16", 2): 1}
# Every saved stage resumed under every other one: (precision, saved on 1 rank, resumed on 2 ranks).
MOVES = [(p, s, t) for p in PRECISIONS for s in STAGES for t in STAGES if s != t]
# fp32: the same arithmetic in the same order up to the reduction's rounding, and AdamW at eps 1e-4 keeps that
# rounding from turning into lr-sized updates (as tests/test_checkpoint.py); a lost moment, step count, learning
# rate or data position moves parameters by ~lr = 1e-3 per step, 100x this bound.
TOL = 1e-5

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


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


def _train(argv: list[str]) -> None:
    """One run of the real trainer, exactly as `ds-clip-train ARGV` runs it."""
    from ds_clip.config import parse_settings
    from ds_clip.trainer import train

    train(parse_settings(argv))


def _saved(model: str, logs: Path) -> None:
    """On 1 rank: every stage, both precisions (ZeRO-0 with the defaults: no --zero-stage), saving at step 2."""
    for p in PRECISIONS:
        for z in STAGES:
            _train(_args(model, logs, f"one_{p}_z{z}", p, _flag(p, 1, z)))


def _resumed(model: str, logs: Path) -> None:
    """On 2 ranks: the straight run of every stage, then every saved stage resumed under every other one (the
    default stage without --zero-stage)."""
    for p in PRECISIONS:
        for z in STAGES:
            _train(_args(model, logs, f"two_{p}_z{z}", p, _flag(p, 2, z)))
    for p, s, t in MOVES:
        ckpt = logs / f"one_{p}_z{s}" / "checkpoints" / ck.tag_for(SAVE_AT)
        _train(_args(model, logs, f"res_{p}_z{s}_to_z{t}", p, _flag(p, 2, t), "--resume", str(ckpt)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stages")
    (root / "model").mkdir()
    (root / "model" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    model, logs = f"local-dir:{root / 'model'}", root / "logs"
    spawn_group(1, _saved, model, logs)
    spawn_group(2, _resumed, model, logs)
    return logs


def _final(logs: Path, name: str) -> dict[str, torch.Tensor]:
    from ds_clip.export import consolidated_state_dict

    return consolidated_state_dict(logs / name / "checkpoints" / ck.tag_for(STEPS))


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_the_default_stage_follows_the_rank_count(runs):
    """What the user never chose changes: bf16 is ZeRO-0 on 1 rank and ZeRO-1 on 2 (fp32 stays ZeRO-0 up to 4)."""
    for p in PRECISIONS:
        for world, kind in ((1, "one"), (2, "two")):
            stage = DEFAULT_STAGE[(p, world)]
            meta = ck.read_meta(runs / f"{kind}_{p}_z{stage}" / "checkpoints" / ck.tag_for(STEPS))
            assert meta["zero_stage"] == stage and meta["settings"].get("zero_stage") is None


@pytest.mark.parametrize("precision, saved, resumed", MOVES, ids=[f"{p}-z{s}-to-z{t}" for p, s, t in MOVES])
def test_a_checkpoint_of_one_stage_resumes_under_another_on_another_rank_count(
    runs, precision, saved, resumed
):
    """Saved at step 2 on 1 rank under ZeRO-`saved`, resumed on 2 ranks under ZeRO-`resumed` (the default where
    it is one: bf16 ZeRO-0 -> ZeRO-1 with no flag at all): the weights at step 4 equal the straight 2-rank run
    of ZeRO-`resumed`, and the resumed run's own checkpoints are of its own stage and world size."""
    logs = runs
    name = f"res_{precision}_z{saved}_to_z{resumed}"
    meta = ck.read_meta(logs / name / "checkpoints" / ck.tag_for(STEPS))
    assert (meta["world_size"], meta["zero_stage"], meta["step"]) == (2, resumed, STEPS)
    diff = _max_abs_diff(_final(logs, name), _final(logs, f"two_{precision}_z{resumed}"))
    assert diff <= TOL, diff
    assert not list(
        (logs / name / "checkpoints").glob(f"{ck.UNIVERSAL_PREFIX}*")
    )  # the converted copy is gone

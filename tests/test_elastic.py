"""--global-batch-size under torchrun's elastic agent: a host that dies mid-run leaves the other host to finish
the run alone on a smaller world, with k re-derived, and its final weights equal an uninterrupted run at the same
N. And --resume latest before any checkpoint starts from scratch, so one command serves every start (checked on
the first start of those runs).

    python -m pytest -q tests/test_elastic.py        # a few minutes on 2 CPU cores

Real processes only: two torchrun agents (2 ranks each, c10d rendezvous on 127.0.0.1) as two hosts, the real
CLI, a real SIGKILL of one agent and everything under it (ds_clip_harness.elastic).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from ds_clip_harness.elastic import one_host_then_two, two_hosts_one_dies
from ds_clip_harness.models import E2E_MODEL
from tests import launch
from tests.launch import ROOT

M, N, STEPS, SAVE_EVERY, KILL_AT = 2, 8, 10, 3, 5
TIMEOUT_S = 900
# Attention key biases get exactly zero gradient (softmax ignores them), so AdamW at eps 1e-6 turns their
# rounding noise into lr-sized updates that differ between any two splits of N, restart or not (8e-5 after
# 10 steps at lr 5e-4 here, every other parameter <= 6e-8). eps 1e-4 sits below the real gradients of this
# model, as in the equivalence and checkpoint tests (ds_clip_harness/cases.py); at lr 5e-4 the text tower's key
# bias still drifted 1.1e-6, so lr 1e-4: the noise stays ~2e-7, while a lost optimizer state, step count,
# learning rate or data position moves parameters by ~lr = 1e-4 per step, 100x the bound.
ADAM_EPS, LR = 1e-4, 1e-4

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("elastic_model")
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{d}"


def _args(model: str, logs: Path, name: str) -> list[str]:
    # The one command of every start: N fixed, k derived; --resume latest from the very first start.
    return [
        "--model", model, "--batch-size", str(M), "--global-batch-size", str(N), "--max-steps", str(STEPS),
        "--save-every-n-steps", str(SAVE_EVERY), "--log-every-n-steps", "1", "--log-dir", str(logs),
        "--name", name, "--workers", "0", "--warmup", "2", "--dist-timeout", "120", "--resume", "latest",
        "--eps", str(ADAM_EPS), "--lr", str(LR),
    ]  # fmt: skip


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    from ds_clip.export.openclip import consolidated_state_dict

    return consolidated_state_dict(run_dir / "checkpoints" / f"step_{STEPS:08d}")


def test_a_host_dies_and_the_other_finishes_the_same_run(model_dir, tmp_path):
    """Hosts A and B (2 ranks each: W=4, k=1) train N=8; B is SIGKILLed with its agent after step 5 is logged
    (checkpoint 3 complete). A's ranks lose contact, its agent restarts them on W=2, they resume from the newest
    complete checkpoint with k=2 re-derived and train to the end. The final weights equal an uninterrupted W=2
    run of the same command (fp32, <= 1e-6 max abs), and the samples count stays N per step.

    One command for a first start and for every restart: with --resume latest and no complete checkpoint yet,
    the first start (of the elastic run and of the uninterrupted one) trains from step 0 on random weights and
    says so in one line; the restart of that same command resumes."""
    logs = tmp_path / "logs"
    run = two_hosts_one_dies(
        _args(model_dir, logs, "elastic"),
        kill_at_step=KILL_AT,
        env=launch.environment(),
        cwd=ROOT,
        timeout_s=TIMEOUT_S,
        log_dir=tmp_path,
    )
    out = run.survivor.text
    assert run.survivor.returncode == 0, out[-6000:]
    first = [line for line in out.splitlines() if "no complete checkpoint" in line]
    # The first start of the one command: one line (the restart resumes instead).
    assert len(first) == 1 and "--resume latest: no complete checkpoint" in first[0], (first, out[-3000:])
    assert "the model starts from random weights" in first[0], first
    assert "world size 4, micro-batch m=2, accum-freq k=1: global batch N=W*k*m=8" in out
    assert "world size 2, micro-batch m=2, accum-freq k=2: global batch N=W*k*m=8" in out
    assert re.search(r"elastic restart 1: world size 2, continuing from step [3-9]", out), out[-4000:]
    resumed = [int(s) for s in re.findall(r"resumed from .* at step (\d+)", out)]
    assert resumed and resumed[0] % SAVE_EVERY == 0 and resumed[0] >= SAVE_EVERY, out[-4000:]
    # Samples seen stay N per optimizer step across the restart.
    seen = {
        int(s): int(n) for s, n in re.findall(r"^step (\d+)/\d+ \| epoch \d+ \| samples (\d+)", out, re.M)
    }
    assert seen[STEPS] == STEPS * N

    ref_logs = tmp_path / "ref"
    ref = launch.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python",
         "--", sys.executable, "-m", "ds_clip.train", *_args(model_dir, ref_logs, "ref")],
        timeout=TIMEOUT_S,
    )  # fmt: skip
    ref_out = ref.stdout + ref.stderr
    assert ref.returncode == 0, ref_out[-4000:]
    first = [line for line in ref_out.splitlines() if "no complete checkpoint" in line]
    assert len(first) == 1 and "the model starts from random weights" in first[0], ref_out[-3000:]
    elastic, uninterrupted = _final(logs / "elastic"), _final(ref_logs / "ref")
    assert elastic.keys() == uninterrupted.keys()
    worst = max((elastic[k].float() - uninterrupted[k].float()).abs().max().item() for k in elastic)
    assert worst <= 1e-6, worst


def test_a_host_that_joins_makes_the_world_larger_and_loses_no_step(model_dir, tmp_path):
    """Host A trains alone (W=2, k=2); host B starts once step 20 is logged. torchrun SIGTERMs A's workers to
    admit B, ds_clip saves a checkpoint at the step it is at, and the four ranks (W=4, k=1 re-derived) resume
    from exactly that step: no step is trained twice, and the run finishes with N pairs per step."""
    steps = 300  # long enough that A is still training when B has started (a few seconds here)
    grow = ["--max-steps", str(steps), "--log-every-n-steps", "10", "--save-every-n-steps", "100"]
    args = [*_args(model_dir, tmp_path / "logs", "grow"), *grow]
    a, b = one_host_then_two(
        args, join_at_step=20, env=launch.environment(), cwd=ROOT, timeout_s=TIMEOUT_S, log_dir=tmp_path
    )
    out = a.text + "\n" + b.text
    assert a.returncode == 0 and b.returncode == 0, out[-6000:]
    assert "world size 2, micro-batch m=2, accum-freq k=2: global batch N=W*k*m=8" in out
    assert "world size 4, micro-batch m=2, accum-freq k=1: global batch N=W*k*m=8" in out
    saved = [int(s) for s in re.findall(r"received SIGTERM: saved checkpoint step_\d+ at step (\d+)", out)]
    resumed = [int(s) for s in re.findall(r"resumed from .* at step (\d+)", out)]
    assert saved and resumed == saved[:1], out[-4000:]
    seen = {
        int(s): int(n) for s, n in re.findall(r"^step (\d+)/\d+ \| epoch \d+ \| samples (\d+)", out, re.M)
    }
    assert seen[steps] == steps * N

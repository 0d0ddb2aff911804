"""Features where they meet: each launched run combines several, and each pair is checked for what both of its
features promise. Four short runs of `ds-clip-train` under the real launchers (deepspeed on 2 ranks, torchrun on
1), tiny local-dir: models, the user's defaults otherwise.

    python -m pytest -q tests/test_feature_pairs.py        # ~6 min on 2 loaded CPU cores

| pair | run | checked |
|---|---|---|
| pretrained start x --resume latest (first start) | 1 | the locked image tower is the published one, not random |
| pretrained start x EMA | 1 | the EMA of the locked tower is the published tower (the average starts from it) |
| pretrained start x validation | 1 | the evaluation at step 2 runs on the pretrained model |
| --resume latest (first start) x --global-batch-size | 1 | k = N / (W m) derived on 2 ranks and logged |
| EMA x validation | 1, 2 | the EMA is evaluated beside the live weights (ema/ metrics) |
| remote sync x pretrained / EMA | 1 | the step-2 checkpoint, its EMA files included, is complete on the remote |
| --resume latest (restart) x --global-batch-size | 2 | the restart on 1 rank continues at step 2 with k re-derived, N kept |
| --resume latest (restart) x pretrained | 2 | no published weights reloaded over the checkpoint: the tower stays the published one |
| --resume latest (restart) x EMA | 2 | the EMA is resumed (no "does not keep it" warning) and moves on |
| --resume latest (restart) x validation | 2 | the evaluation history goes on: steps 2 and 4 |
| --resume latest (restart) x remote sync | 2 | step 4 reaches the remote |
| CoCa x --resume latest (first start) x EMA | 3 | a CoCa run starts from scratch with its EMA |
| stop signal x CoCa / EMA / remote sync | 3 | SIGTERM to the ranks mid-run: exit 0, one complete checkpoint at the stop step, its EMA files in it, on the remote too |
| stop signal x validation | 3, 4 | the evaluation history stays whole across the stop: each evaluated step once, ending at 4, 6 |
| stop signal x --resume latest (restart) x CoCa | 4 | the restart continues at the stop step, finishes, and its checkpoint exports the CoCa decoder |
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from ds_clip.checkpoint import MARKER, POINTER, tag_for
from ds_clip.step import ema
from ds_clip_harness.models import COCA_E2E_MODEL, E2E_MODEL, write_pretrained_dir
from tests import launch

M = 4
TIMEOUT_S = 300

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _ranks(launcher_pid: int) -> list:
    """The rank processes under the deepspeed launcher (not their loader workers or fork servers)."""
    import psutil  # a DeepSpeed dependency

    found = [
        p
        for p in psutil.Process(launcher_pid).children(recursive=True)
        if "--local_rank" in " ".join(p.cmdline())
    ]
    pids = {p.pid for p in found}
    return [p for p in found if p.ppid() not in pids]


def _run(cmd: list[str], stop_at: str | None = None) -> tuple[int, str]:
    """Run to the end; with ``stop_at``, SIGTERM every rank (as SLURM's preemption does) when a line starts
    with it."""
    proc = launch.start(cmd, merge_stderr=True)
    watchdog = threading.Timer(TIMEOUT_S, lambda: launch.kill(proc))
    watchdog.start()
    lines, sent = [], 0
    try:
        for line in proc.stdout:
            lines.append(line)
            if stop_at is not None and not sent and line.startswith(stop_at):
                for rank in _ranks(proc.pid):
                    rank.send_signal(signal.SIGTERM)
                    sent += 1
        rc = proc.wait()
    finally:
        watchdog.cancel()
    out = "".join(lines)
    assert stop_at is None or sent == 2, f"signalled {sent} ranks at {stop_at!r}:\n{out[-3000:]}"
    return rc, out


def _args(model: str, logs: Path, name: str, remote: Path, *extra: str, steps: int) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--global-batch-size", "16", "--max-steps", str(steps),
        "--log-every-n-steps", "1", "--log-dir", str(logs), "--name", name, "--report-to", "csv",
        "--warmup", "1", "--save-every-n-steps", "2", "--resume", "latest", "--ema-decay", "0.9",
        "--val-data", "synthetic", "--val-num-samples", "32", "--val-every-n-steps", "2",
        "--remote-sync", f"file://{remote}", "--remote-sync-protocol", "fsspec", "--remote-sync-frequency", "1",
        *extra,
    ]  # fmt: skip


def _export(run: Path, out: Path, *flags: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    proc = launch.run([sys.executable, "-m", "ds_clip.export", str(run), str(out), *flags], timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / "open_clip_model.safetensors"))


def _history(run: Path) -> list[dict]:
    return json.loads((run / "eval_results.json").read_text())


def test_pretrained_resume_global_batch_ema_validation_remote(tmp_path):
    """Runs 1 and 2 of the table: a pretrained, locked image tower with --resume latest from the first start,
    --global-batch-size 16, an EMA, validation and a remote sync, on 2 ranks for 2 steps; then the same command
    on 1 rank to step 4."""
    from safetensors.torch import load_file

    model = write_pretrained_dir(tmp_path / "model", E2E_MODEL, seed=21)
    published = load_file(str(tmp_path / "model" / "open_clip_model.safetensors"))
    visual = [k for k in published if k.startswith("visual.")]
    logs, remote, run = tmp_path / "logs", tmp_path / "remote", tmp_path / "logs" / "p"
    rc, out = _run(launch.deepspeed(*_args(model, logs, "p", remote, "--lock-image", steps=2)))
    assert rc == 0, out[-4000:]
    assert "no complete checkpoint in the run folder yet; the model starts from the weights in --model" in out
    assert "k derived from --global-batch-size 16 on 2 ranks" in out and "accum-freq k=2" in out, out[-3000:]
    live, averaged = _export(run, tmp_path / "e1"), _export(run, tmp_path / "e1ema", "--ema")
    assert all(torch.equal(live[k], published[k]) for k in visual)  # pretrained x resume latest (first start)
    assert all(torch.equal(averaged[k], published[k]) for k in visual)  # pretrained x EMA
    assert not torch.equal(live["text_projection"], published["text_projection"])  # the text tower trained
    first = _history(run)
    assert [h["step"] for h in first] == [2] and "ema/val_loss" in first[0], first
    step2 = remote / "p" / "checkpoints" / tag_for(2)
    assert (step2 / MARKER).exists() and ema.rank_files(step2), sorted(p.name for p in step2.iterdir())

    rc, out = _run(launch.torchrun(*_args(model, logs, "p", remote, "--lock-image", steps=4)))
    assert rc == 0, out[-4000:]
    assert "resumed from" in out and "at step 2" in out and "on a new world size" in out, out[-3000:]
    assert "k derived from --global-batch-size 16 on 1 rank)" in out and "accum-freq k=4" in out, out[-3000:]
    assert "does not keep it" not in out
    again, again_ema = _export(run, tmp_path / "e2"), _export(run, tmp_path / "e2ema", "--ema")
    assert all(torch.equal(again[k], published[k]) for k in visual)
    assert not torch.equal(again_ema["text_projection"], averaged["text_projection"])  # the EMA moved on
    assert [h["step"] for h in _history(run)] == [2, 4]
    assert (remote / "p" / "checkpoints" / tag_for(4) / MARKER).exists()
    assert (remote / "p" / "checkpoints" / POINTER).read_text() == tag_for(4)


def test_coca_stop_signal_ema_remote_then_resume(tmp_path):
    """Runs 3 and 4 of the table: CoCa from scratch with --resume latest, an EMA, validation and a remote sync on
    2 ranks, stopped by SIGTERM after its first logged step; then the same command finishes the run."""
    model = tmp_path / "coca"
    model.mkdir()
    (model / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": COCA_E2E_MODEL, "preprocess_cfg": {}})
    )
    logs, remote, run = tmp_path / "logs", tmp_path / "remote", tmp_path / "logs" / "c"
    args = _args(f"local-dir:{model}", logs, "c", remote, steps=6)
    rc, out = _run(launch.deepspeed(*args), stop_at="step 1/6")
    assert rc == 0, out[-4000:]
    saved = [ln for ln in out.splitlines() if "saved checkpoint" in ln]
    assert saved, out[-3000:]
    stopped = int(saved[0].split(" at step ")[1].split(";")[0])
    ckpt = run / "checkpoints" / tag_for(stopped)
    assert (ckpt / MARKER).exists() and ema.rank_files(ckpt)
    assert (remote / "c" / "checkpoints" / tag_for(stopped) / MARKER).exists()  # the sync after the signal

    rc, out = _run(launch.deepspeed(*args))
    assert rc == 0, out[-4000:]
    assert f"at step {stopped}" in out and "done: 6 steps" in out, out[-3000:]
    decoder = [k for k in _export(run, tmp_path / "e") if k.startswith("text_decoder.")]
    assert decoder, "the CoCa decoder is not in the checkpoint"
    steps = [h["step"] for h in _history(run)]
    assert steps == sorted(set(steps)) and steps[-2:] == [4, 6], (
        steps
    )  # each evaluated step once, across the stop

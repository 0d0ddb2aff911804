"""The fault suite: the real CLI, real processes, faults injected with DS_CLIP_INJECT_FAULT.

    python -m pytest tests/faults -ra          # about 5 minutes on 2 CPU cores

Each test states the fault, what the user must see, and how the run recovers (docs/faults.md is the
same table for users). Every wait is bounded by a subprocess timeout; nothing sleeps or times.
Ranks are started either by the real `deepspeed` launcher or by hand (RANK/WORLD_SIZE/MASTER_* in
the environment, as SLURM or a scheduler would), never in-process.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil  # a DeepSpeed dependency: finds the rank processes under the launcher
import pytest
import torch

from ds_clip.checkpoint import CHECKSUM
from ds_clip.checkpoint.manifest import file_checksum
from ds_clip_harness.models import E2E_MODEL
from tests import launch, shm_files
from tests.launch import ROOT

M, K, W = 4, 2, 2
# Bound on any one launch: a healthy run here takes ~25 s; a hang is a failure, not a wait.
TIMEOUT_S = 120
ERROR = "ds-clip-train: error:"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


# ------------------------------------------------------------------------------------------ helpers


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str

    @property
    def out(self) -> str:
        return self.stdout + self.stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("fault_model")
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{d}"


@pytest.fixture(scope="module", autouse=True)
def _shm_op_built() -> None:
    """Build DeepSpeed's CPU comm op once, outside the bounded launches (a cold build takes ~60 s)."""
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]


_free_port = launch.free_port


def _env(fault: str | None = None) -> dict[str, str]:
    return launch.environment(**({"DS_CLIP_INJECT_FAULT": fault} if fault else {}))


def _args(model: str, logs: Path, name: str, *extra: str, steps: int = 6) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--accum-freq", str(K), "--max-steps", str(steps),
        "--log-every-n-steps", "1", "--logs", str(logs), "--name", name, "--workers", "1",
        "--report-to", "csv", "--warmup", "1", *extra,
    ]  # fmt: skip


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _deepspeed_cmd(args: list[str], port: int | None = None) -> list[str]:
    return launch.deepspeed(*args, ranks=W, port=port)


def _deepspeed(args: list[str], fault: str | None = None, port: int | None = None) -> Ran:
    """The real launcher, in its own session so that a hang can be killed with all its ranks."""
    done = launch.run(_deepspeed_cmd(args, port), env=_env(fault), timeout=TIMEOUT_S)
    return Ran(done.returncode, done.stdout, done.stderr)


def _ranks_by_hand(args: list[str], tmp: Path, fault: str | None = None) -> list[Ran]:
    """W ranks started without any launcher: RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set here, as a
    scheduler would. Output goes to files (two pipes read one after the other could deadlock)."""
    port = str(_free_port())
    tmp.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for r in range(W):
        env = _env(fault)
        env.update(
            RANK=str(r), WORLD_SIZE=str(W), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
        )
        out, err = (tmp / f"rank{r}.out").open("w+"), (tmp / f"rank{r}.err").open("w+")
        files.append((out, err))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ds_clip.train", *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        )
    hung = []
    for p in procs:
        try:
            p.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            hung.append(p)
    for p in hung:
        _killpg(p.pid)
        p.wait()
    results = []
    for p, (out, err) in zip(procs, files):
        out.seek(0)
        err.seek(0)
        results.append(Ran(p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    if hung:
        pytest.fail(
            f"{len(hung)} rank(s) did not end within {TIMEOUT_S} s:\n"
            + "\n".join(f"--- rank {i}\n{r.out[-3000:]}" for i, r in enumerate(results))
        )
    return results


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(ERROR)]


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest_complete").read_text().strip()


def _tag(step: int) -> str:
    return f"step_{step:08d}"


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from ds_clip.export.openclip import consolidated_state_dict

    return consolidated_state_dict(run_dir / "checkpoints" / _tag(step))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    worst = max((float((a[k] - b[k]).abs().max()) for k in differ if a[k].is_floating_point()), default=0.0)
    assert not differ, f"{len(differ)} tensors differ (largest difference {worst:.3e}), e.g. {differ[:3]}"


def _losses(run_dir: Path) -> dict[int, str]:
    """Loss per step from metrics.csv; a resumed run appends, so the last row of a step wins."""
    return {int(r["step"]): r["loss"] for r in csv.DictReader((run_dir / "metrics.csv").open())}


def _rank_processes(launcher_pid: int) -> list[psutil.Process]:
    # The deepspeed launcher starts `python -u -m ds_clip.train --local_rank=N ...` for each rank.
    # Their DataLoader workers are forked from them and share the command line: keep only the ranks.
    found = []
    for p in psutil.Process(launcher_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(a.startswith("--local_rank") for a in p.cmdline()):
                found.append(p)
    pids = {p.pid for p in found}
    return [p for p in found if p.ppid() not in pids]


def _preempt(args: list[str], sig: signal.Signals, at_line: str) -> tuple[int, str]:
    """Run under the launcher; when stdout shows a line starting with ``at_line``, send ``sig`` to
    every rank process (as SLURM does before preemption), then wait for the end. Returns (rc, output)."""
    proc = subprocess.Popen(
        _deepspeed_cmd(args),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(TIMEOUT_S, _killpg, (proc.pid,))
    watchdog.start()
    lines, signalled = [], 0
    try:
        for line in proc.stdout:
            lines.append(line)
            if not signalled and line.startswith(at_line):
                ranks = _rank_processes(proc.pid)
                assert len(ranks) == W, f"found {len(ranks)} rank processes"
                for r in ranks:
                    r.send_signal(sig)
                signalled = len(ranks)
        rc = proc.wait(timeout=TIMEOUT_S)
    finally:
        watchdog.cancel()
        _killpg(proc.pid)
    out = "".join(lines)
    assert signalled == W, f"never saw a line starting with {at_line!r}:\n{out[-3000:]}"
    return rc, out


# ---------------------------------------------------------------------------- the unfaulted reference


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> Path:
    """An unfaulted 2-rank run (6 steps, fp32, the default preset, checkpoints every 2 steps): what a faulted and
    resumed run must reach exactly."""
    logs = tmp_path_factory.mktemp("reference")
    ran = _ranks_by_hand(_args(model_dir, logs, "ref", "--save-every-n-steps", "2"), logs / "out")
    assert ran[0].returncode == 0 and ran[1].returncode == 0, ran[0].out[-3000:] + ran[1].out[-2000:]
    assert _latest(logs / "ref") == _tag(6)
    return logs / "ref"


# ---------------------------------------------------------------------------------- 1. non-finite


def test_one_nonfinite_step_is_skipped_on_every_rank_and_the_run_finishes(model_dir, tmp_path):
    """NaN images on every rank in the 2nd batch (index 1) only: both ranks skip that update together, rank
    0 says so naming the update it was to be, and the run still trains 3 applied updates (4 batches). The
    counts agree with the applied updates (docs/exactness.md, "Skipped steps: what counts"): samples_seen = step x N in every log
    row, skipped_steps 1 from then on, and the LR of every row is the schedule's value at that applied
    step (the skip did not advance it)."""
    from ds_clip.training.schedule import cosine_with_warmup

    ran = _deepspeed(_args(model_dir, tmp_path, "nan1", "--lr", "1e-3", steps=3), fault="nan@1:0,nan@1:1")
    assert ran.returncode == 0, ran.out[-4000:]
    skipped = [line for line in ran.out.splitlines() if "update skipped on every rank" in line]
    assert len(skipped) == 1, ran.out[-4000:]
    assert re.search(r"\bstep 2\b", skipped[0]), skipped[0]
    steps = {
        int(m.group(1)): line for line in ran.stdout.splitlines() if (m := re.match(r"step (\d+)/3 ", line))
    }
    assert sorted(steps) == [1, 2, 3], ran.stdout[-3000:]
    assert "skipped_steps" not in steps[1]
    assert "skipped_steps 1" in steps[2] and "skipped_steps 1" in steps[3]
    rows = list(csv.DictReader((tmp_path / "nan1" / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for r in rows:
        step = int(r["step"])
        assert int(r["samples_seen"]) == step * K * M * W, r
        # The LR update `step` trained at: the schedule's value at step - 1 (0-based), the skip not counted.
        assert float(r["lr"]) == pytest.approx(
            1e-3 * cosine_with_warmup(step - 1, warmup=1, total=3), abs=1e-12
        ), r
    assert [int(r["skipped_steps"]) for r in rows] == [0, 1, 1]
    assert _latest(tmp_path / "nan1") == _tag(3)
    assert "3 steps" in ran.out and "1 skipped" in ran.out


def test_consecutive_nonfinite_steps_stop_the_run_and_keep_the_last_good_checkpoint(model_dir, tmp_path):
    """NaN on rank 1 from step index 2 on, --max-skipped-steps 2: the run stops after the 2nd skip with
    exit status 1 and a one-line error naming the cause and the flag; nothing is saved for the skipped
    steps (the save due at step 4 does not happen), latest_complete still names step 2."""
    args = _args(
        model_dir, tmp_path, "nanstop", "--save-every-n-steps", "2", "--max-skipped-steps", "2", steps=8
    )
    ran = _deepspeed(args, fault="nan@2-:1")
    assert ran.returncode == 1, ran.out[-4000:]
    errors = _error_lines(ran.stderr)
    assert errors, ran.out[-4000:]
    assert all("non-finite" in e and "--max-skipped-steps" in e for e in errors), errors
    assert "Traceback" not in ran.out
    run = tmp_path / "nanstop"
    assert _latest(run) == _tag(2)
    assert not (run / "checkpoints" / _tag(4)).exists()


# --------------------------------------------------------------------------------------- 2. dead rank


def test_dead_rank_under_deepspeed_launcher_ends_the_job(model_dir, tmp_path):
    """Rank 1 SIGKILLed at the start of step index 1 (default --dist-timeout): the launcher returns
    non-zero within the bound and leaves no rank process behind, and no DeepSpeed CPU shm buffer in
    /dev/shm (each rank unlinks its own once every rank has mapped them all)."""
    name = "fault-dead-launcher"
    port = _free_port()
    ran = _deepspeed(_args(model_dir, tmp_path, name, steps=4), fault="kill@1:1", port=port)
    assert ran.returncode != 0, ran.out[-4000:]
    assert "[fault injection] rank 1: SIGKILL at step 1" in ran.out
    left = [p for p in psutil.process_iter(["cmdline"]) if name in " ".join(p.info["cmdline"] or [])]
    gone, alive = psutil.wait_procs(left, timeout=30)
    assert not alive, f"rank processes left behind: {[p.pid for p in alive]}"
    assert shm_files.left_by(port) == []


KILL_ARGS = ("--zero-stage", "2", "--save-every-n-steps", "10", "--dist-timeout", "30")
KILL_STEPS = 30


@pytest.fixture(scope="module")
def reference_z2(model_dir, tmp_path_factory) -> Path:
    """An unfaulted 2-rank ZeRO-2 run of 30 steps (the user's defaults: random crops, --workers 1)."""
    logs = tmp_path_factory.mktemp("reference_z2")
    ran = _ranks_by_hand(_args(model_dir, logs, "ref", *KILL_ARGS, steps=KILL_STEPS), logs / "out")
    assert ran[0].returncode == 0 and ran[1].returncode == 0, ran[0].out[-3000:] + ran[1].out[-2000:]
    return logs / "ref"


def test_dead_rank_without_launcher_then_resume_matches_unfaulted_run(model_dir, tmp_path, reference_z2):
    """Two ranks started by hand (--dist-timeout 30), ZeRO-2, 30 steps, --workers 1, open_clip's random
    crops; rank 1 SIGKILLed at the start of step index 15, after the checkpoint of step 10. Rank 0 exits
    non-zero within the bound with one `ds-clip-train: error:` line about losing another rank.
    `--resume latest` continues from step 10 and reaches bit-for-bit the weights (and losses) of the
    unfaulted run."""
    args = _args(model_dir, tmp_path, "dead", *KILL_ARGS, steps=KILL_STEPS)
    rank0, rank1 = _ranks_by_hand(args, tmp_path / "first", fault="kill@15:1")
    assert rank1.returncode == -signal.SIGKILL, rank1.out[-2000:]
    assert rank0.returncode != 0, rank0.out[-3000:]
    errors = _error_lines(rank0.stderr)
    assert len(errors) == 1 and "another rank" in errors[0], rank0.stderr[-3000:]
    assert "Traceback" not in rank0.stderr
    run = tmp_path / "dead"
    assert _latest(run) == _tag(10)

    rank0, rank1 = _ranks_by_hand([*args, "--resume", "latest"], tmp_path / "resume")
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.out[-3000:] + rank1.out[-2000:]
    assert "resumed from" in rank0.out and "at step 10" in rank0.out
    assert _latest(run) == _tag(KILL_STEPS)
    assert _losses(run) == _losses(reference_z2)
    _assert_same_weights(_weights(run, KILL_STEPS), _weights(reference_z2, KILL_STEPS))


# -------------------------------------------------------------------------------------- 3. preemption


def test_sigterm_then_sigint_to_the_ranks_save_and_exit_cleanly(model_dir, tmp_path):
    """SIGTERM to both rank processes (what SLURM sends before preemption) once step 2 is logged: the
    ranks agree to stop after the same step, save a complete checkpoint there, print how to resume,
    and the launcher exits 0. The resumed run, sent SIGINT (Ctrl-C) once, does the same."""
    run = tmp_path / "preempt"
    args = _args(model_dir, tmp_path, "preempt", steps=50)
    stops = []
    for sig, at_line, resume in (
        (signal.SIGTERM, "step 2/", []),
        (signal.SIGINT, "step ", ["--resume", "latest"]),
    ):
        rc, out = _preempt([*args, *resume], sig, at_line)
        assert rc == 0, out[-4000:]
        if resume:
            assert f"at step {stops[-1]}" in out, out[-3000:]
        said = [line for line in out.splitlines() if f"received {sig.name}: saved" in line]
        assert len(said) == 1, out[-4000:]
        assert "resume with" in said[0] and "--resume latest" in said[0] and "--name preempt" in said[0]
        m = re.search(r"saved checkpoint (step_\d+) at step (\d+)", said[0])
        assert m, said[0]
        step = int(m.group(2))
        assert m.group(1) == _tag(step) == _latest(run)
        assert (run / "checkpoints" / _tag(step) / "COMPLETE").exists()
        assert step < 50 and (not stops or step > stops[-1])
        stops.append(step)


# -------------------------------------------------------------------------------- 4. interrupted save


def test_rank_dies_mid_save_then_resume_removes_partial_and_finishes(model_dir, tmp_path, reference):
    """Rank 1 SIGKILLed while checkpoint 4 is half written: the job fails, latest_complete still names
    step 2, step 4 has no COMPLETE marker. `--resume latest` removes the partial folder (and says so),
    resumes at step 2 and finishes at step 6 with the unfaulted run's weights."""
    args = _args(model_dir, tmp_path, "midsave", "--save-every-n-steps", "2")
    ran = _deepspeed(args, fault="kill-in-save@4:1")
    assert ran.returncode != 0, ran.out[-4000:]
    run = tmp_path / "midsave"
    assert _latest(run) == _tag(2)
    partial = run / "checkpoints" / _tag(4)
    assert partial.is_dir() and not (partial / "COMPLETE").exists()

    ran = _deepspeed([*args, "--resume", "latest"])
    assert ran.returncode == 0, ran.out[-4000:]
    removed = [line for line in ran.out.splitlines() if "partial checkpoint" in line]
    assert removed and _tag(4) in removed[0], ran.out[-3000:]
    assert "at step 2" in ran.out
    assert _latest(run) == _tag(6)
    _assert_same_weights(_weights(run, 6), _weights(reference, 6))


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns) for f in folder.rglob("*")}


def test_a_finished_run_relaunched_and_a_rewritten_step_never_leave_latest_on_a_partial_folder(
    model_dir, tmp_path, reference
):
    """A finished run (the unfaulted reference's 6 steps, saved at 2, 4 and 6, copied) launched again with
    --resume latest, as a re-queued job is, with rank 1 set to die inside any save of step 6: it says the run
    already finished at step 6 and exits 0 without saving, every checkpoint file untouched. Then a resume from
    step 4 trains steps 5-6 again and rewrites step 6, rank 1 dying halfway: latest_complete has already moved
    back to step 4 (never naming the folder being rewritten), so `--resume latest` removes the partial step 6,
    resumes at step 4 and ends with the finished run's step-6 weights."""
    run = tmp_path / "again"
    shutil.copytree(reference, run)  # the same flags as `args`: what training them from scratch would leave
    args = _args(model_dir, tmp_path, "again", "--save-every-n-steps", "2")
    first = _weights(run, 6)
    before = _files(run / "checkpoints")

    ran = _deepspeed([*args, "--resume", "latest"], fault="kill-in-save@6:1")
    assert ran.returncode == 0, ran.out[-4000:]
    assert "already finished at step 6" in ran.out, ran.out[-3000:]
    assert _files(run / "checkpoints") == before

    step4 = str(run / "checkpoints" / _tag(4))
    ran = _deepspeed([*args, "--resume", step4], fault="kill-in-save@6:1")
    assert ran.returncode != 0, ran.out[-4000:]
    assert _latest(run) == _tag(4)
    assert not (run / "checkpoints" / _tag(6) / "COMPLETE").exists()
    ran = _deepspeed([*args, "--resume", "latest"])
    assert ran.returncode == 0 and "at step 4" in ran.out, ran.out[-4000:]
    assert _latest(run) == _tag(6)
    _assert_same_weights(_weights(run, 6), first)


# ------------------------------------------------------------------------------- 5. unwritable output


def _single(args: list[str]) -> Ran:
    """One process, no launcher (a world of one): the checks below fail before any training."""
    p = subprocess.run(
        [sys.executable, "-m", "ds_clip.train", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return Ran(p.returncode, p.stdout, p.stderr)


def _one_error_line(ran: Ran, code: int) -> str:
    assert ran.returncode == code, ran.out[-3000:]
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    errors = _error_lines(ran.stderr)
    assert len(errors) == 1, ran.stderr[-3000:]
    return errors[0]


def test_logs_under_a_regular_file_is_exit_2_naming_logs(model_dir, tmp_path):
    """--logs that cannot be a folder (a path under a regular file; chmod does not stop root)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    err = _one_error_line(_single(_args(model_dir, blocker / "sub", "x", steps=1)), 2)
    assert "--logs" in err and str(blocker / "sub") in err


def test_logs_on_a_disk_too_small_for_one_checkpoint_is_exit_2(model_dir, tmp_path):
    """--logs on a 2 MiB tmpfs: refused before training, naming --logs and the estimated size."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mount.stderr.strip()[:200]}")
    try:
        err = _one_error_line(_single(_args(model_dir, mnt, "x", steps=1)), 2)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    assert "--logs" in err and re.search(r"needs about [\d.]+ MiB", err), err


# ------------------------------------------------------------------------------------ 6. untrusted files


class _Payload:
    """Unpickling this runs code (here: creates a file). ds_clip must refuse it, not run it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pretrained_file_needing_unpickling_is_refused(tmp_path):
    """--pretrained FILE holding an arbitrary Python object: exit 2, one line naming --pretrained and
    why (weights_only / unpickling); the object's code never runs. (The built-in ds-clip-tiny: a
    local-dir: model takes its weights from its own folder, and --pretrained is refused with it.)"""
    marker = tmp_path / "code_ran"
    weights = tmp_path / "weights.pt"
    torch.save({"state_dict": {}, "extra": _Payload(marker)}, weights)
    args = _args("ds-clip-tiny", tmp_path / "logs", "x", "--pretrained", str(weights), steps=1)
    err = _one_error_line(_single(args), 2)
    assert "--pretrained" in err and str(weights) in err
    assert "weights_only" in err or "unpickling" in err
    assert not marker.exists()


def test_checkpoint_file_replaced_by_a_pickle_fails_resume(model_dir, tmp_path, reference):
    """A checkpoint whose model-state file was swapped for a pickle (manifest size and checksum updated, as
    an attacker would): `--resume latest` exits 1 with one error line naming the file; no code runs."""
    run = tmp_path / "tampered"
    shutil.copytree(reference, run)
    ckpt = run / "checkpoints" / _tag(6)
    victim = ckpt / "mp_rank_00_model_states.pt"
    marker = tmp_path / "code_ran"
    torch.save({"module": {}, "extra": _Payload(marker)}, victim)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][victim.name] = {"bytes": victim.stat().st_size, CHECKSUM: file_checksum(victim)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    args = _args(model_dir, tmp_path, "tampered", "--resume", "latest", steps=8)
    rank0, rank1 = _ranks_by_hand(args, tmp_path / "out")
    for ran in (rank0, rank1):
        err = _one_error_line(ran, 1)
        assert str(victim) in err and ("unpickling" in err or "weights_only" in err), err
    assert not marker.exists()

"""A real SLURM: scripts/launch_slurm.sbatch submitted as users submit it, on a one-node SLURM this test starts
(munged, slurmctld, slurmd; tests/slurm_cluster.py), two CPU tasks per job.

    python -m pytest -q tests/test_slurm.py        # several minutes on 2 CPU cores; root (skips otherwise)

- a straight job (`sbatch scripts/launch_slurm.sbatch ARGS`) trains W = 2 ranks to the end;
- `scancel` once a checkpoint is complete, then the same submission (`--resume latest`) ends bit for bit where the
  straight job ends;
- a time limit: the script's `#SBATCH --signal=B:USR1@120` warns the batch shell, which passes SIGUSR1 to the
  ranks: they save one checkpoint and the job ends COMPLETED (exit 0) before the limit. SLURM's clock decides when
  (3-4 minutes in), so this job is submitted first and the others run beside it on the node's four CPUs; one of
  its ranks is a straggler (DS_CLIP_INJECT_FAULT=slow@0-:0, 1 s a step), so that the job waits for the warning
  instead of spending two cores on thousands of steps;
- `sbatch --requeue` and `scontrol requeue` once a checkpoint is complete: the job runs again, resumes and ends
  where the straight job ends;
- `srun -n 2 python -m ds_clip.train ...` inside `salloc` (no batch script) trains on 2 ranks;
- after each, no ds_clip process of the test is left running.
Mid-run is a state, not a time: the test polls the run folder (under a deadline) for `latest_complete`.
Debian's slurm-wlm and munge come from scripts/setup.sh (root); without them the tests skip, saying why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds_clip import checkpoint as ck
from ds_clip.checkpoint.find import is_intact
from ds_clip_harness.models import E2E_MODEL
from tests.slurm_cluster import Slurm, SlurmUnavailable, missing, slurm_cluster

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
M, N, STEPS, SAVE_EVERY = 2, 4, 40, 2  # W = 2 tasks: k = 1
JOB_TIMEOUT_S = 600
# The time-limit job: SLURM counts limits in minutes and sends the script's USR1 120 s before the end, up to 60 s
# early; 5 minutes leave the ranks two minutes to start before the warning (a rank still importing would die of
# SIGUSR1's default action) and two to save after it.
TIME_LIMIT_MIN = 5

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.distributed]


# The node's CPUs: two jobs of two tasks at once (the time-limit job and one other).
NODE_CPUS = 4


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[Slurm]:
    why = missing()
    if why:
        pytest.skip(f"SLURM tests: {why}")
    try:
        with slurm_cluster(tmp_path_factory.mktemp("slurm"), cpus=NODE_CPUS) as cluster:
            yield cluster
    except SlurmUnavailable as err:
        pytest.fail(f"the one-node SLURM did not start: {err}")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("slurm_runs")
    os.chmod(root, 0o755)
    (root / "model").mkdir()
    (root / "model" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    return {"root": root, "model": f"local-dir:{root / 'model'}", "logs": root / "logs"}


def _env(slurm: Slurm) -> dict[str, str]:
    env = slurm.env(dict(os.environ))
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["MASTER_PORT"] = str(_free_port())
    env.setdefault("TORCH_EXTENSIONS_DIR", str(VENV_BIN.parent / "torch_extensions"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "DS_CLIP_INJECT_FAULT"):
        env.pop(k, None)
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(work: dict, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    return [
        "--model", work["model"], "--batch-size", str(M), "--global-batch-size", str(N), "--max-steps", str(steps),
        "--save-every-n-steps", str(SAVE_EVERY), "--log-every-n-steps", "1", "--logs", str(work["logs"]),
        "--name", name, "--workers", "0", "--warmup", "1", "--lr", "1e-3", "--eps", "1e-4",
        "--dist-timeout", "120", "--train-num-samples", "4000", *extra,
    ]  # fmt: skip


# The script's #SBATCH lines are for a GPU cluster; the command line overrides them, as the script says.
TASKS = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]


def _sbatch(slurm: Slurm, work: dict, name: str, *sbatch: str, args: list[str], **env: str) -> str:
    out = work["root"] / f"{name}-%j.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", *TASKS, f"--output={out}", f"--job-name={name}", *sbatch,
         "scripts/launch_slurm.sbatch", *args],
        cwd=ROOT, env={**_env(slurm), **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job_log(work: dict, name: str, job: str) -> str:
    f = work["root"] / f"{name}-{job}.out"
    return f.read_text() if f.exists() else ""


def _wait(what: str, ok, timeout_s: float, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f} s; {detail()}")
        time.sleep(0.5)  # polls a condition under a deadline


def _wait_job(slurm: Slurm, work: dict, name: str, job: str, ends: tuple[str, ...] = ("COMPLETED",)) -> str:
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
    state = {}

    def done() -> bool:
        state["s"] = slurm.job_state(job)
        return state["s"] in final

    _wait(f"job {job} did not end", done, JOB_TIMEOUT_S, lambda: _job_log(work, name, job)[-3000:])
    assert state["s"] in ends, f"job {job} ended {state['s']}: {_job_log(work, name, job)[-4000:]}"
    return state["s"]


def _latest_step(work: dict, name: str) -> int:
    pointer = work["logs"] / name / "checkpoints" / ck.POINTER
    try:
        return int(pointer.read_text().strip().removeprefix(ck.TAG_PREFIX))
    except (OSError, ValueError):
        return 0


def _ds_clip_processes(work: dict, name: str) -> list[str]:
    """The ds_clip processes of this module's run NAME still alive (their command line names the module's folder
    and the run; the time-limit job runs beside the others)."""
    alive = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ds_clip" in cmd and str(work["root"]) in cmd and f" --name {name} " in f"{cmd} ":
            alive.append(f"{p.name}: {cmd[:160]}")
    return alive


def _nothing_left(work: dict, name: str) -> None:
    _wait(f"ds_clip processes of {name} are still running after the job",
          lambda: not _ds_clip_processes(work, name), 60,
          lambda: "; ".join(_ds_clip_processes(work, name)))  # fmt: skip


def _final(work: dict, name: str) -> dict[str, torch.Tensor]:
    from ds_clip.export.openclip import consolidated_state_dict

    return consolidated_state_dict(work["logs"] / name / "checkpoints" / ck.tag_for(STEPS))


@pytest.fixture(scope="module")
def limit_job(slurm, work) -> str:
    """The time-limit job, submitted before every other (see the module's docstring); its test waits for it."""
    args = _train_args(work, "limit", "--resume", "latest", steps=1_000_000)
    args[args.index("--save-every-n-steps") + 1] = "1000000"  # only the warning's checkpoint
    return _sbatch(
        slurm, work, "limit", f"--time={TIME_LIMIT_MIN}", args=args, DS_CLIP_INJECT_FAULT="slow@0-:0"
    )


@pytest.fixture(scope="module")
def straight(slurm, work, limit_job) -> dict[str, torch.Tensor]:
    """The uninterrupted job: sbatch scripts/launch_slurm.sbatch with the training flags, to the end (beside the
    time-limit job, started first)."""
    job = _sbatch(slurm, work, "straight", args=_train_args(work, "straight"))
    _wait_job(slurm, work, "straight", job)
    log = _job_log(work, "straight", job)
    assert "world size 2, micro-batch m=2, accum-freq k=1" in log, log[-3000:]
    assert re.search(rf"step {STEPS}/{STEPS} ", log), log[-3000:]
    _nothing_left(work, "straight")
    return _final(work, "straight")


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def test_straight_job_trains_two_ranks_to_the_end(straight):
    assert straight


def test_scancel_then_resubmit_with_resume_latest_ends_bit_for_bit_where_the_straight_job_ends(
    slurm, work, straight
):
    """scancel once step 2's checkpoint is complete (SIGTERM to the tasks: they save and exit); the same
    submission with --resume latest then trains to the end, bit for bit the straight job's weights."""
    args = _train_args(work, "cancel", "--resume", "latest")
    job = _sbatch(slurm, work, "cancel", args=args)
    _wait("no checkpoint before the scancel", lambda: _latest_step(work, "cancel") >= SAVE_EVERY, JOB_TIMEOUT_S,
          lambda: _job_log(work, "cancel", job)[-3000:])  # fmt: skip
    assert slurm.run("scancel", job).returncode == 0
    _wait_job(slurm, work, "cancel", job, ends=("CANCELLED", "COMPLETED", "FAILED"))
    _nothing_left(work, "cancel")
    stopped_at = _latest_step(work, "cancel")
    assert SAVE_EVERY <= stopped_at < STEPS, stopped_at
    again = _sbatch(slurm, work, "cancel", args=args)
    _wait_job(slurm, work, "cancel", again)
    assert "resumed from" in _job_log(work, "cancel", again)
    _nothing_left(work, "cancel")
    _bitwise_equal(_final(work, "cancel"), straight)


def test_requeue_mid_run_resumes_and_ends_where_the_straight_job_ends(slurm, work, straight):
    """sbatch --requeue, then scontrol requeue once step 2's checkpoint is complete: SLURM stops the job
    (SIGTERM: the ranks save) and runs it again with the same command, whose --resume latest continues; the
    final weights are bit for bit the straight job's."""
    job = _sbatch(
        slurm, work, "requeue", "--requeue", args=_train_args(work, "requeue", "--resume", "latest")
    )
    _wait("no checkpoint before the requeue", lambda: _latest_step(work, "requeue") >= SAVE_EVERY, JOB_TIMEOUT_S,
          lambda: _job_log(work, "requeue", job)[-3000:])  # fmt: skip
    requeued = slurm.run("scontrol", "requeue", job)
    assert requeued.returncode == 0, requeued.stderr
    _wait_job(slurm, work, "requeue", job)
    assert "Restarts=1" in slurm.run("scontrol", "show", "job", job).stdout
    assert "resumed from" in _job_log(work, "requeue", job)
    _nothing_left(work, "requeue")
    _bitwise_equal(_final(work, "requeue"), straight)


def test_srun_inside_salloc_trains_on_two_ranks(slurm, work):
    """No batch script: `salloc -n 2` and inside it `srun -n 2 python -m ds_clip.train ...`; ds_clip reads its
    ranks from SLURM (SLURM_PROCID, SLURM_NTASKS, the step's first node as MASTER_ADDR)."""
    args = _train_args(work, "srun", steps=3)
    proc = subprocess.run(
        ["salloc", "-n", "2", "--cpus-per-task=1", "srun", "-n", "2", sys.executable, "-m", "ds_clip.train", *args],
        cwd=ROOT, env=_env(slurm), capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "world size 2, micro-batch m=2, accum-freq k=1" in out, out[-4000:]
    assert _latest_step(work, "srun") == 3
    _nothing_left(work, "srun")


def test_the_time_limit_warning_saves_and_ends_the_job_zero_before_the_limit(slurm, work, limit_job):
    """--time 5 minutes and the script's own `#SBATCH --signal=B:USR1@120`: the batch shell passes SIGUSR1 to
    srun, the ranks save one checkpoint at the step they agree on and exit 0: the job is COMPLETED, not
    TIMEOUT, and its checkpoint is complete."""
    job = limit_job
    _wait_job(slurm, work, "limit", job)
    log = _job_log(work, "limit", job)
    assert re.search(r"^step \d+/", log, re.M), log[-3000:]  # it trained before the warning came
    assert "received SIGUSR1" in log and "saved checkpoint" in log, log[-3000:]
    step = _latest_step(work, "limit")
    assert step > 0 and is_intact(work["logs"] / "limit" / "checkpoints" / ck.tag_for(step))
    exit_code = slurm.run("scontrol", "show", "job", job).stdout
    assert "ExitCode=0:0" in exit_code, exit_code
    _nothing_left(work, "limit")

"""Signals as people and clusters send them, under the real launchers (docs/faults.md, "Signals").

    python -m pytest tests/faults/test_signals.py -ra      # a few minutes on 2 CPU cores

- a terminal's Ctrl-C: SIGINT to the launcher's whole process group (``os.killpg``);
- ``kill`` of the launcher alone (SIGTERM to the deepspeed runner);
- SLURM: ``scancel`` and preemption signal every process of the job step (each rank and its DataLoader
  workers) with SIGTERM; ``--signal=USR1@120`` sends SIGUSR1 the same way; ranks run in a session each, as
  under slurmstepd (SLURM itself is not installed here, its signal patterns are sent by hand).

Each test waits on log lines and process exits with a deadline, never a sleep. A stop must leave one complete
checkpoint (``COMPLETE``, named by ``latest_complete``), no process of the run, and a run that ``--resume
latest`` continues to the very weights and per-step losses of a run never stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.faults.test_faults import (
    ROOT,
    W,
    _args,
    _assert_same_weights,
    _deepspeed_cmd,
    _env,
    _free_port,
    _killpg,
    _latest,
    _losses,
    _ranks_by_hand,
    _shm_op_built,  # noqa: F401 (an autouse fixture: builds DeepSpeed's CPU comm op once)
    _tag,
    _weights,
    model_dir,  # noqa: F401 (a fixture)
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 12  # long enough that a stop sent after step 2 lands well before the end
# Bound on one launch from start to the last process's exit: a hang is a failure, not a wait. Generous: the
# machines these tests run on are shared and a start of DeepSpeed can take minutes there.
DEADLINE_S = 600
SAVED = re.compile(r"saved checkpoint (step_\d+) at step (\d+)")


def _run_args(model: str, logs: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    return _args(model, logs, name, "--save-every-n-steps", "10000", *extra, steps=steps)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> Path:  # noqa: F811
    """The same run, never stopped: what every stopped and resumed run must reach."""
    logs = tmp_path_factory.mktemp("signals_reference")
    ran = _ranks_by_hand(_run_args(model_dir, logs, "ref"), logs / "out")
    assert all(r.returncode == 0 for r in ran), ran[0].out[-3000:] + ran[1].out[-2000:]
    return logs / "ref"


def _drive(
    cmd: list[str], actions: list[tuple[str, Callable[[subprocess.Popen], None]]], env: dict | None = None
) -> tuple[int, str]:
    """Start ``cmd`` in its own session (as a terminal starts a job), read its output, and run each action
    once when a line containing its trigger appears (in order). Returns (launcher's exit status, output)
    once the output has ended, i.e. every process holding it (launcher, ranks, workers) has exited."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(DEADLINE_S, _kill_tree, (proc.pid,))
    watchdog.start()
    lines, pending = [], list(actions)
    try:
        for line in proc.stdout:
            lines.append(line)
            if pending and pending[0][0] in line:
                pending.pop(0)[1](proc)
        rc = proc.wait(timeout=DEADLINE_S)
    finally:
        watchdog.cancel()
        _killpg(proc.pid)
    out = "".join(lines)
    assert not pending, f"never saw {pending[0][0]!r}:\n{out[-4000:]}"
    return rc, out


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.Error):
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.kill()
    _killpg(pid)


def _killpg_action(sig: signal.Signals) -> Callable[[subprocess.Popen], None]:
    return lambda proc: os.killpg(proc.pid, sig)


def _processes_of(logs: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(logs) in " ".join(p.info["cmdline"] or []):
                found.append(p)
    return found


def _assert_nothing_left(logs: Path) -> None:
    """No launcher, rank or DataLoader worker of the run alive (they may still be exiting: bounded wait)."""
    _, alive = psutil.wait_procs(_processes_of(logs), timeout=60)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"


def _assert_stopped_and_saved(out: str, run: Path, why: str, total: int = STEPS) -> int:
    """One save for the stop, named by rank 0; the checkpoint is complete and latest. Returns its step."""
    said = [line for line in out.splitlines() if SAVED.search(line)]
    assert len(said) == 1 and why in said[0], out[-4000:]
    assert "--resume latest" in said[0]
    tag, step = SAVED.search(said[0]).groups()
    assert tag == _tag(int(step)) == _latest(run)
    assert (run / "checkpoints" / tag / "COMPLETE").exists()
    assert 2 <= int(step) < total, said[0]
    assert "DataLoader worker" not in out, out[-4000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-4000:]
    return int(step)


def _resume_and_compare(model: str, logs: Path, name: str, reference: Path, step: int) -> None:
    ran = _ranks_by_hand([*_run_args(model, logs, name), "--resume", "latest"], logs / f"resume-{step}")
    assert all(r.returncode == 0 for r in ran), ran[0].out[-3000:] + ran[1].out[-2000:]
    assert f"at step {step}" in ran[0].out, ran[0].out[-3000:]
    run = logs / name
    assert _losses(run) == _losses(reference)
    _assert_same_weights(_weights(run, STEPS), _weights(reference, STEPS))


# ----------------------------------------------------------------------------------------------- deepspeed


def test_ctrl_c_under_deepspeed_saves_once_and_resumes_exactly(model_dir, tmp_path, reference):  # noqa: F811
    """Ctrl-C in the terminal (SIGINT to the launcher's process group: runner, launch.py, ranks, workers;
    launch.py then SIGTERMs each rank's tree). The DataLoader workers ignore both; the ranks finish the step,
    agree, save one complete checkpoint and exit 0; nothing is left running. The runner itself dies of the
    SIGINT at once (DeepSpeed's code: exit status -2 / 130), launch.py exits 1. `--resume latest` then
    reaches the weights and per-step losses of a run never stopped, bit for bit."""
    rc, out = _drive(
        _deepspeed_cmd(_run_args(model_dir, tmp_path, "ctrlc")), [("step 2/", _killpg_action(signal.SIGINT))]
    )
    assert rc == -signal.SIGINT, out[-4000:]
    step = _assert_stopped_and_saved(out, tmp_path / "ctrlc", "received SIGINT")
    _assert_nothing_left(tmp_path)
    _resume_and_compare(model_dir, tmp_path, "ctrlc", reference, step)


def test_sigterm_to_the_deepspeed_runner_alone_stops_the_orphaned_ranks(model_dir, tmp_path):  # noqa: F811
    """`kill PID` of the deepspeed runner: DeepSpeed's runner dies and passes nothing on; launch.py and the
    ranks would train on, orphaned. The ranks notice their launcher gone at the next step, save, exit 0; then
    launch.py exits 0 too."""
    rc, out = _drive(
        _deepspeed_cmd(_run_args(model_dir, tmp_path, "orphan")),
        [("step 2/", lambda proc: proc.send_signal(signal.SIGTERM))],
    )
    assert rc == -signal.SIGTERM, out[-4000:]
    _assert_stopped_and_saved(out, tmp_path / "orphan", "the launcher (pid")
    assert out.count("exits successfully") == W, out[-3000:]
    _assert_nothing_left(tmp_path)


# ------------------------------------------------------------------------------------------------ torchrun


def test_ctrl_c_under_torchrun_saves_once(model_dir, tmp_path):  # noqa: F811
    """Ctrl-C (SIGINT to torchrun's process group). torchrun starts each rank in a session of its own, so
    only the agent gets the terminal's signal; it sends it on to each rank's process group (ranks and their
    workers), waits for them, and exits 1 with its own SignalException report."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    cmd = [
        torchrun, "--nproc_per_node", str(W), "--master_port", str(_free_port()), "-m", "ds_clip.train",
        # torchrun's own parser takes --logs for its --logs-specs, even after the module: --log-dir is the same
        *("--log-dir" if a == "--logs" else a for a in _run_args(model_dir, tmp_path, "torchrun")),
    ]  # fmt: skip
    rc, out = _drive(cmd, [("step 2/", _killpg_action(signal.SIGINT))])
    assert rc == 1, out[-4000:]
    _assert_stopped_and_saved(out, tmp_path / "torchrun", "received SIGINT")
    _assert_nothing_left(tmp_path)


# -------------------------------------------------------------------------------------------------- mpirun


MPI_STEPS = 5000  # Open MPI passes the stop on only after its timeout: the run must still be training then


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (scripts/setup.sh)")
def test_ctrl_c_under_mpirun_saves_once(model_dir, tmp_path):  # noqa: F811
    """Ctrl-C (SIGINT to mpirun's process group). Open MPI 4 starts each rank in a process group of its own,
    so the terminal reaches mpirun only; mpirun sends the ranks SIGCONT at once, SIGTERM
    `odls_base_sigkill_timeout` seconds later and SIGKILL as long again after that (measured here with a
    stand-in rank: 1 s and 2 s by default, too short for a save), and stops relaying the ranks' output, so a
    rank whose pipe fills blocks in a write: a signalled rank moves its output to stop-rank<R>.log in the run
    folder. With 20 s, as scripts/launch_mpirun.sh sets a value for, the ranks get SIGTERM, save and exit 0;
    mpirun exits 1 (its job was aborted)."""
    cmd = [
        "mpirun",
        "-np",
        str(W),
        "--bind-to",
        "none",
        "--oversubscribe",
        "--mca",
        "odls_base_sigkill_timeout",
        "20",
    ]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for var in ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCH_EXTENSIONS_DIR"):
        cmd += ["-x", var]
    cmd += ["-x", "MASTER_ADDR", "-x", "MASTER_PORT", sys.executable, "-m", "ds_clip.train"]
    cmd += _run_args(model_dir, tmp_path, "mpi", steps=MPI_STEPS)
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    rc, out = _drive(cmd, [("step 2/", _killpg_action(signal.SIGINT))], env=env)
    # mpirun no longer relays a signalled rank's output: each rank then writes to stop-rank<R>.log.
    out += "".join(p.read_text() for p in sorted((tmp_path / "mpi").glob("stop-rank*.log")))
    _assert_stopped_and_saved(out, tmp_path / "mpi", "received SIGTERM", total=MPI_STEPS)
    _assert_nothing_left(tmp_path)
    assert rc == 1, out[-4000:]


# --------------------------------------------------------------------------------------------- SLURM-style


def _step_processes(procs: list[subprocess.Popen]) -> list[int]:
    """Each rank's process group: the rank and its DataLoader workers (what SLURM signals in a job step)."""
    return [p.pid for p in procs]


def _slurm_ranks(args: list[str], tmp: Path, signals: list[tuple[str, list[signal.Signals]]]) -> list[int]:
    """W ranks started by hand, each in a session of its own (as slurmstepd starts tasks), output of rank 0
    read line by line. When rank 0 prints a trigger, every process of the step gets each signal of that
    entry (killpg of each rank's group: the rank and its workers). Returns the ranks' exit statuses."""
    port = str(_free_port())
    tmp.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(W):
        env = _env()
        env.update(
            RANK=str(r), WORLD_SIZE=str(W), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
        )
        out = subprocess.PIPE if r == 0 else (tmp / f"rank{r}.out").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ds_clip.train", *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )  # fmt: skip
        )
    watchdog = threading.Timer(DEADLINE_S, lambda: [_killpg(p.pid) for p in procs])
    watchdog.start()
    pending, lines = list(signals), []
    try:
        for line in procs[0].stdout:
            lines.append(line)
            if pending and pending[0][0] in line:
                for sig in pending.pop(0)[1]:
                    for pgid in _step_processes(procs):
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(pgid, sig)
        codes = [p.wait(timeout=DEADLINE_S) for p in procs]
    finally:
        watchdog.cancel()
        for p in procs:
            _killpg(p.pid)
    (tmp / "rank0.out").write_text("".join(lines))
    assert not pending, f"never saw {pending[0][0]!r}:\n{''.join(lines)[-4000:]}"
    return codes


def test_slurm_signals_early_warning_then_preemption_twice(model_dir, tmp_path, reference):  # noqa: F811
    """SLURM's patterns, every process of the step signalled. (1) `--signal=USR1@120`: SIGUSR1 → the ranks
    save and exit 0. (2) The resumed job is preempted (SIGTERM) and, once rank 0 says it is saving, signalled
    SIGTERM again (a second scancel): the ranks end at once, killed by the signal, and the last complete
    checkpoint stays usable. (3) `--resume latest` from it reaches the never-stopped run exactly."""
    run = tmp_path / "slurm"
    args = _run_args(model_dir, tmp_path, "slurm")
    codes = _slurm_ranks(args, tmp_path / "usr1", [("step 2/", [signal.SIGUSR1])])
    assert codes == [0] * W, (tmp_path / "usr1" / "rank0.out").read_text()[-4000:]
    out = (tmp_path / "usr1" / "rank0.out").read_text()
    first = _assert_stopped_and_saved(out, run, "received SIGUSR1")

    resumed = [*args, "--resume", "latest"]
    codes = _slurm_ranks(
        resumed,
        tmp_path / "term",
        [(f"step {first + 2}/", [signal.SIGTERM]), ("stopping after step", [signal.SIGTERM])],
    )
    out = (tmp_path / "term" / "rank0.out").read_text()
    assert -signal.SIGTERM in codes, (codes, out[-4000:])
    assert "DataLoader worker" not in out
    latest = _latest(run)
    assert (run / "checkpoints" / latest / "COMPLETE").exists()
    _assert_nothing_left(tmp_path)
    _resume_and_compare(model_dir, tmp_path, "slurm", reference, int(latest.removeprefix("step_")))


def test_slurm_batch_script_passes_the_early_warning_to_the_ranks(model_dir, tmp_path):  # noqa: F811
    """`#SBATCH --signal=B:USR1@120` signals the batch shell only; scripts/launch_slurm.sbatch traps it and
    passes it to srun. Here a stand-in `srun` runs the task itself (one rank) and a stand-in `scontrol` names
    this host; SIGUSR1 goes to the batch shell alone: the rank saves and the script exits 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = _env()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NODELIST="localhost",
        SLURM_CPUS_PER_TASK="1", MASTER_PORT=str(_free_port()),
    )  # fmt: skip
    script = ROOT / "scripts" / "launch_slurm.sbatch"
    cmd = ["bash", str(script), *_args(model_dir, tmp_path, "sbatch", steps=STEPS)]
    rc, out = _drive(cmd, [("step 2/", lambda proc: proc.send_signal(signal.SIGUSR1))], env=env)
    assert rc == 0, out[-4000:]
    said = [line for line in out.splitlines() if SAVED.search(line)]
    assert len(said) == 1 and "received SIGUSR1" in said[0], out[-4000:]
    assert (tmp_path / "sbatch" / "checkpoints" / _latest(tmp_path / "sbatch") / "COMPLETE").exists()
    _assert_nothing_left(tmp_path)

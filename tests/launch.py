"""The real launchers as the end-to-end tests start them: one environment, one command line per launcher, and
one bounded run in its own session (a hang is killed with all its ranks, and the test fails with the tail of
what it printed).

    ran = launch.run(launch.deepspeed("--model", model, ...))          # deepspeed --num_gpus 2 --module ds_clip.train
    ran = launch.run(launch.torchrun(*args, nodes=2, node_rank=0, port=p), env=launch.environment(HF_ENDPOINT=url))
    proc = launch.start(launch.deepspeed(*args)); ...; ran = launch.finish(proc)   # to signal it meanwhile

Each launch gets a free port: another job on the machine may hold the launchers' default 29500.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ds_clip.distributed import _free_port

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TIMEOUT_S = 600

# What a launcher sets for its ranks: a test process must not hand its own (or a fault request) down.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DS_CLIP_INJECT_FAULT")


def free_port() -> int:
    return _free_port()


def environment(**extra: str) -> dict[str, str]:
    """This checkout's ds_clip and this venv's tools first, one thread per rank, unbuffered output, plus `extra`."""
    out = dict(os.environ)
    out["PATH"] = f"{VENV_BIN}{os.pathsep}{out.get('PATH', '')}"
    out["PYTHONPATH"] = str(ROOT)
    out["PYTHONUNBUFFERED"] = "1"
    out["OMP_NUM_THREADS"] = "1"
    # DeepSpeed JIT-builds its CPU shared-memory comm op into ~/.cache/torch_extensions, keyed by op name only:
    # two checkouts with different venvs on one machine rebuild it back and forth (~60 s each), which a bounded
    # launch cannot absorb. Keep this venv's build next to the venv.
    out.setdefault("TORCH_EXTENSIONS_DIR", str(VENV_BIN.parent / "torch_extensions"))
    for k in _RANK_VARIABLES:
        out.pop(k, None)
    out.update(extra)
    return out


def deepspeed(
    *args: str, ranks: int = 2, port: int | None = None, module: str | None = "ds_clip.train"
) -> list[str]:
    """`deepspeed --num_gpus R --master_port P --module ds_clip.train ARGS` (module=None: ARGS name a script)."""
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(port or _free_port())]
    return [*cmd, *(["--module", module] if module else []), *args]


def torchrun(
    *args: str,
    ranks: int = 1,
    port: int | None = None,
    nodes: int | None = None,
    node_rank: int | None = None,
) -> list[str]:
    """`torchrun --nproc-per-node R --master-port P -m ds_clip.train ARGS` (several nodes: --nnodes/--node-rank)."""
    cmd = ["torchrun"]
    if nodes is not None:
        cmd += ["--nnodes", str(nodes), "--node-rank", str(node_rank or 0), "--master-addr", "127.0.0.1"]
    cmd += ["--nproc-per-node", str(ranks), "--master-port", str(port or _free_port())]
    return [*cmd, "-m", "ds_clip.train", *args]


def start(
    cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | str = ROOT, merge_stderr: bool = False
) -> subprocess.Popen:
    """`cmd` in its own session (so one kill takes the launcher and its ranks), its output captured."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env if env is not None else environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the whole session of `proc` (the launcher and every rank it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Wait for `proc`; past `timeout` its session is killed and the test fails with the output's tail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"{Path(str(proc.args[0])).name} did not end within {timeout} s:\n{(out + (err or ''))[-4000:]}"
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err or "")


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | str = ROOT, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """`cmd` to its end (stdout and stderr apart), bounded by `timeout`."""
    return finish(start(cmd, env=env, cwd=cwd), timeout)

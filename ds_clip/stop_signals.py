"""The signals that stop a run (ds_clip.preemption handles them in each rank) and the DataLoader
``worker_init_fn`` that keeps them away from the rank's loader workers.

torch installs its own SIGTERM handler in every DataLoader worker (it prints and dies), and a signal sent to a
process group (Ctrl-C in a terminal, torchrun and DeepSpeed's launch.py stopping a rank's tree, SLURM
signalling every process of a job step) reaches the workers as well as the rank. A worker that dies takes the
rank's step down with ``DataLoader worker (pid ...) is killed by signal: Terminated`` before the rank can save.
So the workers ignore the stop signals and leave when their rank leaves.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""SIGTERM (SLURM preemption and scancel, launchers stopping a job), SIGINT (Ctrl-C), SIGUSR1 (SLURM's
``--signal=USR1@SECONDS`` early warning)."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ignore_in_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: ignore the stop signals (the rank finishes its step, saves, and shuts
    its workers down) and get SIGKILLed when the rank dies (Linux ``PR_SET_PDEATHSIG``; elsewhere torch's
    own check of the parent pid ends the worker within seconds)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

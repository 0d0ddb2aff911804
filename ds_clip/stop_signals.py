"""The signals that stop a run (ds_clip.training.preemption handles them in each rank) and the DataLoader
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
import logging
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


def loader_workers(workers: int) -> dict:
    """The DataLoader keyword arguments that start a rank's loader workers: ``num_workers``, the
    ``worker_init_fn`` above, and how they start. A fork copies the rank's memory as it is, locks included: on
    CPython before 3.12, a fork while another Python thread holds the interpreter's HEAD_LOCK leaves the child
    waiting on it forever (CPython gh-112275), and ds_clip's rank can run other threads (the --remote-sync copier,
    TensorBoard's and W&B's writers). So while any other thread is alive, the workers start from a fork server:
    a fresh single-threaded process started once per rank (torch and the data modules preloaded in it) that
    forks each worker, so no worker inherits a lock some other thread held. With no other thread (the common
    case) nothing can hold that lock and the workers fork from the rank as before. The DataLoader is built and
    iterated at once, so the thread count read here is the one at the fork. Start cost: docs/data.md."""
    import threading

    if workers <= 0:
        return {"num_workers": 0, "worker_init_fn": ignore_in_worker}
    start = None
    # One look at the threads decides and names them: a thread that ends between two looks (a finished loader's
    # queue feeder) would otherwise choose the fork server and then be missing from the line that names them.
    others = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    if others:
        start = _forkserver()
        if not _said:
            _said.append(True)
            logging.getLogger("ds_clip").info(
                "loader workers start from a fork server: other threads run in this rank (%s)",
                ", ".join(others),
            )
    return {"num_workers": workers, "worker_init_fn": ignore_in_worker, "multiprocessing_context": start}


_said: list[bool] = []  # the fork server is named once per rank

_PRELOAD = ["torch", "ds_clip.data", "open_clip"]
"""What the fork server imports once, so a worker forked from it unpickles its dataset without importing
them again."""


def _forkserver():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx

"""Stop requests: a signal (Ctrl-C, SLURM preemption, a launcher stopping the job, SLURM's early warning) or
the launcher going away → every rank finishes its step, all save the same step, and the run exits 0.

What each signal does under each launcher is in docs/faults.md ("Signals"). The mechanism:

- ``StopRequest.install()`` handles SIGINT, SIGTERM and SIGUSR1 in the rank's main process. The handler only
  records the signal; the loop asks ``agreed_stop()`` after every optimizer step, a collective (one 4-byte
  all-reduce of the strongest reason, on the accelerator) so that every rank saves the same step together,
  even when only some of them were signalled.
- A repeat of SIGINT or SIGTERM means "now": after the first one the handler hands that signal back to the
  kernel's default action, so the second one ends the rank at once, even while it waits inside a collective
  (Python runs its handlers only between bytecodes, never inside a blocked C call). A checkpoint cut short
  that way has no ``COMPLETE`` marker and ``latest_complete`` still names the previous one. Different
  signals do not count as a repeat: Ctrl-C under ``deepspeed`` brings the terminal's SIGINT and then the
  launcher's SIGTERM, under ``mpirun`` likewise, and SLURM's SIGUSR1 warning is followed by SIGTERM.
- SIGUSR1 (SLURM ``--signal=USR1@SECONDS``, or ``B:USR1`` forwarded by scripts/launch_slurm.sbatch) is a
  request like the others; repeats of it are ignored.
- Processes forked from a rank (DataLoader workers) inherit the handler; there it does nothing, so that only
  the rank decides. ``stop_signals.ignore_in_worker`` (every training DataLoader's ``worker_init_fn``) also overrides torch's own
  worker handler, which would let SIGTERM kill the worker and with it the rank's step.
- ``LauncherWatch``: when the launcher that started this rank exits (SIGTERM or SIGKILL to the ``deepspeed``
  runner alone, or to ``torchrun``, ``mpirun``), nobody would stop the rank: it would train on, orphaned. The
  rank notices at its next step (the parent pid changes, or a watched ancestor is gone) and stops like
  after a signal.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_clip.distributed import all_reduce_max
from ds_clip.stop_signals import STOP_SIGNALS

# The reason every rank agrees on is the strongest any rank has (all_reduce_max of these codes).
_LAUNCHER_GONE = 1
_CODES = {
    signal.SIGUSR1: 2,
    signal.SIGTERM: 3,
    signal.SIGINT: 4,
}  # Ctrl-C names a stop that launchers turn into SIGTERM
_NAMES = {0: None, _LAUNCHER_GONE: "the launcher's exit", **{c: s.name for s, c in _CODES.items()}}

# The processes that launch ranks and stop them when the job stops, as their command lines name them: a program
# (argv[0], or the script a Python interpreter runs) or a module run with -m.
_LAUNCHER_PROGRAMS = frozenset(
    ("deepspeed", "torchrun", "mpirun", "mpiexec", "orterun", "orted", "prterun", "prted")
)
_LAUNCHER_MODULES = frozenset(
    (
        "deepspeed.launcher.launch",
        "deepspeed.launcher.runner",
        "torch.distributed.run",
        "torch.distributed.launch",
    )
)


_OPEN_MPI = frozenset(("mpirun", "mpiexec", "orterun", "orted", "prterun", "prted"))


@dataclass(frozen=True)
class _Proc:
    pid: int
    start: str  # the start time field of /proc/PID/stat: tells a reused pid apart
    args: tuple[str, ...]
    state: str


def _read_proc(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return None
    # The fields after the parenthesised command name: state (3), ppid (4), ..., starttime (22).
    rest = stat[stat.rfind(")") + 2 :].split()
    return _Proc(pid, rest[19], args, rest[0])


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def _is_launcher(p: _Proc) -> bool:
    programs = {os.path.basename(a) for a in p.args[:2]}
    modules = {p.args[i + 1] for i, a in enumerate(p.args[:-1]) if a == "-m"}
    return bool(programs & _LAUNCHER_PROGRAMS or modules & _LAUNCHER_MODULES)


class LauncherWatch:
    """The chain of launcher processes above this rank (the ``deepspeed`` runner and its ``launch.py``;
    ``torchrun``; ``mpirun``), read once at start from /proc; ``gone()`` (a few /proc reads) is true once
    any of them has exited. Empty, and never gone, when the parent is no launcher (ranks started by hand,
    by a scheduler, by srun's step daemon): a shell that exits must not stop a run started under it."""

    def __init__(self, pid: int | None = None) -> None:
        self.chain: list[_Proc] = []
        if not os.path.isdir("/proc"):
            return
        parent = _parent_pid(pid or os.getpid())
        while parent and parent > 1 and (p := _read_proc(parent)) is not None and _is_launcher(p):
            self.chain.append(p)
            parent = _parent_pid(parent)

    @property
    def is_open_mpi(self) -> bool:
        """Started by Open MPI (mpirun, orted): once signalled, its mpirun stops relaying the ranks' output."""
        return any({os.path.basename(a) for a in p.args[:1]} & _OPEN_MPI for p in self.chain)

    def gone(self) -> _Proc | None:
        """The first watched launcher process that has exited (its pid gone or reused), else None."""
        for p in self.chain:
            now = _read_proc(p.pid)
            # Exited: no such pid, the pid reused by a newer process, or a zombie its parent has not reaped yet.
            if now is None or now.start != p.start or now.state in ("Z", "X"):
                return p
        return None


class StopRequest:
    """Records stop signals in this rank; ``agreed_stop()`` tells every rank, the same on all, whether to
    save and stop after this step."""

    def __init__(self, watch: LauncherWatch | None = None, *, output_on_signal: Path | None = None) -> None:
        """``output_on_signal``: where this rank's stdout and stderr go from its first signal on, under Open MPI
        only (see ``_divert_output``); None keeps them."""
        self.signal_name: str | None = None
        """The first signal this process received (None: none yet)."""
        self.reason: str | None = None
        """What all ranks agreed to stop for (set by ``agreed_stop``): a signal's name or the launcher's exit."""
        self.watch = watch if watch is not None else LauncherWatch()
        self.launcher_gone: _Proc | None = None
        self._code = 0
        self._owner = os.getpid()
        self._divert_to = output_on_signal if self.watch.is_open_mpi else None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._owner:
            return  # a forked DataLoader worker inherited this handler: its rank decides, the worker ignores
        sig = signal.Signals(signum)
        if self._divert_to is not None:
            self._divert_output(self._divert_to)
        if self.signal_name is None:
            self.signal_name = sig.name
        self._code = max(self._code, _CODES[sig])
        # The same signal again means "now" (a second Ctrl-C, a second scancel): the kernel's default action
        # ends the process even inside a blocked collective, where a Python handler would never run.
        # A second early warning changes nothing.
        signal.signal(signum, signal.SIG_IGN if sig == signal.SIGUSR1 else signal.SIG_DFL)

    def _divert_output(self, path: Path) -> None:
        """Open MPI 4's mpirun stops reading the ranks' stdout and stderr once it is signalled (Ctrl-C, kill),
        then sends them SIGTERM: a rank whose pipe has filled meanwhile is stuck in a write and could never save.
        Pointing fds 1 and 2 at a file in the run folder lets that write (retried after this handler) and the
        stop's own messages go through."""
        self._divert_to = None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def agreed_stop(self) -> bool:
        """True on every rank if any rank was signalled or lost its launcher (a collective: every rank calls
        it after every step). Sets ``reason`` to the strongest reason among the ranks."""
        code = self._code
        if code == 0 and self.launcher_gone is None:
            self.launcher_gone = self.watch.gone()
        if self.launcher_gone is not None:
            code = max(code, _LAUNCHER_GONE)
        agreed = int(all_reduce_max(torch.tensor(float(code))).item())
        self.reason = _NAMES[agreed]
        return agreed > 0

    def describe(self) -> str:
        """What the stop is for, as the log says it: ``received SIGTERM``, or the launcher's exit."""
        if self.reason is None:
            return "no stop"
        if self.reason == _NAMES[_LAUNCHER_GONE]:
            if self.launcher_gone is not None:
                return f"the launcher (pid {self.launcher_gone.pid}) exited"
            return "another rank's launcher exited"
        return f"received {self.reason}"

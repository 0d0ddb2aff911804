"""Stop requests in one process: which signals count, what a repeat does, DataLoader workers that ignore the
stop signals, and the watch on the launcher above a rank (docs/faults.md, "Signals"). The launchers
themselves are exercised in tests/faults/test_signals.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_clip.stop_signals import ignore_in_worker
from ds_clip.training.preemption import LauncherWatch, StopRequest


@pytest.fixture
def stop():
    s = StopRequest(watch=LauncherWatch(pid=1)).install()  # pid 1: no launcher above, nothing watched
    yield s
    s.uninstall()


def _send(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)  # Python runs the handler before the next bytecode of this thread


def test_one_signal_is_recorded_and_agreed_then_the_same_signal_again_is_the_kernels(stop):
    """SIGTERM is recorded (the loop saves and stops); SIGTERM is then left to the kernel's default action, so a
    second SIGTERM ends the process at once, even inside a blocked collective."""
    assert not stop.agreed_stop() and stop.reason is None
    _send(signal.SIGTERM)
    assert stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) == stop._handle  # another signal is not a repeat
    assert stop.agreed_stop() and stop.describe() == "received SIGTERM"


def test_sigint_then_the_launchers_sigterm_is_one_stop_not_two(stop):
    """Ctrl-C under deepspeed or mpirun: the terminal's SIGINT, then the launcher's SIGTERM. Both are recorded,
    the first names the stop, nothing ends the process."""
    _send(signal.SIGINT)
    _send(signal.SIGTERM)
    assert stop.signal_name == "SIGINT"
    assert stop.agreed_stop() and stop.reason == "SIGINT"  # Ctrl-C names it, not what the launcher made of it
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL == signal.getsignal(signal.SIGTERM)


def test_sigusr1_early_warning_stops_and_repeats_are_ignored(stop):
    _send(signal.SIGUSR1)
    _send(signal.SIGUSR1)  # ignored, the process lives on
    assert stop.agreed_stop() and stop.describe() == "received SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) == stop._handle  # SLURM's SIGTERM after the warning still counts


def test_uninstall_restores_the_previous_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    stop = StopRequest(watch=LauncherWatch(pid=1)).install()
    _send(signal.SIGTERM)
    stop.uninstall()
    assert {s: signal.getsignal(s) for s in before} == before


class _SignalsItself(torch.utils.data.Dataset):
    """Each item sends SIGTERM and SIGINT to the worker reading it, as a process-group signal reaches it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
        return torch.tensor([i])


def test_dataloader_workers_ignore_the_stop_signals():
    """torch's own worker handler lets SIGTERM kill the worker ("DataLoader worker ... is killed by signal:
    Terminated" in the rank); with ignore_in_worker the worker serves every item."""
    loader = torch.utils.data.DataLoader(_SignalsItself(), num_workers=1, worker_init_fn=ignore_in_worker)
    assert [int(b) for b in loader] == [0, 1, 2, 3]
    plain = torch.utils.data.DataLoader(_SignalsItself(), num_workers=1)
    with pytest.raises(RuntimeError, match="DataLoader worker"):  # died by the signal
        list(plain)


_CHILD = textwrap.dedent(
    """
    import sys
    from ds_clip.training.preemption import LauncherWatch
    watch = LauncherWatch()
    print(len(watch.chain), flush=True)
    sys.stdin.readline()  # the test killed the launcher
    print("gone" if watch.gone() else "alive", flush=True)
    """
)


def test_launcher_watch_notices_the_launcher_exit(tmp_path):
    """A rank whose launcher (a stand-in: a Python script named torchrun that starts the rank, as the real one
    does) is SIGKILLed sees it gone; the same rank under a plain parent (a shell, a scheduler) watches nothing."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    fake = tmp_path / "torchrun"
    fake.write_text("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', sys.argv[1]]).wait()\n")
    launcher = subprocess.Popen(
        [sys.executable, str(fake), _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert launcher.stdout.readline().strip() == "1"
        launcher.kill()
        launcher.wait(timeout=30)
        launcher.stdin.write("\n")
        launcher.stdin.flush()
        assert launcher.stdout.readline().strip() == "gone"
    finally:
        launcher.kill()
        launcher.stdout.close()
        launcher.stdin.close()
    plain = subprocess.run(
        [sys.executable, "-c", _CHILD], input="\n", capture_output=True, text=True, env=env, timeout=60
    )
    assert plain.stdout.split() == ["0", "alive"], plain.stderr


def test_the_fork_server_line_names_the_threads_that_chose_it(monkeypatch, caplog):
    """Loader workers start from a fork server only when another thread runs, and the line that says so names
    them. A thread that ends while the choice is made (a finished loader's queue feeder does) must not give
    "other threads run in this rank ()": here it ends as the threads are listed (a profile hook on
    threading.enumerate ends it at that call), so the one look finds no other thread (plain fork, no line) or
    finds some, and then names them."""
    import logging
    import threading

    from ds_clip import stop_signals

    monkeypatch.setattr(stop_signals, "_said", [])  # the line is said once per process: say it here
    release = threading.Event()
    ending = threading.Thread(target=release.wait, name="ending-thread")
    ending.start()

    def end_it_on_enumerate(frame, event, arg) -> None:
        if event == "call" and frame.f_code is threading.enumerate.__code__ and ending.is_alive():
            release.set()
            ending.join()

    others_before = {t.name for t in threading.enumerate()} - {
        "ending-thread",
        threading.current_thread().name,
    }
    sys.setprofile(end_it_on_enumerate)
    try:
        with caplog.at_level(logging.INFO, logger="ds_clip"):
            kwargs = stop_signals.loader_workers(2)
    finally:
        sys.setprofile(None)
        release.set()
    lines = [r.getMessage() for r in caplog.records if "fork server" in r.getMessage()]
    assert "()" not in " ".join(lines) and "ending-thread" not in " ".join(lines), lines
    assert (kwargs["multiprocessing_context"] is not None) == bool(lines) == bool(others_before), lines

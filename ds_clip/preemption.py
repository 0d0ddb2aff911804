"""SIGTERM / SIGINT (SLURM preemption, Ctrl-C, the launcher stopping us): finish the step, save, exit 0.

The handler only records the signal; the loop asks ``should_stop()`` after every optimizer step, and
all ranks agree (one 4-byte all-reduce) so that every rank saves the same step together, even when
only some of them were signalled. A second SIGINT stops at once (KeyboardInterrupt).
"""

from __future__ import annotations

import signal
import threading

from ds_clip.distributed import any_rank


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: the user really means now
        self.signal_name = signal.Signals(signum).name

    def should_stop(self) -> bool:
        """True on every rank if any rank has been signalled (a collective: call it on all ranks)."""
        stop = any_rank(self.signal_name is not None)
        if stop and self.signal_name is None:
            self.signal_name = "a signal on another rank"
        return stop

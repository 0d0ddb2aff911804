"""ds_clip/shm.py on its own (no process group): which DeepSpeed shm buffers the start-up sweep removes.

The runs themselves (a normal 2-rank run, its resume, and a SIGKILLed rank) are checked in
tests/test_e2e.py::test_deepspeed_launcher_trains_and_resumes and
tests/faults/test_faults.py::test_dead_rank_under_deepspeed_launcher_ends_the_job.
"""

from __future__ import annotations

import mmap
import os

from ds_clip import shm


def _file(path, age_s: float) -> None:
    path.write_bytes(b"\0" * 4096)
    t = path.stat().st_mtime - age_s
    os.utime(path, (t, t))


def test_sweep_removes_only_unmapped_deepspeed_buffers_past_the_grace_period(tmp_path, capsys):
    """A buffer no live process maps or holds open is removed (one line with the count); one this
    process maps, one held open, one younger than the grace period and a non-DeepSpeed file stay."""
    old = 10 * shm.GRACE_S
    stale = [tmp_path / shm.buffer_name(r, addr="127.0.0.1", port="1234") for r in (0, 1)]
    mapped = tmp_path / shm.buffer_name(0, addr="127.0.0.1", port="2345")
    held = tmp_path / shm.buffer_name(1, addr="127.0.0.1", port="2345")
    young = tmp_path / shm.buffer_name(0, addr="127.0.0.1", port="3456")
    other = tmp_path / "sem.mp-someone"
    for p in (*stale, mapped, held, other):
        _file(p, old)
    _file(young, 0)
    with mapped.open("r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)
    fd = os.open(held, os.O_RDWR)
    try:
        assert shm.stale_buffers(tmp_path) == stale
        assert shm.sweep_stale(tmp_path) == 2
        line = capsys.readouterr().out.strip().splitlines()
        assert len(line) == 1 and "removed 2 stale DeepSpeed shared-memory buffer(s)" in line[0], line
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            p.name for p in (mapped, held, young, other)
        )
        assert shm.sweep_stale(tmp_path) == 0 and capsys.readouterr().out == ""  # nothing to say
    finally:
        mapping.close()
        os.close(fd)
    # Unmapped and closed, the two are stale now.
    assert shm.sweep_stale(tmp_path) == 2


def test_buffer_name_is_deepspeeds_and_release_own_unlinks_it(tmp_path, monkeypatch):
    """shm.cpp names rank r's buffer deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<r>."""
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29501")
    name = shm.buffer_name(3)
    assert name == f"deepspeed_allreduce_buffer_{os.getuid()}_10.1.2.3_29501_3"
    (tmp_path / name).write_bytes(b"x")
    assert shm.release_own(3, tmp_path) and not (tmp_path / name).exists()
    assert not shm.release_own(3, tmp_path)  # nothing there: no error

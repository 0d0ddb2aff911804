"""benchmarks/bench_largest.py: bad arguments name the flag; one tiny real run of the three methods; a trial
over the memory budget is killed and recorded as such, not as a crash; the report renders saved JSON.

No timing is asserted (speed lives in docs/benchmarks.md). Every trial is a fresh trainer process (about
10 s of start-up each on 2 CPU cores), so the real run is kept to one N per method and the over-budget
trial to one, whose budget is below any trainer's start-up floor.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_largest as bench  # a tool beside the package, not in the wheel


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--memory-budget", "0"], "--memory-budget"),
        (["--memory-budget", "100000"], "--memory-budget"),
        (["--time-cap", "-1"], "--time-cap"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "8", "--start-n", "12"], "--start-n"),
        (["--batch-size", "8", "--max-n", "4"], "--max-n"),
        (["--steps", "0"], "--steps"),
        (["--tile-size", "0"], "--tile-size"),
        (["--methods", "accum"], "--methods"),
        (["--losses", "triplet"], "--losses"),
        (["--resume"], "--resume"),
        (["--report", "/no/such/file.json"], "--report"),
    ],
)
def test_bad_arguments_name_the_flag(capsys, argv, flag):
    err = _error(capsys, argv)
    assert err.startswith("benchmarks/bench_largest.py: error:") and flag in err
    assert "Traceback" not in err


def _trial(method: str, n: int, status: str, loss: str = "clip") -> bench.Trial:
    ok = status == bench.OK
    return bench.Trial(
        method=method, loss=loss, n=n, m=4, k=n // 4, status=status, peak_rss_mib=1000.0 + n,
        polled_peak_mib=1000.0 + n, maxrss_mib=1000.0 + n,
        wall_s=1.0, step_s=0.001 * n if ok else None, step_times_s=[0.001 * n] * (2 if ok else 0),
    )  # fmt: skip


def test_largest_is_the_last_ok_trial_before_the_first_failure():
    trials = [
        _trial("dense", 4, bench.OK),
        _trial("dense", 8, bench.OK),
        _trial("dense", 16, bench.OVER_MEMORY),
        _trial("tiled", 4, bench.OK),
        _trial("open_clip", 4, bench.OVER_TIME),
    ]
    best, stop = bench.largest(trials, "dense", "clip")
    assert (best.n, stop.n, stop.status) == (8, 16, bench.OVER_MEMORY)
    best, stop = bench.largest(trials, "tiled", "clip")
    assert (best.n, stop) == (4, None)
    best, stop = bench.largest(trials, "open_clip", "clip")
    assert (best, stop.status) == (None, bench.OVER_TIME)
    table = bench.markdown(trials)
    assert "| clip | ds_clip dense loss | **8** (2) |" in table and "16: over memory budget" in table
    assert "| clip | open_clip_train --accum-freq k | none |" in table


def test_tiny_run_every_method_reports_a_largest_n(tmp_path, capsys):
    """The real trainers (open_clip_train, ds-clip-train dense and tiled), one N each: every method trains
    its steps within the budget, the JSON holds the trials, and --report re-renders them with the plot."""
    out, img = tmp_path / "largest.json", tmp_path / "largest.png"
    argv = ["--losses", "clip", "--batch-size", "4", "--start-n", "8", "--max-n", "8", "--tile-size", "4",
            "--memory-budget", "4", "--time-cap", "120", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    trials = [bench.Trial(**t) for t in data["trials"]]
    assert {t.method for t in trials} == set(bench.METHODS)
    for method in bench.METHODS:
        best, stop = bench.largest(trials, method, "clip")
        assert best is not None and best.n == 8 and best.k == 2 and stop is None, trials
        assert len(best.step_times_s) == 2 and best.step_s == best.step_times_s[1]
        assert best.peak_rss_mib > 100 and best.exit == "exit 0"
    capsys.readouterr()
    assert bench.main(["--report", str(out), "--img", str(img)]) == 0
    report = capsys.readouterr().out
    assert "| clip | ds_clip tiled loss | **8** (2) |" in report and "not tried (--max-n)" in report
    assert img.stat().st_size > 0


def test_a_trial_over_the_budget_is_killed_and_recorded_not_a_crash(tmp_path):
    """A budget below every trainer's start-up floor (torch alone is more): the watchdog kills the trial."""
    s = bench.LargestSettings(memory_budget_gib=0.25, time_cap_s=120, micro_batch_size=4)
    models = bench.write_model_dirs(tmp_path)
    t = bench.run_trial("dense", "clip", 8, s, models, log=lambda *_: None)
    assert t.status == bench.OVER_MEMORY and t.exit == "killed: over memory budget", t
    assert t.peak_rss_mib > 256 and "budget 256 MiB" in t.detail
    assert t.step_s is None

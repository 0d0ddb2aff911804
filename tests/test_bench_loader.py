"""benchmarks/bench_loader.py --data web: one tiny run writes the web-like shards, measures each --decode mode
--rounds times and reports the PSNR of fast against exact. No timing is asserted (speed lives in docs/benchmarks.md)."""

from __future__ import annotations

import json

from benchmarks import bench_loader as bench  # a tool beside the package, not in the wheel


def test_web_data_rows_for_each_decode_mode_and_the_psnr(tmp_path, capsys):
    out = tmp_path / "loader.json"
    argv = ["--data", "web", "--web-samples", "24", "--psnr-samples", "8", "--sizes", "64", "--decode", "fast",
            "exact", "--workers", "0", "--seconds", "0.01", "--rounds", "2", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["source"], r["workers"]) for r in report["rows"]}
    assert rows == {("web, --decode fast", 0), ("web, --decode exact", 0)}
    assert all(r["rate"] > 0 for r in report["rows"])
    # --rounds: each configuration measured that many times, the rate their median
    assert all(
        len(r["rounds"]) == 2 and min(r["rounds"]) <= r["rate"] <= max(r["rounds"]) for r in report["rows"]
    )
    psnr = report["psnr_fast_vs_exact_64px"]
    assert psnr["images"] == 8 and 0 <= psnr["bit_equal"] <= 8
    assert psnr["psnr_db_min"] is None if psnr["bit_equal"] == 8 else psnr["psnr_db_min"] > 30
    assert "| web, --decode fast | 64 | 0 |" in capsys.readouterr().out

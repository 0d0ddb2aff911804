"""benchmarks/bench_accum.py: bad arguments are one-line errors naming the flag; one tiny W=1 run yields every table.

No timing is asserted (speed lives in docs/benchmarks.md); the run checks what the benchmark counts:
one measurement per mode and timed step, the cache size formula, no loss collectives at W=1, the
plain-step baseline and its ratios, and the --report path that re-renders saved JSON.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import bench_accum as bench  # a tool beside the package, not in the wheel


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--k", "0"], "--k"),
        (["--batch-size", "-1"], "--batch-size"),
        (["--world-sizes", "0"], "--world-sizes"),
        (["--zero-stages", "4"], "--zero-stages"),
        (["--steps", "0"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
        (["--models", "no-such-model"], "--models"),
        (["--models", "ds-clip-tiny", "--image-size", "40"], "--image-size"),
        (["--coalesce", "maybe"], "--coalesce"),
        (["--coalesce", "on", "--zero-stages", "0"], "--coalesce"),
    ],
)
def test_bad_arguments_name_the_flag(capsys, argv, flag):
    err = _error(capsys, argv)
    assert err.startswith("benchmarks/bench_accum.py: error:") and flag in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    err = _error(capsys, ["--device", "cuda"])
    assert "--device cuda" in err and "CUDA is not available" in err


def test_reduced_resolution_config_is_registered():
    import open_clip

    name = bench.resolve_model("ds-clip-tiny", 32)
    assert name == "ds-clip-tiny-32px"
    assert open_clip.get_model_config(name)["vision_cfg"]["image_size"] == 32
    assert bench.resolve_model("ds-clip-tiny", None) == "ds-clip-tiny"


def test_default_engine_is_the_preset_ds_clip_train_picks():
    """--zero-stages default (the default): the engine ds-clip-train builds without --ds-config for W ranks."""
    assert bench.BenchSettings().zero_stages == [None]
    assert bench.engine_preset(None, "fp32", 1) == (0, "zero0_fp32 (default)")
    assert bench.engine_preset(None, "bf16", 2) == (1, "zero1_bf16 (default)")
    assert bench.engine_preset(None, "fp32", 1, coalesce="on") == (1, "zero1_fp32 (default)")
    assert bench.engine_preset(2, "fp32", 1) == (2, "zero2_fp32")


def test_theory_matches_the_readme():
    assert bench.theory(1, False) == 1.0
    assert bench.theory(8, False) == pytest.approx((4 * 8 - 1) / (3 * 8))
    assert bench.theory(8, True) == pytest.approx((5 * 8 - 1) / (4 * 8))


@pytest.mark.slow
def test_tiny_run_w1_measures_every_mode_and_reports(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--models", "ds-clip-tiny", "--image-size", "32", "--batch-size", "2", "--k", "1", "2",
            "--steps", "1", "--warmup", "0", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| ds-clip-tiny-32px" in printed

    data = json.loads(out.read_text())
    assert data["argv"] == argv and "loadavg" in data["machine"]
    rows = [bench.Measurement(**r) for r in data["measurements"]]
    assert sorted((r.mode, r.accum_freq) for r in rows) == [("cached", 1), ("cached", 2), ("plain", 1)]
    for r in rows:
        assert r.world_size == 1 and r.zero_stage == 0 and r.step_s > 0 and r.peak_mib >= r.base_mib > 0
        assert r.preset == "zero0_fp32 (default)"  # what ds-clip-train picks for one rank without --ds-config
        assert r.loss_collectives == {}  # one rank: the loss gathers nothing
        assert r.loss is not None and r.loss == r.loss  # finite-looking, not NaN
    by = {(r.mode, r.accum_freq): r for r in rows}
    d, m = 64, 2  # ds-clip-tiny's embed_dim, --batch-size
    assert by[("plain", 1)].cache_bytes == 0
    assert by[("cached", 2)].cache_bytes == 2 * 2 * m * d * 4 + 2 * 1 * m * d * 4 + 5056
    assert by[("cached", 2)].samples == 4 and by[("plain", 1)].samples == 2

    agg = {(r["mode"], r["k"]): r for r in bench.aggregate(rows)}
    assert agg[("plain", 1)]["vs_plain"] == 1.0
    assert agg[("cached", 2)]["theory"] == pytest.approx(7 / 6)
    assert "peak_vs_k1" in agg[("cached", 2)]

    img = tmp_path / "img"
    assert bench.main(["--report", str(out), "--img-dir", str(img)]) == 0
    assert "| ds-clip-tiny-32px" in capsys.readouterr().out
    assert sorted(p.name for p in img.glob("*.png")) == [
        "accum_compute_overhead.png",
        "accum_peak_memory.png",
        "accum_time_per_sample.png",
    ]


@pytest.mark.slow
def test_coalesce_axis_runs_one_engine_each_and_reports_both(tmp_path, capsys):
    """--coalesce off on: one engine per value, every mode measured on each, and the comms logger's
    gradient reduction passes recorded: the cached step at k=2 reduces as often as the plain step (one
    backward) with it on, twice as often with it off (ZeRO-2); --report renders the off -> on table again
    from the saved JSON."""
    out = tmp_path / "bench.json"
    argv = ["--models", "ds-clip-tiny", "--image-size", "32", "--batch-size", "2", "--k", "2",
            "--zero-stages", "2", "--coalesce", "off", "on", "--steps", "1", "--warmup", "0",
            "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    assert "gradient reductions off → on" in capsys.readouterr().out

    rows = [bench.Measurement(**r) for r in json.loads(out.read_text())["measurements"]]
    by = {(r.coalesce, r.mode, r.accum_freq): r for r in rows}
    assert sorted(by) == [("off", "cached", 2), ("off", "plain", 1), ("on", "cached", 2), ("on", "plain", 1)]
    plain = by[("off", "plain", 1)].grad_reduction_passes
    assert plain > 0
    assert by[("on", "plain", 1)].grad_reduction_passes == pytest.approx(plain)
    assert by[("on", "cached", 2)].grad_reduction_passes == pytest.approx(plain)
    assert by[("off", "cached", 2)].grad_reduction_passes == pytest.approx(2 * plain)

    assert bench.main(["--report", str(out)]) == 0
    assert "gradient reductions off → on" in capsys.readouterr().out


def test_report_of_a_missing_file_is_a_clear_error(capsys, tmp_path):
    err = _error(capsys, ["--report", str(tmp_path / "nope.json")])
    assert "--report" in err and "nope.json" in err


def test_exactness_cost_bound_and_profile_groups():
    """The bound the cached step is held to against DeepSpeed's own accumulation, (4k - 1)/(3k), and the operator
    groups a profiled step is split into (DeepSpeed's flatten is a copy, gloo's calls are collectives)."""
    from benchmarks import bench_exactness_cost, profile_step

    assert [round(bench_exactness_cost.bound(k), 2) for k in (1, 2, 4, 8)] == [1.0, 1.17, 1.25, 1.29]
    groups = {
        "aten::mm": "matmul",
        "aten::addmm": "matmul",
        "aten::cat": "copies",
        "aten::copy_": "copies",
        "aten::_fused_adamw_": "optimizer",
        "Optimizer.step#AdamW.step": "optimizer",
        "c10d::allreduce_": "collectives",
        "gloo:all_reduce": "collectives",
        "ProfilerStep*": "outside operators",
        "aten::gelu": "rest",
    }
    assert {op: profile_step.group_of(op) for op in groups} == groups


def test_exactness_cost_phases_name_where_each_side_spends_its_step(tmp_path):
    """--phases: one profiled step of each side, split by the cached step's own named ranges (the same ranges a
    user's torch.profiler trace shows) and the plain loop's; --warmup rounds are not timed."""
    from benchmarks import bench_exactness_cost

    out = tmp_path / "cost.json"
    argv = [
        "--model",
        "ds-clip-tiny",
        "--k",
        "2",
        "--world-sizes",
        "1",
        "--steps",
        "2",
        "--warmup",
        "2",
        "--phases",
        "--json",
        str(out),
    ]
    assert bench_exactness_cost.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # Two timed rounds after two untimed ones, each with its wall and CPU time.
    for key in ("cached_all_s", "plain_all_s", "cached_cpu_all_s", "plain_cpu_all_s"):
        assert len(row[key]) == 2 and all(t > 0 for t in row[key]), (key, row[key])
    assert row["ratio_cpu"] > 0
    phases = row["phases_s"]
    cached = {f"ds_clip.step.{p}" for p in ("embed", "loss", "push_back", "optimizer")}
    plain = {f"plain.{p}" for p in ("forward", "loss_backward", "optimizer")}
    assert set(phases) == cached | plain and all(v > 0 for v in phases.values()), phases


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--k", "0"], "--k"),
        (["--warmup", "0"], "--warmup"),
        (["--models", "no-such-model"], "--models"),
        (["--count-flops", "no-such-model"], "--count-flops"),
    ],
)
def test_siglip2_bad_arguments_name_the_flag(capsys, argv, flag):
    from benchmarks import bench_siglip2

    with pytest.raises(SystemExit) as e:
        bench_siglip2.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "benchmarks/bench_siglip2.py: error:" in err and flag in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_siglip2_after_the_start_trains_every_term_and_reports(tmp_path, capsys):
    """benchmarks/bench_siglip2.py: one row past the self-supervised start (small heads, two local views) times
    a step whose objective holds all four terms, with the teacher's EMA after it, and counts what --siglip2
    adds."""
    from benchmarks import bench_siglip2

    out = tmp_path / "siglip2.json"
    small = ["--siglip2-prototypes=256", "--siglip2-patch-prototypes=64", "--siglip2-local-views=2"]
    argv = ["--configs", "siglip2 after", "--k", "1", "--batch-size", "2", "--steps", "1", "--warmup", "1",
            "--json", str(out), *(f"--siglip2-flag={f}" for f in small)]  # fmt: skip
    assert bench_siglip2.main(argv) == 0
    assert "| ds-clip-tiny-siglip | 1 | 2 | siglip2 after |" in capsys.readouterr().out
    (run,) = json.loads(out.read_text())["runs"]
    assert run["selfsup"] and run["first_step"] == 800_000  # 0.8 of the 10**6 steps the schedule is built for
    assert set(run["parts"]) >= {"loss_contrastive", "loss_locca", "loss_silc", "loss_tips"}
    assert all(math.isfinite(v) for v in run["parts"].values()), run["parts"]
    assert len(run["step_s"]) == 1 and run["after_update_s"][0] > 0 and run["peak_mib"] >= run["base_mib"] > 0
    assert 0 < run["siglip2_params"] < run["params"] and run["teacher_params"] > 0
    assert run["flops"] > 0

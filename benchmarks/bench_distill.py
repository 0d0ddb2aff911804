"""What distillation costs: time and peak memory per optimizer step of ds-clip-train with --distill-model, next
to the same run without a teacher.

    python benchmarks/bench_distill.py                         # 4 runs: minutes on 2 quiet cores, ~25 at load 25
    python benchmarks/bench_distill.py --json benchmarks/results/raw/distill_cpu.json     # what docs/benchmarks.md shows
    python benchmarks/bench_distill.py --teacher student-size --json benchmarks/results/raw/distill_cpu_same_size.json

Each measurement is one ds-clip-train run (the real trainer, ``ds_clip.training.trainer.Trainer``, one rank, no
launcher) in a fresh process with ds-clip-train's defaults (ds-clip-tiny, m = 8, ZeRO-0 fp32, synthetic data)
plus ``--accum-freq`` (default 4) and ``--max-steps``; "teacher" runs add ``--distill-model`` with a teacher
of the student's image size and tokenizer, random weights saved as an open_clip folder (the cost does not
depend on what the weights are): ``--teacher bench-small`` (default; bench_accum's config, 4 layers of width
256 per tower, patch 8: a teacher bigger than the student, as distillation uses) or ``--teacher student-size``
(ds-clip-tiny itself: what the mechanism costs beyond the teacher's size). The runs alternate (none,
teacher, none, teacher...) so drifting load hits both alike.

Per run, the trainer's step (``Trainer._step``: the cached step and the clamp) is wrapped: the first
``--warmup-steps`` are not timed, the next ones are (wall time; a CUDA synchronize on a GPU), and one last
step measures memory as bench_accum does (CPU: peak RSS of that step after returning free heap memory to the
OS, "base" = RSS before it; GPU: max_memory_allocated). The teacher's parameter bytes are counted from the
model itself. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_accum import BENCH_SMALL, MIB, MemoryMeter, machine_info  # noqa: E402


def _child(payload: dict[str, Any]) -> dict[str, Any]:
    """One ds-clip-train run in this process; returns its step times and the memory of its last step."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from ds_clip.distributed import _free_port

    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import torch

    from ds_clip.config import parse_settings
    from ds_clip.training.trainer import Trainer

    torch.set_num_threads(payload["threads"])
    trainer = Trainer(parse_settings(payload["argv"]))
    device = str(trainer.engine.device)
    cuda = device.startswith("cuda")
    meter = MemoryMeter(device)
    times: list[float] = []
    memory: dict[str, float] = {}
    inner = trainer._step
    warmup, timed = payload["warmup_steps"], payload["timed_steps"]

    def step(batch, step_no, attempt):
        if attempt < warmup:
            return inner(batch, step_no, attempt)
        if attempt < warmup + timed:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = inner(batch, step_no, attempt)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            return out
        memory["base_mib"] = meter.start()
        out = inner(batch, step_no, attempt)
        memory["peak_mib"] = meter.peak()
        return out

    trainer._step = step
    trainer.train()
    teacher_bytes = 0
    if trainer.teacher is not None:
        teacher_bytes = sum(p.numel() * p.element_size() for p in trainer.teacher.model.parameters())
    student_bytes = sum(p.numel() * p.element_size() for p in trainer.engine.module.parameters())
    return {
        "times_s": times,
        **memory,
        "teacher_param_mib": teacher_bytes / MIB,
        "student_param_mib": student_bytes / MIB,
        "device": device,
    }


def _teacher_cfg(kind: str) -> dict[str, Any]:
    """bench-small (4 layers of width 256 per tower, patch 8: ~20x the student's forward FLOPs) or the
    student's own ds-clip-tiny config (the cost of the mechanism: one no-grad forward of a same-size model)."""
    if kind == "bench-small":
        return BENCH_SMALL
    from ds_clip.models.model import load_model_cfg

    return load_model_cfg("ds-clip-tiny")


def _write_teacher(root: Path, cfg: dict[str, Any]) -> str:
    from ds_clip_harness.models import write_pretrained_dir

    return write_pretrained_dir(root / "teacher", cfg, seed=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/bench_distill.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--accum-freq", type=int, default=4, help="k of every run (default 4)")
    p.add_argument(
        "--teacher",
        choices=("bench-small", "student-size"),
        default="bench-small",
        help="teacher config: bench_accum's bench-small (bigger than the student) or the student's own",
    )
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--timed-steps", type=int, default=6, help="timed steps per run (default 6)")
    p.add_argument("--reps", type=int, default=2, help="runs per mode, alternating (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more ds-clip-train flags (last)")
    p.add_argument("--json", type=Path, default=None, help="write the measurements here")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        payload = json.loads(a.child.read_text())
        result = _child(payload)
        Path(payload["out"]).write_text(json.dumps(result))
        return 0
    for name in ("accum_freq", "timed_steps", "reps", "threads"):
        if getattr(a, name) < 1:
            print(
                f"benchmarks/bench_distill.py: error: --{name.replace('_', '-')} must be >= 1",
                file=sys.stderr,
            )
            return 2
    runs: list[dict[str, Any]] = []
    load_at_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        teacher_cfg = _teacher_cfg(a.teacher)
        teacher = _write_teacher(root, teacher_cfg)
        steps = a.warmup_steps + a.timed_steps + 1
        base = ["--accum-freq", str(a.accum_freq), "--max-steps", str(steps), "--logs", str(root / "logs"),
                "--log-every-n-steps", str(steps), *a.extra]  # fmt: skip
        for rep in range(a.reps):
            for mode in ("none", "teacher"):
                argv_run = [*base, "--name", f"{mode}{rep}"]
                if mode == "teacher":
                    argv_run += ["--distill-model", teacher]
                payload = {
                    "argv": argv_run, "warmup_steps": a.warmup_steps, "timed_steps": a.timed_steps,
                    "threads": a.threads, "out": str(root / f"{mode}{rep}.json"),
                }  # fmt: skip
                (root / "payload.json").write_text(json.dumps(payload))
                env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(a.threads)}
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", str(root / "payload.json")],
                    cwd=ROOT, env=env, capture_output=True, text=True,
                )  # fmt: skip
                if proc.returncode != 0:
                    print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                    return 1
                result = json.loads(Path(payload["out"]).read_text())
                runs.append({"mode": mode, "rep": rep, "argv": argv_run, **result})
                print(f"{mode:8s} rep {rep}: median {statistics.median(result['times_s']):.3f} s/step, peak "
                      f"{result['peak_mib']:.0f} MiB (base {result['base_mib']:.0f})", flush=True)  # fmt: skip
    summary = {}
    for mode in ("none", "teacher"):
        rows = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            "median_step_s": statistics.median([t for r in rows for t in r["times_s"]]),
            "peak_mib": statistics.median([r["peak_mib"] for r in rows]),
            "base_mib": statistics.median([r["base_mib"] for r in rows]),
            "teacher_param_mib": rows[0]["teacher_param_mib"],
            "student_param_mib": rows[0]["student_param_mib"],
        }
    none, teach = summary["none"], summary["teacher"]
    summary["ratio"] = {
        "time": teach["median_step_s"] / none["median_step_s"],
        "peak_mib_extra": teach["peak_mib"] - none["peak_mib"],
        "base_mib_extra": teach["base_mib"] - none["base_mib"],
    }
    print(
        f"teacher / none: {summary['ratio']['time']:.2f}x time per step; peak +{summary['ratio']['peak_mib_extra']:.0f}"
        f" MiB, base +{summary['ratio']['base_mib_extra']:.0f} MiB; teacher parameters "
        f"{teach['teacher_param_mib']:.1f} MiB, student {teach['student_param_mib']:.1f} MiB"
    )
    if a.json is not None:
        report = {
            "machine": {**machine_info(runs[0]["device"]), "loadavg_at_start": load_at_start},
            "command": "python benchmarks/bench_distill.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "teacher": a.teacher,
            "teacher_cfg": teacher_cfg,
            "summary": summary,
            "runs": runs,
        }
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What --siglip2 (SigLIP 2's objective) costs per optimizer step against the plain sigmoid step (--siglip).

Run from the repository root with ds_clip installed (scripts/setup.sh). The run behind docs/benchmarks.md
("SigLIP 2"; about 15 minutes on 2 CPU cores):

    python benchmarks/bench_siglip2.py --models ds-clip-tiny-siglip sigmoid-bench-w256 --k 1 4 --steps 5 \\
        --warmup 2 --phases --count-flops ViT-B-16-SigLIP2 --json benchmarks/results/raw/siglip2_cpu.json

Quick look: ``python benchmarks/bench_siglip2.py --k 1 --steps 1 --warmup 1``

Three configurations of the step ``ds-clip-train`` builds (``ds_clip.training.wiring.build_run_step``), on the
same model, m, k, precision and W = 1, each in a fresh process, per model and k in this order:

* **siglip**: ``--siglip``, the sigmoid loss alone.
* **siglip2 before**: ``--siglip2`` at the flags' defaults, steps before ``--siglip2-selfsup-start``: the
  sigmoid loss and the LocCa decoder over the image tower's tokens (captioning only: generated pairs carry no
  boxes).
* **siglip2 after**: the same run at steps from the self-supervised start on (``Siglip2Runtime.begin_step``
  turns SILC and TIPS on at ``step >= start_step``; the step index is offset to start there, the rest of the
  run is the same): the decoder, SILC self-distillation (``--siglip2-local-views`` local views per image,
  each at the model's input size, through the student's image tower; the EMA teacher's forward on a global
  view) and TIPS masked prediction (a second student forward on the masked global view). Its first (untimed)
  step copies the student into the teacher.

A step is what the trainer does per optimizer step: ``RunStep.train`` (the cached step: every micro-batch's
no-grad forward, the loss, micro-batch 0's kept graph and k - 1 recomputed forwards with their backwards, the
optimizer) and ``RunStep.after_update`` (after a self-supervised step: the teacher's EMA and centers; else
nothing). Time: the median over --steps timed steps after --warmup untimed ones (data generated outside them),
wall and CPU time of the process, ``after_update`` also kept apart. Memory as in bench_accum.py (its
``MemoryMeter``): peak RSS of one more, untimed step, and its own growth over the RSS before it. Parameters:
those the optimizer trains (the model and, under --siglip2, the decoder, the two self-distillation heads and
the mask token) and the teacher's (an fp32 copy of the image tower and the two heads, held from the start: it
exists before the self-supervised start too).

FLOPs (what a step's time should follow where matrix products dominate): one training-mode forward per pair,
every term of the row included, counted by torch's FlopCounterMode (matrix products and convolutions).
``--count-flops MODEL``: the same count on a model too large to time here (``ViT-B-16-SigLIP2``, random
weights), to tell what the timed model's ratios stand for.

``--phases``: one more step under torch.profiler, split by the cached step's own ranges
(``ds_clip.step.embed``, ``.loss``, ``.push_back``, ``.optimizer``) and ``after_update`` (the teacher's EMA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.* must import
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_accum import MemoryMeter, _write_json, bench_config_dir, machine_info  # noqa: E402

MODEL = "ds-clip-tiny-siglip"
CONFIGS = ("siglip", "siglip2 before", "siglip2 after")
BENCH_MODEL = "sigmoid-bench-w256"
"""A SigLIP model (a logit_bias; the name without "siglip", so the CLIP tokenizer is built, not fetched)
whose forward FLOPs per pair under each row stand to the plain row's as ViT-B-16-SigLIP2's do (1.8x before the
start, 9.4x after, against B/16's 1.7x and 9.4x: --count-flops): ds-clip-tiny-siglip's 2-layer towers of width
128 over 16 patches make the decoder's 49408-way output layer and the heads' 65536 prototypes 11x and 25x its
forward."""
SIGMOID_BENCH_W256 = {
    "embed_dim": 256,
    "init_logit_bias": -10,
    "vision_cfg": {"image_size": 64, "layers": 8, "width": 256, "patch_size": 8, "head_width": 64},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 256, "heads": 4, "layers": 8},
}


def register_model() -> None:
    """Write sigmoid-bench-w256 into bench_accum's config folder and register it with open_clip (in every
    process: the rows' processes are spawned)."""
    import open_clip

    root = bench_config_dir()
    _write_json(root / f"{BENCH_MODEL}.json", SIGMOID_BENCH_W256)
    open_clip.add_model_config(root)


def flags_of(config: str, *, model: str, m: int, k: int, precision: str, extra: list[str]) -> list[str]:
    """ds-clip-train's flags for one configuration (``extra``: more --siglip2-* flags, e.g. smaller heads)."""
    argv = ["--model", model, "--batch-size", str(m), "--accum-freq", str(k), "--precision", precision]
    return argv + (["--siglip"] if config == "siglip" else ["--siglip2", *extra])


def _entry(payload: dict) -> dict[str, Any]:
    """Rank 0 of a one-process group: one configuration's step, warm-up, timed steps, one memory step, and
    optionally one profiled step."""
    import torch
    from torch.profiler import record_function

    from ds_clip.config import parse_settings
    from ds_clip.training.wiring import build_run_step
    from ds_clip_harness.runs import generated_pairs

    torch.set_num_threads(payload["threads"])
    register_model()
    m, k, config = payload["m"], payload["k"], payload["config"]
    run = build_run_step(parse_settings(payload["argv"]), world_size=1, rank=0, total_steps=10**6)
    run.engine.train()
    rt = run.built.siglip2
    # "after": the step index starts at the self-supervised start (begin_step turns SILC and TIPS on there).
    first = rt.start_step if config == "siglip2 after" else 0
    cfg = run.bundle.model_cfg
    size = cfg["vision_cfg"]["image_size"]
    size = size if isinstance(size, int) else size[0]
    text = cfg["text_cfg"]

    def batches(i: int) -> list:
        return [
            generated_pairs(
                range((i * k + j) * m, (i * k + j + 1) * m), image_size=size,
                context_length=text.get("context_length", 77), vocab_size=text.get("vocab_size", 49408),
                varied_lengths=True,
            )
            for j in range(k)
        ]  # fmt: skip

    def one_step(i: int, data: list) -> tuple[Any, float]:
        """What the trainer runs per optimizer step; returns its result and ``after_update``'s seconds."""
        result = run.train(data, step=first + i)
        t = time.perf_counter()
        if not result.skipped:
            with record_function("after_update"):  # a range of its own for --phases
                run.after_update(first + i + 1)
        return result, time.perf_counter() - t

    meter = MemoryMeter(payload["device"])
    warmup, steps = payload["warmup"], payload["steps"]
    times, cpu_times, after_times, parts = [], [], [], {}
    for i in range(warmup + steps):
        data = batches(i)  # generated outside the timed region
        t, c = time.perf_counter(), time.process_time()
        result, after_s = one_step(i, data)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            # CPU time of this process (every thread): on a shared machine wall time also holds the time the
            # process waited for a core; CPU time does not.
            cpu_times.append(time.process_time() - c)
            after_times.append(after_s)
        parts = {name: float(v) for name, v in (result.parts or {}).items()}
    data = batches(warmup + steps)
    base = meter.start()
    result, _ = one_step(warmup + steps, data)
    peak = meter.peak()
    if payload["phases"]:
        data = batches(warmup + steps + 1)
        phases = _phases(lambda: one_step(warmup + steps + 1, data))
    else:
        phases = {}
    flops = _forward_flops(run.engine.module, batches(0)[0])
    model = run.bundle.model
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    added = sum(p.numel() for p in model.siglip2.parameters()) if rt is not None else 0
    teacher = sum(p.numel() for p in rt.teacher.net.parameters()) if rt is not None else 0
    stage = run.engine.zero_optimization_stage()
    run.engine.destroy()
    return {
        "step_s": times, "cpu_s": cpu_times, "after_update_s": after_times, "peak_mib": peak,
        "base_mib": base,
        "loss": float(result.loss), "parts": parts, "selfsup": bool(rt is not None and rt.selfsup),
        "first_step": first, "params": trained, "siglip2_params": added, "teacher_params": teacher,
        "zero_stage": int(stage), "phases_s": phases, "flops": flops,
    }  # fmt: skip


def _phases(step) -> dict[str, float]:
    """Seconds of one step in each of the cached step's named ranges and in ``after_update``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            step()
    out = {}
    for event in prof.key_averages():
        if event.key.startswith("ds_clip.step.") or event.key in ("after_update", "step"):
            out[event.key.removeprefix("ds_clip.step.")] = event.cpu_time_total / 1e6
    return out


def _forward_flops(model, pairs) -> float:
    """FLOPs per pair of one training-mode forward (the objective's terms included: after the start, the
    views, the teacher and the heads too) in matrix products and convolutions (torch's FlopCounterMode),
    without a graph (the counter's backward hooks do not run under the step's autograd.grad)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    image, text = pairs
    with torch.no_grad(), torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
        model(image=image.to(model.logit_scale.device), text=text.to(model.logit_scale.device))
    return counter.get_total_flops() / image.shape[0]


def _count_entry(payload: dict) -> dict[str, float]:
    """Forward FLOPs per pair of each configuration on ``payload["model"]``, counted, not timed: open_clip's
    model from its config (random weights: nothing is downloaded, no tokenizer is built) with SigLIP 2's parts
    attached as ds-clip-train attaches them, no engine."""
    import open_clip
    import torch

    import ds_clip.models.model  # noqa: F401  (registers the built-in ds-clip-* configs)
    from ds_clip.config import parse_settings
    from ds_clip.siglip2.objective import attach

    torch.set_num_threads(payload["threads"])
    register_model()
    name, cfg = payload["model"], open_clip.get_model_config(payload["model"])
    size = cfg["vision_cfg"]["image_size"]
    size = size if isinstance(size, int) else size[0]
    text = cfg["text_cfg"]
    length, vocab = text.get("context_length", 77), text.get("vocab_size", 49408)
    m = payload["m"]
    image = torch.randn(m, 3, size, size)
    tokens = torch.randint(1, vocab - 1, (m, length))
    tokens[:, length // 2 :] = 0
    out = {}
    for config in payload["configs"]:
        argv = flags_of(config, model=name, m=m, k=1, precision="fp32", extra=payload["extra"])
        loss = parse_settings(argv).loss
        torch.manual_seed(0)
        model = open_clip.create_model(name, output_dict=True)
        if loss.siglip2:
            rt = attach(model, cfg, loss, seed=0)
            # The forward reads it; the teacher's weights do not change the count.
            rt.selfsup = config == "siglip2 after"
        # Frozen: the counter hooks every module's inputs, and a parameter passed in as one (timm's attention
        # pool's latent) is a leaf it cannot hook.
        model.train().requires_grad_(False)
        out[config] = _forward_flops(model, (image, tokens))
        del model
    return out


def measure(model: str, config: str, a: argparse.Namespace, k: int) -> dict[str, Any]:
    from ds_clip_harness.groups import spawn_group

    argv = flags_of(config, model=model, m=a.batch_size, k=k, precision=a.precision, extra=a.siglip2_flags)
    payload = dict(
        config=config, argv=argv, m=a.batch_size, k=k, steps=a.steps, warmup=a.warmup, device=a.device,
        threads=a.threads, phases=a.phases,
    )  # fmt: skip
    load = list(os.getloadavg())  # each row's own: a shared machine's load drifts over a run of minutes
    rec = spawn_group(1, _entry, payload)
    return {"model": model, "config": config, "k": k, "m": a.batch_size, "argv": argv, "loadavg": load, **rec}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    plain = {(r["model"], r["k"]): r for r in runs if r["config"] == "siglip"}
    out = []
    for r in runs:
        step = statistics.median(r["step_s"])
        base = plain.get((r["model"], r["k"]))
        cpu = statistics.median(r["cpu_s"])
        out.append(
            {
                "model": r["model"], "config": r["config"], "k": r["k"], "N": r["k"] * r["m"], "step_s": step,
                "vs_siglip": step / statistics.median(base["step_s"]) if base else None,
                "cpu_s": cpu, "cpu_vs_siglip": cpu / statistics.median(base["cpu_s"]) if base else None,
                "after_update_s": statistics.median(r["after_update_s"]), "peak_mib": r["peak_mib"],
                "transient_mib": r["peak_mib"] - r["base_mib"], "params_m": r["params"] / 1e6,
                "siglip2_params_m": r["siglip2_params"] / 1e6, "teacher_params_m": r["teacher_params"] / 1e6,
                "forward_gflop_per_pair": r["flops"] / 1e9,
                "flops_vs_siglip": r["flops"] / base["flops"] if base else None, "phases_s": r["phases_s"],
            }
        )  # fmt: skip
    return out


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def markdown(summary: list[dict[str, Any]], counted: dict[str, dict[str, float]] | None = None) -> str:
    lines = [
        "| model | k | N | step | s/step (CPU s) | × --siglip (CPU) | of it: teacher EMA s | "
        "peak (step's own) MiB | trained params M (added) | teacher params M | "
        "forward GFLOP/pair (× --siglip) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['model']} | {r['k']} | {r['N']} | {r['config']} | {r['step_s']:.3f} ({r['cpu_s']:.3f}) | "
            f"{_ratio(r['vs_siglip'])} ({_ratio(r['cpu_vs_siglip'])}) | {r['after_update_s']:.3f} | "
            f"{r['peak_mib']:.0f} ({r['transient_mib']:.0f}) | "
            f"{r['params_m']:.1f} (+{r['siglip2_params_m']:.1f}) | {r['teacher_params_m']:.1f} | "
            f"{r['forward_gflop_per_pair']:.3f} ({_ratio(r['flops_vs_siglip'])}) |"
        )
    phased = [r for r in summary if r["phases_s"]]
    if phased:
        names = ["embed", "loss", "push_back", "optimizer", "after_update", "step"]
        lines += ["", "| model | k | step | " + " | ".join(names) + " (all, s) |"]
        lines.append("|---|---|---|" + "---|" * len(names))
        for r in phased:
            cells = " | ".join(f"{r['phases_s'].get(n, 0.0):.3f}" for n in names)
            lines.append(f"| {r['model']} | {r['k']} | {r['config']} | {cells} |")
    if counted:
        lines += [
            "",
            "| model (counted, not timed) | step | forward GFLOP/pair | × --siglip |",
            "|---|---|---|---|",
        ]
        for model, flops in counted.items():
            base = flops.get("siglip")
            for config, f in flops.items():
                lines.append(f"| {model} | {config} | {f / 1e9:.2f} | {_ratio(f / base if base else None)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/bench_siglip2.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--models", nargs="+", default=[MODEL], metavar="MODEL",
        help=f"SigLIP models (a logit_bias, a ViT image tower): {MODEL}, {BENCH_MODEL} (this file's), ...",
    )  # fmt: skip
    p.add_argument("--k", type=int, nargs="+", default=[1, 4], help="accumulation steps to measure")
    p.add_argument("--batch-size", type=int, default=8, help="m, pairs per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS, help="which rows")
    p.add_argument("--phases", action="store_true", help="then one profiled step per row: seconds per phase")
    p.add_argument(
        "--siglip2-flag", dest="siglip2_flags", action="append", default=[], metavar="FLAG",
        help="one more ds-clip-train flag for the --siglip2 rows (repeatable): "
        "--siglip2-flag=--siglip2-local-views=2",
    )  # fmt: skip
    p.add_argument(
        "--count-flops", nargs="+", default=[], metavar="MODEL",
        help="then count (not time) each row's forward FLOPs per pair on these models, e.g. ViT-B-16-SigLIP2",
    )  # fmt: skip
    p.add_argument("--json", type=Path, help="write the measurements and the machine here")
    a = p.parse_args(argv)
    for flag, values in (("--k", a.k), ("--batch-size", [a.batch_size]), ("--steps", [a.steps]),
                         ("--threads", [a.threads])):  # fmt: skip
        if min(values) < 1:
            p.error(f"{flag} must be >= 1")
    if a.warmup < 1 and "siglip2 after" in a.configs:
        p.error("--warmup must be >= 1: the first step after the start copies the student into the teacher")
    import open_clip

    register_model()
    for flag, names in (("--models", a.models), ("--count-flops", a.count_flops)):
        unknown = [n for n in names if open_clip.get_model_config(n) is None]
        if unknown:
            p.error(f"{flag}: unknown model {unknown[0]!r} (e.g. {MODEL}, {BENCH_MODEL}, ViT-B-16-SigLIP2)")
    if a.json is not None and not a.json.parent.is_dir():
        p.error(f"--json: folder {a.json.parent} does not exist")
    machine = machine_info(a.device)
    t0 = time.perf_counter()
    runs = []
    for model in a.models:
        for k in a.k:
            for config in a.configs:  # each a fresh process
                runs.append(measure(model, config, a, k))
                print(f"{model} {config} k={k}: {[round(t, 3) for t in runs[-1]['step_s']]} s", flush=True)
    machine["loadavg_after"] = list(os.getloadavg())
    machine["wall_s"] = round(time.perf_counter() - t0, 1)
    counted = {}
    from ds_clip_harness.groups import spawn_group

    for model in a.count_flops:  # after the timed runs, which it does not load (one process, no engine)
        payload = dict(model=model, m=2, configs=a.configs, extra=a.siglip2_flags, threads=a.threads)
        counted[model] = spawn_group(1, _count_entry, payload)
    summary = summarise(runs)
    table = markdown(summary, counted)
    print(table)
    load = f"load {machine['loadavg']} -> {machine['loadavg_after']}"
    print(f"\n{machine['date']} | {load} | {machine['wall_s']} s")
    if a.json:
        given = argv if argv is not None else sys.argv[1:]
        report = {
            "command": "python benchmarks/bench_siglip2.py " + " ".join(given),
            "machine": machine, "summary": summary, "counted_flops": counted, "table": table, "runs": runs,
        }  # fmt: skip
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

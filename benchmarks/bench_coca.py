"""CoCa under --accum-freq: peak memory and time per optimizer step, ds-clip-train next to open_clip_train.

Run from the repository root with ds_clip installed (scripts/setup.sh) and the `bench` extra (open_clip_train
imports pandas). The run behind docs/benchmarks.md ("CoCa"; a few minutes on 2 CPU cores):

    python benchmarks/bench_coca.py --k 1 4 8 --json benchmarks/results/raw/coca_cpu.json

Both sides train the same small CoCa (``coca-bench-small`` below: 2-layer towers and decoder of width 128 over
open_clip's 49408-token vocabulary, 64 px images, 32-token captions) at the same m, k and precision, W = 1,
each k in a fresh process, alternating ours and open_clip's:

* ds_clip: the engine and the CoCa objective ``ds-clip-train`` builds from its defaults
  (``ds_clip.training.engine.build_engine`` with ``--model coca-bench-small --batch-size m --accum-freq k``), one
  ``cached_step`` per optimizer step on generated pairs with captions of different lengths.
* open_clip: its own trainer, ``open_clip_train --dataset-type synthetic --accum-freq k`` (it picks
  ``CoCaLoss`` because the model name contains "coca"), through ``benchmarks/bench_accum.py``'s
  ``run_open_clip`` (its loader drained before the loop, each ``optimizer.step`` timed).

Memory and time are measured as in bench_accum.py (its ``MemoryMeter``: peak RSS of one untimed step after
the timed ones, with the RSS before it as "base"; wall time per step after warm-up steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.* must import
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_accum import (  # noqa: E402
    BenchSettings,
    Measurement,
    MemoryMeter,
    _write_json,
    bench_config_dir,
    machine_info,
    run_open_clip,
)

MODEL = "coca-bench-small"
COCA_BENCH_SMALL = {
    "embed_dim": 128,
    "custom_text": True,
    "vision_cfg": {
        "image_size": 64,
        "layers": 2,
        "width": 128,
        "patch_size": 8,
        "head_width": 64,
        "attentional_pool": True,
        "attn_pooler_heads": 4,
        "attn_pooler_queries": 16,
        "output_tokens": True,
    },
    "text_cfg": {
        "context_length": 32,
        "vocab_size": 49408,
        "width": 128,
        "heads": 4,
        "layers": 2,
        "embed_cls": True,
        "output_tokens": True,
    },
    "multimodal_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 2},
}


def register_model() -> None:
    """Write coca-bench-small into bench_accum's config folder (open_clip_train's child process registers
    that folder too, so both sides build it by name)."""
    root = bench_config_dir()
    _write_json(root / f"{MODEL}.json", COCA_BENCH_SMALL)
    import open_clip

    open_clip.add_model_config(root)


def _ours_entry(payload: dict) -> dict[str, Any]:
    """Rank 0 of a one-process group: ds-clip-train's engine and CoCa objective, timed steps, one memory step."""
    import torch

    from ds_clip.config import parse_settings
    from ds_clip.training.wiring import build_run_step
    from ds_clip_harness.runs import generated_pairs

    torch.set_num_threads(payload["threads"])
    register_model()
    m, k = payload["m"], payload["k"]
    argv = [
        "--model",
        MODEL,
        "--batch-size",
        str(m),
        "--accum-freq",
        str(k),
        "--precision",
        payload["precision"],
    ]
    trained = build_run_step(parse_settings(argv), world_size=1, rank=0, total_steps=10**6)
    engine, bundle = trained.engine, trained.bundle
    engine.train()
    text = COCA_BENCH_SMALL["text_cfg"]
    size = COCA_BENCH_SMALL["vision_cfg"]["image_size"]

    def batches(step: int) -> list:
        return [
            generated_pairs(
                range((step * k + j) * m, (step * k + j + 1) * m),
                image_size=size,
                context_length=text["context_length"],
                vocab_size=text["vocab_size"],
                varied_lengths=True,
            )
            for j in range(k)
        ]

    meter = MemoryMeter(payload["device"])
    times, losses = [], []
    warmup, steps = payload["warmup"], payload["steps"]
    for step in range(warmup + steps + 1):
        data = batches(step)
        if step == warmup + steps:
            base = meter.start()
        t = time.perf_counter()
        result = trained.train(data, step=step)  # with the caption term, as ds-clip-train trains CoCa
        losses.append(float(result.loss))
        if warmup <= step < warmup + steps:
            times.append(time.perf_counter() - t)
    peak = meter.peak()
    params_m = sum(p.numel() for p in bundle.model.parameters()) / 1e6
    engine.destroy()
    return {"step_s": times, "peak_mib": peak, "base_mib": base, "loss": losses[-1], "params_m": params_m,
            "zero_stage": engine.zero_optimization_stage()}  # fmt: skip


def run_ours(settings: BenchSettings, k: int) -> list[Measurement]:
    from ds_clip_harness.groups import spawn_group

    payload = dict(
        m=settings.micro_batch_size, k=k, steps=settings.steps, warmup=settings.warmup,
        precision=settings.precision, device=settings.device, threads=settings.threads,
    )  # fmt: skip
    rec = spawn_group(1, _ours_entry, payload)
    return [
        Measurement(
            impl="ds_clip",
            mode="cached",
            model=MODEL,
            params_m=rec["params_m"],
            image_size=COCA_BENCH_SMALL["vision_cfg"]["image_size"],
            world_size=1,
            zero_stage=rec["zero_stage"],
            grad_checkpointing=False,
            precision=settings.precision,
            device=settings.device,
            micro_batch_size=settings.micro_batch_size,
            accum_freq=k,
            rep=i,
            step_s=t,
            optimizer_s=None,
            peak_mib=rec["peak_mib"],
            base_mib=rec["base_mib"],
            loss=rec["loss"],
        )  # fmt: skip
        for i, t in enumerate(rec["step_s"])
    ]


def summarise(rows: list[Measurement]) -> list[dict[str, Any]]:
    out = []
    for impl in ("ds_clip", "open_clip"):
        for k in sorted({r.accum_freq for r in rows}):
            mine = [r for r in rows if r.impl == impl and r.accum_freq == k]
            if not mine:
                continue
            step = statistics.median(r.step_s for r in mine)
            out.append(
                {
                    "impl": impl, "k": k, "m": mine[0].micro_batch_size, "samples": k * mine[0].micro_batch_size,
                    "step_s": step, "ms_per_sample": 1e3 * step / (k * mine[0].micro_batch_size),
                    "peak_mib": mine[0].peak_mib, "transient_mib": mine[0].peak_mib - mine[0].base_mib,
                }
            )  # fmt: skip
    return out


def markdown(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| k | N = k·m | ds_clip s/step | open_clip s/step | ds_clip ms/pair | open_clip ms/pair | "
        "ds_clip peak (step's own) MiB | open_clip peak (step's own) MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["impl"], r["k"]): r for r in summary}
    for k in sorted({r["k"] for r in summary}):
        a, b = by.get(("ds_clip", k)), by.get(("open_clip", k))

        def cell(r, key, fmt):
            return format(r[key], fmt) if r else "—"

        def mem(r):
            return f"{r['peak_mib']:.0f} ({r['transient_mib']:.0f})" if r else "—"

        lines.append(
            f"| {k} | {(a or b)['samples']} | {cell(a, 'step_s', '.2f')} | {cell(b, 'step_s', '.2f')} | "
            f"{cell(a, 'ms_per_sample', '.1f')} | {cell(b, 'ms_per_sample', '.1f')} | {mem(a)} | {mem(b)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_coca.py", description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, nargs="+", default=[1, 4, 8], help="accumulation steps to measure")
    p.add_argument("--batch-size", type=int, default=8, help="m, pairs per micro-batch")
    p.add_argument("--steps", type=int, default=2, help="timed steps per k and side")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-open-clip", action="store_true", help="ds_clip only")
    p.add_argument("--json", type=Path, help="write the measurements and the machine here")
    a = p.parse_args(argv)
    settings = BenchSettings(
        models=[MODEL], micro_batch_size=a.batch_size, steps=a.steps, warmup=a.warmup, precision=a.precision,
        device=a.device, threads=a.threads,
    )  # fmt: skip
    register_model()
    machine = machine_info(a.device)
    rows: list[Measurement] = []
    for k in a.k:  # alternating: ours, then open_clip's, per k (each a fresh process)
        rows += run_ours(settings, k)
        print(f"ds_clip k={k}: {[round(r.step_s, 3) for r in rows[-a.steps :]]} s", flush=True)
        if not a.no_open_clip:
            rows += run_open_clip(settings, MODEL, k, False, 0)
            print(f"open_clip k={k}: {[round(r.step_s, 3) for r in rows[-a.steps :]]} s", flush=True)
    machine["loadavg_after"] = list(__import__("os").getloadavg())
    summary = summarise(rows)
    table = markdown(summary)
    print(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": "python benchmarks/bench_coca.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine, "model_cfg": COCA_BENCH_SMALL, "summary": summary, "table": table,
            "measurements": [asdict(r) for r in rows],
        }  # fmt: skip
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

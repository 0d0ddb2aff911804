"""What only a GPU shows about where ds_clip wins (gpu_check.sh parts "mfu" and "largest"):

    python scripts/gpu_check_capacity.py mfu --out-dir DIR       # DIR/mfu.json: ViT-B-16, bf16, k = 8, largest m
    python scripts/gpu_check_capacity.py largest --out-dir DIR   # DIR/largest.json: ViT-B-16, tiled loss

Both build the engine and step ds-clip-train builds (ds_clip.config.parse_settings with the user's defaults
and the flags named below -> ds_clip.training.wiring.build_run_step) in one process (a world of one), and
train with its step (ds_clip.step.cached_step, then the logit-scale clamp) on pairs held in pinned host
memory (the data offload: only the micro-batch being embedded is on the device). Every timed step is wall
time between two CUDA synchronisations.

* mfu: ``--precision bf16 --accum-freq 8``. m doubles from ``--m-start`` while a step fits in device
  memory (an out-of-memory error ends the search) and ``--m-max`` is not passed;
  every m that fits trains one warm step and ``--steps`` timed ones, and the figures are those of the
  largest m that fitted (nothing trains after an out-of-memory error; the k micro-batches cycle through 2
  distinct pinned host micro-batches, which leaves the FLOPs as they are). The
  FLOPs per step come from the model's shapes (benchmarks/flops.py): ``cached_step_flops`` counts the
  forward, the recomputed forward and the backward, (4k-1)·m pair forwards, plus the loss; divided by
  the median step time and by ``--peak-tflops`` (989: the H200's dense bf16). ``model_flops`` (3k·m
  pair forwards: no recompute) gives the usual MFU beside it.
* largest: ``--precision bf16 --loss-impl tiled``, m = ``--batch-size``; k doubles from ``--k-start``.
  Each N = k·m trains one step; the search stops at the first step that fails (out of memory or any
  error, reported) or when the next step, estimated at twice the last one's time, would end after
  ``--budget-s`` seconds from the script's start. The answer is the largest N whose step completed.
  To keep host memory flat in k, the k micro-batches cycle through ``--distinct`` pinned host
  micro-batches (every step still embeds all N pairs and computes the N x N loss in tiles).

``--allow-cpu`` runs on the CPU (for CI: tests/test_bench.py runs ``mfu largest`` in one process on a tiny
model: the search logic, the FLOP arithmetic and the JSON, not the figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.* must import
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.flops import cached_step_flops, model_flops, pair_forward_flops  # noqa: E402

H200_DENSE_BF16_TFLOPS = 989.0
MFU_DISTINCT = 2
"""mfu: distinct host micro-batches the k of a step cycle through (what the data holds does not change
the FLOPs; 8 distinct ones of m = 4096 at 224 px would take 10 GB of pinned host memory)."""


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class Bench:
    """One engine (ds-clip-train's builder) and pinned host micro-batches for it."""

    def __init__(self, argv: list[str]) -> None:
        from ds_clip.config import parse_settings
        from ds_clip.distributed import device, init_distributed
        from ds_clip.step.cached import input_dtype
        from ds_clip.training.wiring import build_run_step

        self.settings = s = parse_settings(argv)
        info = init_distributed()
        self.run = build_run_step(s, world_size=info.world_size, rank=info.rank, total_steps=10**6)
        self.bundle, self.engine, self.ds_json = self.run.bundle, self.run.engine, self.run.built.ds_config
        self.engine.train()
        self.device = device()
        self.dtype = input_dtype(self.engine)
        cfg = self.bundle.model_cfg
        size = cfg["vision_cfg"]["image_size"]
        self.image_px = size if isinstance(size, int) else size[0]
        self.context = cfg["text_cfg"].get("context_length", 77)
        self.vocab = cfg["text_cfg"].get("vocab_size", 49408)
        self.pool: list[tuple[torch.Tensor, torch.Tensor]] = []

    def make_pool(self, m: int, distinct: int) -> None:
        """``distinct`` micro-batches of m pairs in (pinned, on a GPU) host memory."""
        self.pool = []
        gc.collect()
        g = torch.Generator().manual_seed(0)
        pin = self.device.type == "cuda"
        for _ in range(distinct):
            images = torch.randn(m, 3, self.image_px, self.image_px, generator=g).to(self.dtype)
            texts = torch.randint(1, self.vocab, (m, self.context), generator=g)
            self.pool.append((images.pin_memory(), texts.pin_memory()) if pin else (images, texts))

    def step(self, k: int) -> float:
        """One optimizer step on k micro-batches (cycling through the pool); its wall time in seconds."""
        micro_batches = [self.pool[j % len(self.pool)] for j in range(k)]
        _sync(self.device)
        t0 = time.perf_counter()
        self.run.train(micro_batches)  # ds-clip-train's step: the cached step, then the logit-scale clamp
        _sync(self.device)
        return time.perf_counter() - t0

    def peak_mib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None


def _base_argv(a: argparse.Namespace) -> list[str]:
    argv = ["--model", a.model, "--precision", a.precision, "--workers", "0"]
    return argv + (["--force-image-size", str(a.image_size)] if a.image_size else [])


def run_mfu(a: argparse.Namespace) -> dict[str, Any]:
    b = Bench([*_base_argv(a), "--batch-size", str(a.m_start), "--accum-freq", str(a.k)])
    tried: list[dict[str, Any]] = []
    best, times, peak_mib = None, [], None
    m = a.m_start
    while a.m_max is None or m <= a.m_max:
        # Each m: one warm step, then the timed ones, so the figures come from the largest m that fitted
        # without training on after an out-of-memory error (the engine is not trusted after one).
        oom = False
        try:
            b.make_pool(m, MFU_DISTINCT)
            warm = b.step(a.k)
            if b.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(b.device)
            timed = [b.step(a.k) for _ in range(a.steps)]
        except Exception as exc:  # noqa: BLE001 - out of memory ends the search; anything else is raised
            if not _is_oom(exc):
                raise
            oom = True
        if oom:
            tried.append({"m": m, "ok": False, "error": "out of memory"})
            break
        tried.append(
            {"m": m, "ok": True, "warm_s": round(warm, 4), "median_s": round(statistics.median(timed), 4)}
        )
        best, times, peak_mib = m, timed, b.peak_mib()
        m *= 2
    if best is None:
        raise SystemExit(f"gpu_check_capacity: no m from {a.m_start} fits (k = {a.k})")
    t = statistics.median(times)
    cfg = b.bundle.model_cfg
    executed, useful = cached_step_flops(cfg, best, a.k), model_flops(cfg, best, a.k)
    peak = a.peak_tflops * 1e12
    return {
        "what": "model FLOP utilisation of the cached step",
        "model": a.model, "precision": a.precision, "k": a.k, "m": best, "N": best * a.k,
        "device": str(b.device), "gpu": torch.cuda.get_device_name(b.device) if b.device.type == "cuda" else None,
        "zero_stage": b.ds_json.get("zero_optimization", {}).get("stage", 0),
        "search": tried, "step_seconds": [round(x, 4) for x in times], "median_step_s": round(t, 4),
        "pair_forward_gflops": pair_forward_flops(cfg) / 1e9,
        "step_tflops_executed": executed / 1e12, "step_tflops_model": useful / 1e12,
        "achieved_tflops_per_s": executed / t / 1e12,
        "peak_tflops_per_s": a.peak_tflops,
        "utilisation_executed": executed / t / peak,
        "utilisation_model": useful / t / peak,
        "peak_mem_mib": peak_mib,
    }  # fmt: skip


def run_largest(a: argparse.Namespace, t_start: float) -> dict[str, Any]:
    b = Bench(
        [
            *_base_argv(a),
            "--batch-size",
            str(a.batch_size),
            "--accum-freq",
            str(a.k_start),
            "--loss-impl",
            "tiled",
        ]
    )
    b.make_pool(a.batch_size, a.distinct)
    tried: list[dict[str, Any]] = []
    best, k, last_s = None, a.k_start, None
    stop = "k-max reached"
    while a.k_max is None or k <= a.k_max:
        elapsed = time.perf_counter() - t_start
        if last_s is not None and elapsed + 2 * last_s > a.budget_s:
            stop = f"the next step (about {2 * last_s:.0f} s) would end past the {a.budget_s:.0f} s budget"
            break
        try:
            if b.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(b.device)
            last_s = b.step(k)
        except Exception as exc:  # noqa: BLE001 - the first failing N ends the search, whatever failed
            tried.append(
                {"N": k * a.batch_size, "k": k, "ok": False, "error": str(exc).splitlines()[0][:300]}
            )
            stop = "out of memory" if _is_oom(exc) else "error"
            break
        tried.append(
            {
                "N": k * a.batch_size,
                "k": k,
                "ok": True,
                "seconds": round(last_s, 3),
                "peak_mem_mib": b.peak_mib(),
            }
        )
        best = k * a.batch_size
        k *= 2
    return {
        "what": "largest N one tiled-loss step with data offload trains",
        "model": a.model, "precision": a.precision, "m": a.batch_size, "largest_N": best,
        "stopped_because": stop, "budget_s": a.budget_s, "device": str(b.device),
        "seconds_total": round(time.perf_counter() - t_start, 1), "trials": tried,
        "distinct_host_micro_batches": a.distinct,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="+", choices=["mfu", "largest"], help="one or both, in this order")
    p.add_argument("--out-dir", type=Path, required=True, help="writes mfu.json / largest.json there")
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--image-size", type=int, default=None, help="--force-image-size (CPU smoke tests)")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--k", type=int, default=8, help="mfu: micro-batches per step")
    p.add_argument("--m-start", type=int, default=128, help="mfu: first m of the doubling search")
    p.add_argument("--m-max", type=int, default=None, help="mfu: largest m to try (default: until OOM)")
    p.add_argument("--steps", type=int, default=3, help="mfu: timed steps at each m (after a warm one)")
    p.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS)
    p.add_argument("--batch-size", type=int, default=512, help="largest: micro-batch m")
    p.add_argument("--k-start", type=int, default=8, help="largest: first k of the doubling")
    p.add_argument("--k-max", type=int, default=None, help="largest: largest k to try")
    p.add_argument("--budget-s", type=float, default=180.0, help="largest: seconds from start for the search")
    p.add_argument("--distinct", type=int, default=8, help="largest: distinct pinned host micro-batches")
    p.add_argument("--allow-cpu", action="store_true", help="also run without CUDA (a smoke test)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available() and not a.allow_cpu:
        sys.exit("gpu_check_capacity: no CUDA device (use --allow-cpu for a CPU smoke run)")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for what in a.what:
        result = run_mfu(a) if what == "mfu" else run_largest(a, t_start)
        (a.out_dir / f"{what}.json").write_text(json.dumps(result, indent=1))
        _say(what, a, result)
        if what == "largest" and result["largest_N"] is None:
            sys.exit(
                f"gpu_check_capacity: not even N = {a.k_start * a.batch_size} trained: {result['trials'][-1]}"
            )
        gc.collect()
    return 0


def _say(what: str, a: argparse.Namespace, result: dict[str, Any]) -> None:
    if what == "mfu":
        print(
            f"gpu_check_capacity: mfu {a.model} {a.precision} k={a.k} m={result['m']}: "
            f"{result['median_step_s']:.3f} s/step, {result['achieved_tflops_per_s']:.1f} TFLOP/s executed = "
            f"{100 * result['utilisation_executed']:.1f} % of {a.peak_tflops:.0f} "
            f"(model FLOPs, no recompute: {100 * result['utilisation_model']:.1f} %)",
            flush=True,
        )
    else:
        print(
            f"gpu_check_capacity: largest N {a.model} tiled loss, m={a.batch_size}: {result['largest_N']} "
            f"({result['stopped_because']}; {result['seconds_total']} s)",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())

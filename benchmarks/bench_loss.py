"""Dense (open_clip ClipLoss / SigLipLoss) vs tiled (ds_clip.step.tiled_loss) contrastive losses: time of one
forward+backward and peak memory, one process, d = 512.

Run from the repository root (about 10 minutes on 2 CPU cores; the time box then skips SigLIP at 64k,
add --time-budget-s 600 for it, about 16 minutes in all):

    PYTHONPATH=. python benchmarks/bench_loss.py --json bench_loss.json

Quick look:  PYTHONPATH=. python benchmarks/bench_loss.py --sizes 4096 16384 --losses clip

CPU: every case runs in a fresh subprocess; memory is its peak resident set size (ru_maxrss) and the
"extra" memory is that peak minus the RSS measured after the inputs were built and a small warm-up
ran, i.e. what the loss itself costs (logits, softmax, gradients of the features). CUDA (``--device
cuda``): in process, torch.cuda.max_memory_allocated minus the memory allocated before the loss.

Modes: ``clip/dense`` = ClipLoss()(I, T, s); ``clip/tiled`` = clip_loss_tiled(I, T, I, T, s) (rows are
the cols: the symmetric path); ``clip/tiled-local`` = rows and cols as distinct tensors (the general
path a --local-loss rank takes, here with R = N); ``siglip/dense`` = SigLipLoss()(I, T, s, b);
``siglip/tiled`` = siglip_loss_chunked(I, T, s, b) / N.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


@dataclass
class CaseResult:
    loss: str
    impl: str
    n: int
    dim: int
    tile: int
    device: str
    time_s: float | None = None
    peak_mib: float | None = None
    base_mib: float | None = None
    extra_mib: float | None = None
    skipped: str | None = None


def _build(loss: str, impl: str, n: int, dim: int, tile: int, device: str, clip_scale: float):
    """Inputs (unit-norm features like a CLIP model's) and a closure computing the loss."""
    import torch
    import torch.nn.functional as F
    from open_clip.loss import ClipLoss, SigLipLoss

    from ds_clip.step.tiled_loss import clip_loss_tiled, siglip_loss_chunked

    gen = torch.Generator(device=device).manual_seed(0)
    image = F.normalize(torch.randn(n, dim, generator=gen, device=device), dim=1).requires_grad_()
    text = F.normalize(torch.randn(n, dim, generator=gen, device=device), dim=1).requires_grad_()
    # CLIP: a trained model's scale (open_clip clamps at 100; the default here); SigLIP: its init.
    scale = torch.tensor(clip_scale if loss == "clip" else 10.0, device=device, requires_grad=True)
    bias = torch.tensor(-10.0, device=device, requires_grad=True)
    table = {
        ("clip", "dense"): lambda: ClipLoss()(image, text, scale),
        ("clip", "tiled"): lambda: clip_loss_tiled(image, text, image, text, scale, tile_size=tile),
        ("clip", "tiled-local"): lambda: clip_loss_tiled(
            image.view_as(image), text.view_as(text), image, text, scale, tile_size=tile
        ),
        ("siglip", "dense"): lambda: SigLipLoss()(image, text, scale, bias),
        ("siglip", "tiled"): lambda: siglip_loss_chunked(image, text, scale, bias, tile_size=tile) / n,
    }
    if (loss, impl) not in table:
        raise SystemExit(f"unknown --loss/--impl pair {loss}/{impl}; choose from {sorted(table)}")
    return table[(loss, impl)]


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_worker(args: argparse.Namespace) -> None:
    """One case in this (fresh) process; prints a JSON CaseResult on the last line."""
    import torch

    torch.set_num_threads(args.threads)
    result = CaseResult(args.loss, args.impl, args.n, args.dim, args.tile, args.device)
    cuda = args.device == "cuda"
    # Warm-up on a small batch: thread pools, lazy initialisation, allocator arenas.
    _build(
        args.loss, args.impl, 1024, args.dim, min(args.tile, 512), args.device, args.clip_scale
    )().backward()
    fn = _build(args.loss, args.impl, args.n, args.dim, args.tile, args.device, args.clip_scale)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / MIB
    else:
        base = _max_rss_mib()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        fn().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / MIB if cuda else _max_rss_mib()
    result.time_s, result.peak_mib, result.base_mib, result.extra_mib = min(times), peak, base, peak - base
    print(json.dumps(asdict(result)))


def _mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def _dense_estimate_mib(n: int) -> float:
    # open_clip keeps about five N x N fp32 matrices alive at the peak (two logits, their
    # log-softmax, a gradient); a guard against starting a case that cannot fit, not a measurement.
    return 5 * n * n * 4 / MIB


def run_case(args: argparse.Namespace, loss: str, impl: str, n: int) -> CaseResult:
    if args.device == "cuda":
        argv_device = ["--device", "cuda"]
    else:
        argv_device = ["--device", "cpu"]
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--loss",
        loss,
        "--impl",
        impl,
        "--n",
        str(n),
        "--dim",
        str(args.dim),
        "--tile",
        str(args.tile),
        "--threads",
        str(args.threads),
        "--repeats",
        str(1 if n > 8192 else args.repeats),
        "--clip-scale",
        str(args.clip_scale),
        *argv_device,
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        reason = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return CaseResult(loss, impl, n, args.dim, args.tile, args.device, skipped=f"failed: {reason[0]}")
    return CaseResult(**json.loads(proc.stdout.strip().splitlines()[-1]))


def machine_info() -> dict[str, str]:
    import torch

    model = platform.processor() or "unknown"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line)
    except (OSError, StopIteration):
        pass
    ram_gib = "unknown"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            ram_gib = f"{int(line.split()[1]) / 1024**2:.1f} GiB"
    info = {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "ram": ram_gib,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def fit_budget(results: list[CaseResult], budget_mib: float) -> dict[str, dict[str, float | str]]:
    """Largest N whose extra memory fits the budget, per loss/impl, from the measured points:
    dense: extra = a * N^2 with a from the largest measured N (the N^2 term dominates there);
    tiled: least-squares line extra = c + b * N through all measured N (blocks are a constant,
    features, gradients and LSE vectors are linear)."""
    out: dict[str, dict[str, float | str]] = {}
    groups: dict[str, list[CaseResult]] = {}
    for r in results:
        if r.extra_mib is not None:
            groups.setdefault(f"{r.loss}/{r.impl}", []).append(r)
    for key, rs in groups.items():
        rs.sort(key=lambda r: r.n)
        if key.endswith("/dense"):
            a = rs[-1].extra_mib / rs[-1].n ** 2
            out[key] = {
                "model": f"{a * 1e6:.3f} MiB per (1000 N)^2",
                "max_n": math.floor(math.sqrt(budget_mib / a)),
            }
        elif len(rs) >= 2:
            xs, ys = [float(r.n) for r in rs], [float(r.extra_mib) for r in rs]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            c = my - b * mx
            out[key] = {
                "model": f"{c:.0f} MiB + {b * 1024:.3f} MiB per 1024 N",
                "max_n": math.floor((budget_mib - c) / b),
            }
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(results: list[CaseResult]) -> None:
    print("| loss | impl | N | time fwd+bwd (s) | peak (MiB) | extra (MiB) | note |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in results:
        print(
            f"| {r.loss} | {r.impl} | {r.n} | {_fmt(r.time_s, '.2f')} | {_fmt(r.peak_mib, '.0f')} "
            f"| {_fmt(r.extra_mib, '.0f')} | {r.skipped or ''} |"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536], help="batch sizes N")
    p.add_argument("--losses", nargs="+", default=["clip", "siglip"], choices=["clip", "siglip"])
    p.add_argument("--dim", type=int, default=512, help="embedding dimension d")
    p.add_argument("--tile", type=int, default=4096, help="tile_size of the tiled losses")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every case")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case for N <= 8192 (min is kept)")
    p.add_argument("--clip-scale", type=float, default=100.0, help="exp(logit_scale) for CLIP")
    p.add_argument("--dense-max-n", type=int, default=16384, help="largest N for the dense losses")
    p.add_argument("--local-max-n", type=int, default=16384, help="largest N for clip/tiled-local")
    p.add_argument("--budget-gib", type=float, default=4.0, help="memory budget for the max-N estimate")
    p.add_argument(
        "--time-budget-s", type=float, default=420.0, help="start no new case after this many seconds"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write raw results to OUT")
    # Internal: one case in a fresh process.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--loss", default="clip", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="tiled", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=4096, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag in ("dim", "tile", "threads", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1")
    if any(n < 1 for n in args.sizes):
        p.error("--sizes must all be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        run_worker(args)
        return
    if args.json is not None and not args.json.parent.is_dir():
        raise SystemExit(f"--json: folder {args.json.parent} does not exist")

    started = time.perf_counter()
    results: list[CaseResult] = []
    for n in sorted(args.sizes):
        for loss in args.losses:
            impls = ["dense", "tiled"] + (["tiled-local"] if loss == "clip" else [])
            for impl in impls:
                skip = None
                if impl == "dense" and n > args.dense_max_n:
                    skip = f"dense skipped: N > --dense-max-n {args.dense_max_n}"
                elif (
                    impl == "dense"
                    and args.device == "cpu"
                    and _dense_estimate_mib(n) > 0.8 * _mem_available_mib()
                ):
                    skip = f"dense skipped: needs ~{_dense_estimate_mib(n):.0f} MiB"
                elif impl == "tiled-local" and n > args.local_max_n:
                    skip = f"skipped: N > --local-max-n {args.local_max_n}"
                elif time.perf_counter() - started > args.time_budget_s:
                    skip = f"skipped: time box {args.time_budget_s:.0f} s used up"
                if skip is not None:
                    result = CaseResult(loss, impl, n, args.dim, args.tile, args.device, skipped=skip)
                else:
                    result = run_case(args, loss, impl, n)
                results.append(result)
                print(json.dumps(asdict(result)), flush=True)

    info = machine_info()
    fits = fit_budget(results, args.budget_gib * 1024)
    print()
    print(", ".join(f"{k}: {v}" for k, v in info.items()))
    print(f"total {time.perf_counter() - started:.0f} s")
    print_table(results)
    print(f"\nLargest N whose extra memory fits {args.budget_gib:g} GiB:")
    for key, fit in fits.items():
        print(f"  {key}: N <= {fit['max_n']}  ({fit['model']})")
    if args.json is not None:
        payload = {"machine": info, "results": [asdict(r) for r in results], "budget_fit": fits}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()

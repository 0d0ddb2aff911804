"""Loader throughput: samples/s of the step-batch loader, synthetic and webdataset, per worker count.

    python benchmarks/bench_loader.py                  # all configurations, ~2-3 minutes on 2 cores
    python benchmarks/bench_loader.py --seconds 2      # shorter measurement per configuration

For each image size (224 px with open_clip's training transform, as for ViT-B; 64 px as for the tiny
test models) and each source (the built-in synthetic dataset rendered at that size; webdataset shards of
the same pairs as JPEG, written first with ds-clip-shards into a temporary folder), it runs one rank
(W=1, k=1, m=64) with --workers 0, 1, 2 and reports samples/s after the first step (worker start-up
excluded) and samples/s per worker. Prints a markdown table and the machine it ran on.

Side by side with open_clip (``--open-clip``, 224 px only): open_clip_train's own webdataset loader,
``open_clip_train.data.get_wds_dataset`` (its DataLoader, its shuffle buffers, PIL decode, the same transform
and tokenizer, m = 64, resampled shards), on the same JPEG shards with the same worker counts; the table then
gives ds_clip's samples/s over open_clip's. One change makes it run at all: open_clip_train 3.3.0's
sample grouping reads ``sample["fname"]`` from the end-of-shard marker that webdataset 1.0.2 emits (an empty
dict, ``KeyError: 'fname'``), so the benchmark hands its pipeline webdataset's tar expander with
``eof_value=None`` (no marker), which changes nothing else.

    python benchmarks/bench_loader.py --open-clip --sizes 224 --workers 1 2 --json benchmarks/results/raw/loader_cpu.json

Web-like data (``--data web``): ``--web-samples`` images as img2dataset keeps them from the web, generated here
(ds_clip_harness.webimages: JPEGs of 300-1500 px on the long side, quality 85-95, seven aspect ratios, 10 %
PNG, 10 % grayscale; natural-looking: smooth colour fields, hard-edged shapes, sensor noise), written as
webdataset shards of 256 with ds_clip.shards. ds_clip runs once per ``--decode`` mode (fast: the crop drawn
from the JPEG header and a reduced-size decode, uint8; exact: open_clip's decode and transform); open_clip's
``get_wds_dataset`` reads the same shards with the same transform. ``--workers all`` is os.cpu_count().
With web data it also reports the PSNR of the fast decode against the exact one (same seeds, same crops;
8-bit pixel units, over the first ``--psnr-samples`` images). ``--rounds R`` measures each configuration R
times, ours and open_clip's in turn, and reports the medians, the ratio as the median of the rounds' own ratios
(a virtual machine's speed drifts over minutes; a pair measured back to back sees the same machine).

    python benchmarks/bench_loader.py --data web --open-clip --sizes 224 --decode fast exact --workers 1 all \
        --seconds 10 --rounds 3 --json benchmarks/results/raw/loader_web.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import open_clip
import torch

from ds_clip.data.loader import DataSettings, build_train_data
from ds_clip.geometry import BatchGeometry
from ds_clip.shards import main as shards_main

MICRO_BATCH = 64


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?"
        )
    except OSError:
        model = platform.processor() or "?"
    mem_kb = 0
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            mem_kb = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal")))
    return f"{model}, {os.cpu_count()} cores, {mem_kb / 2**20:.0f} GiB RAM, torch {torch.__version__}"


def measure(settings: DataSettings, preprocess, tokenizer, seconds: float) -> float:
    """Samples/s over whole steps after the first, for about `seconds`."""
    data = build_train_data(
        settings,
        preprocess=preprocess,
        tokenizer=tokenizer,
        rank=0,
        geometry=BatchGeometry(1, 1, MICRO_BATCH),
    )
    start, samples = None, 0
    for batch in data.iter_epoch(0):
        if start is None:  # first step includes worker start-up and shuffle-buffer fill
            start = time.perf_counter()
            continue
        samples += sum(images.shape[0] for images, _ in batch.micro_batches)
        if time.perf_counter() - start > seconds:
            break
    elapsed = time.perf_counter() - start
    return samples / elapsed


def measure_open_clip(pattern: str, workers: int, preprocess, tokenizer, seconds: float) -> float:
    """Samples/s of open_clip_train's get_wds_dataset on `pattern`, after its first batch."""
    import functools
    from types import SimpleNamespace

    import open_clip_train.data as oc_data
    import webdataset as wds

    # webdataset 1.0.2 ends each shard with an empty-dict marker that open_clip's grouping cannot read.
    oc_data.tar_file_expander = functools.partial(wds.tariterators.tar_file_expander, eof_value=None)
    args = SimpleNamespace(
        train_data=pattern, val_data=None, dataset_resampled=True, train_num_samples=10**7,
        train_data_upsampling_factors=None, seed=0, batch_size=MICRO_BATCH, workers=workers, world_size=1,
    )  # fmt: skip
    info = oc_data.get_wds_dataset(args, preprocess, is_train=True, epoch=0, tokenizer=tokenizer)
    start, samples = None, 0
    for images, _ in info.dataloader:
        if start is None:  # worker start-up and the first fill of open_clip's shuffle buffer
            start = time.perf_counter()
            continue
        samples += images.shape[0]
        if time.perf_counter() - start > seconds:
            break
    return samples / (time.perf_counter() - start)


def write_web_shards(folder: str, count: int) -> None:
    """`count` web-like pairs (image i drawn from seed i: the same on every run) as shards of 256."""
    from multiprocessing import Pool

    from ds_clip.shards import Sample, write_shards

    os.makedirs(folder, exist_ok=True)
    with Pool(os.cpu_count()) as pool:
        images = pool.map(_web_image, range(count), chunksize=8)
    samples = (
        Sample(image=data, ext=ext, caption=f"a web image number {i}") for i, (data, ext) in enumerate(images)
    )
    write_shards(samples, folder, 256)


def _web_image(i: int) -> tuple[bytes, str]:
    import random

    from ds_clip_harness.webimages import web_image

    return web_image(random.Random(i))


def psnr_fast_vs_exact(folder: str, preprocess, count: int) -> dict:
    """PSNR (8-bit units) of the fast decode against the exact one on the first `count` images of the shards."""
    import io
    import math

    from PIL import Image

    from ds_clip.data.augment import SeededTransform
    from ds_clip.data.decode import FastCrop
    from ds_clip.data.wds import SkipCounter, iter_shard
    from ds_clip.step.cached import normalize_images

    fast = FastCrop.of(preprocess)
    exact, quick = SeededTransform(preprocess, 0), SeededTransform(fast, 0)
    std = torch.tensor(fast.std)[:, None, None]
    values, equal = [], 0
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".tar")):
        for raw in iter_shard(os.path.join(folder, name), SkipCounter()):
            data = raw.data.get("jpg", raw.data.get("png"))
            with Image.open(io.BytesIO(data)) as im:
                want = exact(im.convert("RGB"), epoch=0, sample=raw.key)
            got = normalize_images(quick(data, epoch=0, sample=raw.key)[None], fast.mean, fast.std)[0]
            mse = (((got - want) * std * 255) ** 2).mean().item()
            if mse == 0:
                equal += 1
            else:
                values.append(10 * math.log10(255**2 / mse))
            if len(values) + equal >= count:
                break
        if len(values) + equal >= count:
            break
    values.sort()
    differ = bool(values)  # all bit-equal: no PSNR to state (None in the JSON)
    return {
        "images": len(values) + equal,
        "bit_equal": equal,
        "psnr_db_mean": sum(values) / len(values) if differ else None,
        "psnr_db_median": values[len(values) // 2] if differ else None,
        "psnr_db_min": values[0] if differ else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="measurement per configuration")
    parser.add_argument("--samples", type=int, default=3072, help="pairs in the generated synthetic shards")
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 64], help="image sides in px")
    parser.add_argument(
        "--workers", nargs="+", default=["0", "1", "2"], help="DataLoader workers (numbers, or all)"
    )
    parser.add_argument("--open-clip", action="store_true", help="also open_clip_train's get_wds_dataset")
    parser.add_argument(
        "--data", nargs="+", choices=("synthetic", "web"), default=["synthetic"], help="data sets (see above)"
    )
    parser.add_argument(
        "--web-samples", type=int, default=2048, help="pairs in the generated web-like shards"
    )
    parser.add_argument(
        "--psnr-samples", type=int, default=200, help="web images in the PSNR of fast vs exact"
    )
    parser.add_argument(
        "--decode", nargs="+", choices=("fast", "exact"), default=["fast"], help="ds_clip's --decode modes"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measurements per configuration, ours and open_clip's alternating; medians reported, the ratio "
        "as the median of the rounds' own ratios",
    )
    parser.add_argument("--json", default=None, help="write the rows and the machine here")
    args = parser.parse_args(argv)
    worker_counts = [(os.cpu_count() or 1) if w == "all" else int(w) for w in args.workers]
    results: list[dict] = []
    extra: dict = {}
    torch.set_num_threads(1)  # one process = one core, as in a DataLoader worker
    tokenizer = open_clip.get_tokenizer("ViT-B-32")  # SimpleTokenizer: its BPE file ships with open_clip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        web_dir = os.path.join(tmp, "web")
        if "web" in args.data:
            start = time.perf_counter()
            write_web_shards(web_dir, args.web_samples)
            print(
                f"wrote {args.web_samples} web-like pairs in {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
            )
        for size in args.sizes:
            preprocess = open_clip.image_transform(size, is_train=True)
            shard_dir = os.path.join(tmp, f"shards{size}")
            sources: dict[str, tuple[str, DataSettings]] = {}
            if "synthetic" in args.data:
                shards_main(
                    ["--synthetic", str(args.samples), "--image-size", str(size), "--output", shard_dir]
                    + ["--samples-per-shard", "256"]
                )
                sources["synthetic"] = ("", DataSettings(
                    dataset_type="synthetic", train_num_samples=10**7, synthetic_image_size=size
                ))  # fmt: skip
            folders = {"webdataset": shard_dir} if "synthetic" in args.data else {}
            if "web" in args.data:
                folders["web"] = web_dir
                extra[f"psnr_fast_vs_exact_{size}px"] = psnr_fast_vs_exact(
                    web_dir, preprocess, args.psnr_samples
                )
                print(
                    f"PSNR fast vs exact at {size} px: {extra[f'psnr_fast_vs_exact_{size}px']}",
                    file=sys.stderr,
                )
            for name, folder in folders.items():
                for decode in args.decode:
                    sources[f"{name}, --decode {decode}"] = (folder, DataSettings(
                        dataset_type="webdataset",
                        train_data=os.path.join(folder, "*.tar"),
                        dataset_resampled=True,  # endless: the measurement decides when to stop
                        train_num_samples=10**7,
                        decode=decode,
                    ))  # fmt: skip
            for name, (folder, settings) in sources.items():
                for workers in worker_counts:
                    settings.workers = workers
                    compare = args.open_clip and folder and workers > 0
                    if compare:  # open_clip expands braces and "::" lists, not globs
                        tars = sorted(f for f in os.listdir(folder) if f.endswith(".tar"))
                        pattern = "::".join(os.path.join(folder, f) for f in tars)
                    ours, theirs = [], []
                    for _ in range(args.rounds):  # the two sides alternate: a round is one pair
                        ours.append(measure(settings, preprocess, tokenizer, args.seconds))
                        if compare:
                            theirs.append(
                                measure_open_clip(pattern, workers, preprocess, tokenizer, args.seconds)
                            )
                    rate = statistics.median(ours)
                    versus = ""
                    if compare:
                        ratio = statistics.median(o / t for o, t in zip(ours, theirs))
                        versus = f"{statistics.median(theirs):.0f} ({ratio:.2f}x)"
                        results.append({"source": f"open_clip_wds {os.path.basename(folder)} ({name})", "px": size,
                                        "workers": workers, "rate": statistics.median(theirs),
                                        "rounds": theirs})  # fmt: skip
                    results.append({"source": name, "px": size, "workers": workers, "rate": rate, "rounds": ours,
                                    **({"ratio_median_of_rounds": ratio} if compare else {})})  # fmt: skip
                    per_worker = f"{rate / workers:.0f}" if workers else "-"
                    rows.append(f"| {name} | {size} | {workers} | {rate:.0f} | {per_worker} | {versus} |")
                    print(rows[-1], file=sys.stderr, flush=True)
    print(f"machine: {machine()}")
    print(f"date: {datetime.date.today().isoformat()}")
    print(
        "command: python benchmarks/bench_loader.py " + " ".join(argv if argv is not None else sys.argv[1:])
    )
    print()
    print(
        "| source | image px | workers | samples/s | samples/s per worker | open_clip get_wds_dataset (ours/theirs) |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    for key, value in extra.items():
        print(f"{key}: {value}")
    if args.json:
        import json

        payload = {
            "machine": machine(),
            "load1": os.getloadavg()[0],
            "argv": argv or sys.argv[1:],
            "rows": results,
            **extra,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

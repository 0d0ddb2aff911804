"""Loader worker start: seconds to the first step batch when the workers fork from the rank and when they start
from the fork server (what ds_clip does while another thread runs in the rank: ds_clip.stop_signals.loader_workers).

    python benchmarks/bench_worker_start.py                       # 2 workers, 3 epochs each way; ~1 minute
    python benchmarks/bench_worker_start.py --workers 1 2 4 --epochs 5

The built-in synthetic data with open_clip's ViT-B-32 training transform at 64 px, one rank (W=1, k=1, m=32).
Each epoch builds a new DataLoader (as training does: its workers are not persistent), so the first epoch of
the fork server includes starting the server itself (importing torch, the data modules and open_clip once);
the later epochs show what each start costs then. A second Python thread runs during the fork-server rows,
as the remote sync's does in a run. Prints a markdown table: seconds to the first batch per epoch.
"""

from __future__ import annotations

import argparse
import threading
import time

import open_clip

from ds_clip.data.loader import DataSettings, build_train_data
from ds_clip.geometry import BatchGeometry


def first_batches(workers: int, epochs: int, preprocess, tokenizer) -> list[float]:
    data = build_train_data(
        DataSettings(
            dataset_type="synthetic", train_num_samples=32 * 64, synthetic_image_size=64, workers=workers
        ),
        preprocess=preprocess,
        tokenizer=tokenizer,
        rank=0,
        geometry=BatchGeometry(1, 1, 32),
    )
    out = []
    for epoch in range(epochs):
        start = time.perf_counter()
        next(iter(data.iter_epoch(epoch)))
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2])
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    _, preprocess, _ = open_clip.create_model_and_transforms("ViT-B-32", force_image_size=64)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    rows = []
    for workers in args.workers:
        rows.append(
            ("fork (no other thread)", workers, first_batches(workers, args.epochs, preprocess, tokenizer))
        )
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # another thread alive: the fork server is used
    other.start()
    for workers in args.workers:
        rows.append(
            (
                "fork server (a thread running)",
                workers,
                first_batches(workers, args.epochs, preprocess, tokenizer),
            )
        )
    stop.set()
    print("| start | workers | " + " | ".join(f"epoch {e} first batch" for e in range(args.epochs)) + " |")
    print("|---|---|" + "---|" * args.epochs)
    for how, workers, times in rows:
        print(f"| {how} | {workers} | " + " | ".join(f"{t:.2f} s" for t in times) + " |")


if __name__ == "__main__":
    main()

"""Validation reads per rank: what each of W ranks reads of webdataset --val-data shards in one evaluation.

    python benchmarks/bench_val_read.py                          # 4096 pairs, W = 1, 4, 8; ~1 minute on 2 cores
    python benchmarks/bench_val_read.py --pairs 16384 --ranks 1 8 16 --json docs/bench/val_read.json

The same synthetic pairs (ds-clip-shards, 64 px JPEG) are written twice: as 16 shards (at least W: each rank
reads only its own shards) and as 2 shards (fewer than W: every rank reads every shard and keeps samples
i % W == rank). For each layout and W, each rank's ``iter_val_batches`` (the evaluation's own reader) runs in
turn in this process, counting the pairs it yields and the bytes it reads (``rchar`` of /proc/self/io: bytes
read through the kernel, page cache included, so the figure does not depend on the machine's load). Prints a
markdown table: bytes read per rank, the sum over ranks against one read of the whole set, pairs per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from ds_clip.evaluate.datasets import iter_val_batches
from ds_clip.evaluate.settings import EvalSettings
from ds_clip.shards import main as shards_main


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def _one_rank(pattern: str, rank: int, world: int) -> tuple[int, int]:
    """(bytes read, pairs yielded) of rank ``rank`` of ``world`` reading ``pattern``."""
    import torchvision.transforms as T

    s = EvalSettings(val_data=pattern, batch_size=64)
    tokenizer = lambda texts: torch.zeros(len(texts), 8, dtype=torch.long)  # noqa: E731 - not what is measured
    before = _rchar()
    pairs = sum(
        int(b[0].numel())
        for b in iter_val_batches(
            s, rank=rank, world=world, preprocess=T.ToTensor(), tokenizer=tokenizer, classnames=None
        )
    )
    return _rchar() - before, pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=4096)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        layouts = {}
        for shards in (16, 2):
            out = os.path.join(tmp, f"s{shards}")
            shards_main(["--synthetic", str(args.pairs), "--output", out, "--image-size", "64",
                         "--samples-per-shard", str(args.pairs // shards)])  # fmt: skip
            layouts[shards] = os.path.join(out, f"{{00000..{shards - 1:05d}}}.tar")
        _one_rank(layouts[2], 0, 1)  # imports and caches warm
        for shards, pattern in layouts.items():
            whole = sum(os.path.getsize(f) for f in Path(pattern.split("{")[0]).glob("*.tar"))
            for world in args.ranks:
                per_rank = [_one_rank(pattern, r, world) for r in range(world)]
                read = [b for b, _ in per_rank]
                rows.append({
                    "shards": shards, "world": world, "shard_bytes": whole,
                    "max_bytes_per_rank": max(read), "sum_bytes": sum(read),
                    "pairs_per_rank": [n for _, n in per_rank], "pairs": sum(n for _, n in per_rank),
                })  # fmt: skip
    print(
        f"# validation reads per rank, {args.pairs} pairs ({platform.node()}, {platform.processor() or ''})"
    )
    print(
        "| shards | W | bytes read per rank (max) | all ranks / one read of the set | pairs per rank | pairs |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shards']} | {r['world']} | {r['max_bytes_per_rank'] / 2**20:.2f} MiB | "
            f"{r['sum_bytes'] / r['shard_bytes']:.2f} | {min(r['pairs_per_rank'])}-{max(r['pairs_per_rank'])} | "
            f"{r['pairs']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Write webdataset shards with img2dataset itself, from images served on 127.0.0.1 (no internet).

    python scripts/img2dataset_shards.py --img2dataset /path/to/venv/bin/img2dataset --output tests/data/img2dataset

Generates `--count` small images (JPEG of several sizes and aspect ratios, some PNG, some grayscale) with a
caption each, serves them with Python's http.server on 127.0.0.1, and runs img2dataset on a CSV of their URLs
with `--resize_mode no` (the original bytes kept) and `--output_format webdataset`. A few URLs are broken
as on the web: missing files (404) and files that are not images. img2dataset writes NNNNN.tar,
NNNNN_stats.json (its "successes" count is the number of samples in the tar: failed downloads are absent)
and NNNNN.parquet per shard; the parquet files are removed (ds_clip reads the tars and the stats files).
The shards in tests/data/img2dataset were written by this script; img2dataset has its own dependency pins,
so install it in a virtual environment of its own and pass its executable.
"""

from __future__ import annotations

import argparse
import csv
import functools
import glob
import http.server
import io
import os
import random
import subprocess
import tempfile
import threading

from PIL import Image


def _image(rng: random.Random) -> tuple[bytes, str]:
    w = rng.choice((48, 64, 80, 96))
    h = int(w * rng.choice((0.5, 0.75, 1.0, 1.33, 2.0)))
    image = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(4):
        x, y = rng.randrange(w), rng.randrange(h)
        colour = tuple(rng.randrange(256) for _ in range(3))
        image.paste(colour, (x, y, min(w, x + w // 3), min(h, y + h // 3)))
    if rng.random() < 0.2:
        image = image.convert("L")
    buf = io.BytesIO()
    if rng.random() < 0.2:
        image.save(buf, format="PNG")
        return buf.getvalue(), "png"
    image.save(buf, format="JPEG", quality=rng.choice((85, 90, 95)))
    return buf.getvalue(), "jpg"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--img2dataset", required=True, help="the img2dataset executable")
    parser.add_argument("--output", required=True, help="folder for the shards")
    parser.add_argument("--count", type=int, default=30, help="URLs in the list (default 30)")
    parser.add_argument("--per-shard", type=int, default=10, help="URLs per shard (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        site = os.path.join(tmp, "site")
        os.makedirs(site)
        rows = []
        for i in range(args.count):
            name = f"img{i:03d}"
            if i % 7 == 3:  # broken: never written (404)
                rows.append((f"{name}.jpg", f"missing picture {i}"))
                continue
            if i % 11 == 5:  # broken: not an image
                with open(os.path.join(site, f"{name}.jpg"), "wb") as f:
                    f.write(b"<html>not an image</html>")
                rows.append((f"{name}.jpg", f"not a picture {i}"))
                continue
            data, ext = _image(rng)
            with open(os.path.join(site, f"{name}.{ext}"), "wb") as f:
                f.write(data)
            rows.append((f"{name}.{ext}", f"a picture of blocks number {i}"))
        handler = functools.partial(_QuietHandler, directory=site)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        listing = os.path.join(tmp, "urls.csv")
        with open(listing, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["url", "caption"])
            writer.writerows((f"{base}/{name}", caption) for name, caption in rows)
        try:
            subprocess.run(
                [
                    args.img2dataset, "--url_list", listing, "--input_format", "csv", "--url_col", "url",
                    "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", args.output,
                    "--resize_mode", "no", "--number_sample_per_shard", str(args.per_shard),
                    "--processes_count", "1", "--thread_count", "4", "--retries", "0", "--timeout", "5",
                    "--enable_wandb", "False", "--disallowed_header_directives", "[]",
                ],
                check=True,
            )  # fmt: skip
        finally:
            server.shutdown()
    for path in glob.glob(os.path.join(args.output, "*.parquet")):
        os.remove(path)


if __name__ == "__main__":
    main()

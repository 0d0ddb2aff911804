"""The shard maker: what goes in (folder, CSV, built-in dataset) is what the pipeline reads back.

Also: inputs that cannot make a sample are skipped and reported per reason, and bad arguments give
one line on stderr and exit status 2.
"""

from __future__ import annotations

import io
import json
import os

import torch
import torchvision.transforms as T
from PIL import Image

from ds_clip.data.loader import DataSettings, build_train_data
from ds_clip.data.synthetic import render_pair
from ds_clip.data.wds import SkipCounter, iter_shard
from ds_clip.geometry import BatchGeometry
from ds_clip.shards import main
from tests.data.tokens import byte_tokenizer, detok

TO_TENSOR = T.ToTensor()


def encoded(colour: tuple[int, int, int], fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 12), colour).save(buf, format=fmt)
    return buf.getvalue()


def read_back(output) -> dict[str, tuple[bytes, str]]:
    """caption -> (image bytes, extension), straight from the tars."""
    out = {}
    for name in sorted(os.listdir(output)):
        if name.endswith(".tar"):
            for raw in iter_shard(os.path.join(output, name), SkipCounter()):
                (ext,) = [e for e in raw.data if e != "txt"]
                out[raw.data["txt"].decode()] = (raw.data[ext], ext)
    return out


def pipeline_pairs(output, count: int) -> dict[str, torch.Tensor]:
    """caption -> image tensor, read through the training loader (exact epoch, one rank)."""
    data = build_train_data(
        DataSettings(dataset_type="webdataset", train_data=os.path.join(str(output), "*.tar"), workers=0),
        preprocess=TO_TENSOR,
        tokenizer=byte_tokenizer,
        rank=0,
        geometry=BatchGeometry(1, 1, 1),
    )
    assert data.steps_per_epoch == count
    pairs = {}
    for batch in data.iter_epoch(0):
        ((images, texts),) = batch.micro_batches
        pairs[detok(texts[0])] = images[0]
    return pairs


def test_folder_round_trip_and_skips(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    inputs = {
        "a.jpg": (encoded((200, 10, 10), "JPEG"), "a red one"),
        "b.png": (encoded((10, 200, 10), "PNG"), "a green one"),
        "sub/c.webp": (encoded((10, 10, 200), "WEBP"), "a blue one"),
    }
    for name, (data, caption) in inputs.items():
        (src / name).write_bytes(data)
        (src / name).with_suffix(".txt").write_text(caption + "\n")
    (src / "nocap.jpg").write_bytes(encoded((1, 2, 3), "JPEG"))
    (src / "orphan.txt").write_text("no image")
    (src / "broken.png").write_bytes(b"\x89PNG not really")
    (src / "broken.txt").write_text("broken")
    (src / "empty.png").write_bytes(encoded((5, 5, 5), "PNG"))
    (src / "empty.txt").write_text("  \n")
    out = tmp_path / "out"
    assert main(["--from-folder", str(src), "--output", str(out), "--samples-per-shard", "2"]) == 0
    summary = capsys.readouterr().out
    assert "wrote 3 samples in 2 shards" in summary
    assert "1 no caption file" in summary and "1 caption without image" in summary
    assert "1 undecodable image" in summary and "1 empty caption" in summary
    assert json.loads((out / "sizes.json").read_text()) == {"00000.tar": 2, "00001.tar": 1}
    back = read_back(out)
    assert back == {caption: (data, name.rsplit(".", 1)[1]) for name, (data, caption) in inputs.items()}
    pairs = pipeline_pairs(out, 3)
    for data, caption in inputs.values():
        assert torch.equal(pairs[caption], TO_TENSOR(Image.open(io.BytesIO(data)).convert("RGB")))


def test_csv_round_trip_with_custom_keys_and_separator(tmp_path, capsys):
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(5):
        data = encoded((i * 40, 0, 0), "PNG")
        (tmp_path / "img" / f"{i}.png").write_bytes(data)
        rows.append((f"img/{i}.png", f"caption, number {i}"))  # paths relative to the CSV's folder
    rows.append(("img/missing.png", "gone"))
    lines = ["path;text"] + [f"{p};{c}" for p, c in rows]
    (tmp_path / "pairs.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    argv = ["--from-csv", str(tmp_path / "pairs.csv"), "--csv-img-key", "path", "--csv-caption-key", "text"]
    assert main([*argv, "--csv-separator", ";", "--output", str(out), "--samples-per-shard", "4"]) == 0
    summary = capsys.readouterr().out
    assert "wrote 5 samples in 2 shards" in summary and "1 image file not found" in summary
    back = read_back(out)
    assert back == {c: ((tmp_path / p).read_bytes(), "png") for p, c in rows[:5]}
    assert set(pipeline_pairs(out, 5)) == {c for _, c in rows[:5]}


def test_synthetic_round_trip_is_pixel_exact_in_png(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--synthetic", "6", "--seed", "4", "--image-size", "16", "--image-format", "png"]
    assert main([*argv, "--output", str(out), "--samples-per-shard", "4"]) == 0
    assert "wrote 6 samples in 2 shards" in capsys.readouterr().out
    pairs = pipeline_pairs(out, 6)
    expected = [render_pair(4, i, 16) for i in range(6)]
    assert len({c for _, c in expected}) == len(pairs)  # (captions happen to be distinct for these six)
    for image, caption in expected:
        assert torch.equal(pairs[caption], TO_TENSOR(image))


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    cases = [
        ["--from-folder", str(tmp_path / "nope"), "--output", str(tmp_path / "o")],
        ["--from-csv", str(tmp_path / "nope.csv"), "--output", str(tmp_path / "o")],
        ["--synthetic", "0", "--output", str(tmp_path / "o")],
        ["--output", str(tmp_path / "o")],
        ["--synthetic", "3", "--output", str(tmp_path / "o"), "--samples-per-shard", "0"],
    ]
    (tmp_path / "bad.csv").write_text("a\tb\nx\ty\n")
    cases.append(["--from-csv", str(tmp_path / "bad.csv"), "--output", str(tmp_path / "o")])
    (tmp_path / "empty").mkdir()
    cases.append(["--from-folder", str(tmp_path / "empty"), "--output", str(tmp_path / "o")])
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("ds-clip-shards: error: ") and err.count("\n") == 1, err
    assert "--csv-img-key 'filepath': " in (main(cases[5]), capsys.readouterr().err)[1]
    assert main(["--synthetic", "2", "--output", str(tmp_path / "s")]) == 0
    assert main(["--synthetic", "2", "--output", str(tmp_path / "s")]) == 2  # would overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(["--synthetic", "3", "--output", str(tmp_path / "s"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "s" / "sizes.json").read_text()) == {"00000.tar": 3}

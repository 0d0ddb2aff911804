"""--dataset-type csv: open_clip's CSV/TSV files through ds_clip's exact-epoch step loader.

Contract pinned here: every row is trained exactly once per epoch across ranks (the last partial global
batch left out), in an order reshuffled per epoch; a step's pairs, and their augmentation, depend on
N = W*k*m alone, not on the (W, k) split or --workers; a resumed run trains exactly what the uninterrupted
run would have; a missing or undecodable image is counted and replaced by the next row of the epoch's
order (m pairs per micro-batch, exact steps); bad files, columns, separators and sizes are errors
naming the flag (exit 2). The last test runs `ds-clip-train --dataset-type csv` under the deepspeed
launcher and resumes it.
"""

from __future__ import annotations

import csv
import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from ds_clip.config import DataSettings, parse_settings
from ds_clip.data.loader import DataError, build_train_data
from ds_clip.geometry import BatchGeometry
from ds_clip.train import main as train_main
from ds_clip_harness.models import E2E_MODEL
from tests import launch
from tests.data.tokens import byte_tokenizer, detok
from tests.test_e2e import K, M, W, _check_run, _run, _train_args

# A random crop: equal tensors across runs mean equal augmentation draws, not just equal rows.
PREPROCESS = T.Compose([T.RandomResizedCrop(8, scale=(0.3, 1.0)), T.ToTensor()])


def write_table(
    folder: Path, rows: int, *, sep: str = "\t", columns=("filepath", "title"), size: int = 12
) -> Path:
    """`rows` PNG images (distinct colours) and a table of (absolute path, caption "c<i>") rows."""
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / ("train.tsv" if sep == "\t" else "train.csv")
    with table.open("w", newline="") as f:
        writer = csv.writer(f, delimiter=sep)
        writer.writerow(columns)
        for i in range(rows):
            image = folder / f"{i}.png"
            Image.new("RGB", (size, size), (i % 256, (7 * i) % 256, 90)).save(image)
            writer.writerow([str(image), f"c{i}"])
    return table


def build(table: Path, *, rank=0, world_size=1, m=2, k=2, workers=0, **settings):
    s = DataSettings(dataset_type="csv", train_data=str(table), workers=workers, seed=5, **settings)
    return build_train_data(
        s,
        preprocess=PREPROCESS,
        tokenizer=byte_tokenizer,
        rank=rank,
        geometry=BatchGeometry(world_size, k, m),
    )


def steps_by_g(table: Path, world_size: int, k: int, m: int, workers: int = 0, epoch: int = 0):
    """{step: {g: (captions, images)}} over all ranks of a (W, k, m) run."""
    out: dict[int, dict[int, tuple[list[str], torch.Tensor]]] = {}
    for rank in range(world_size):
        data = build(table, rank=rank, world_size=world_size, m=m, k=k, workers=workers)
        for batch in data.iter_epoch(epoch):
            ids = data.geometry.micro_batch_ids(data.rank)
            assert len(batch.micro_batches) == k and batch.micro_batch_ids == ids
            for g, (images, texts) in zip(batch.micro_batch_ids, batch.micro_batches):
                assert images.shape == (m, 3, 8, 8) and texts.shape == (m, 96)
                out.setdefault(batch.step_in_epoch, {})[g] = ([detok(t) for t in texts], images)
    return out


def flat(steps) -> list[str]:
    return [c for s in sorted(steps) for g in sorted(steps[s]) for c in steps[s][g][0]]


def assert_same(a, b) -> None:
    assert sorted(a) == sorted(b)
    for s in a:
        assert sorted(a[s]) == sorted(b[s])
        for g in a[s]:
            assert a[s][g][0] == b[s][g][0]
            assert torch.equal(a[s][g][1], b[s][g][1])


def test_every_row_once_per_epoch_across_ranks_reshuffled_per_epoch(tmp_path, caplog):
    """27 rows, W=2 k=2 m=2 (N=8): 3 steps per epoch on each rank, 24 distinct rows, 3 left out (warned);
    epoch 1 trains another order and leaves out another set."""
    table = write_table(tmp_path, 27)
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        epochs = [steps_by_g(table, world_size=2, k=2, m=2, epoch=e) for e in (0, 1)]
    assert "24 of the 27 rows" in caplog.text
    for steps in epochs:
        assert sorted(steps) == [0, 1, 2] and all(sorted(steps[s]) == [0, 1, 2, 3] for s in steps)
        seen = flat(steps)
        assert len(seen) == len(set(seen)) == 24 and set(seen) <= {f"c{i}" for i in range(27)}
    assert flat(epochs[0]) != flat(epochs[1])
    assert set(flat(epochs[0])) != set(flat(epochs[1]))  # a different 3 left out (for this seed)
    data = build(table, world_size=2, m=2, k=2)
    assert (data.steps_per_epoch, data.samples_per_epoch) == (3, 24)


def test_a_step_depends_on_n_only_not_on_the_split_or_workers(tmp_path):
    """Same N = 8: (W=4, k=1), (W=2, k=2) and (W=1, k=4) give each step the same pairs per global
    micro-batch g, images (random crops) included; --workers 1 gives what --workers 0 gives."""
    table = write_table(tmp_path, 20)
    base = steps_by_g(table, world_size=2, k=2, m=2, workers=0)
    assert_same(base, steps_by_g(table, world_size=4, k=1, m=2, workers=0))
    assert_same(base, steps_by_g(table, world_size=1, k=4, m=2, workers=1))


def test_resume_mid_epoch_equals_the_uninterrupted_run(tmp_path):
    """state_dict() after step 1, loaded into a fresh loader: steps 2.. and epoch 1 are the straight run's."""
    table = write_table(tmp_path, 24)
    straight = build(table, m=2, k=2)
    expected = [[(detok(t), img) for images, texts in b.micro_batches for t, img in zip(texts, images)]
                for e in (0, 1) for b in straight.iter_epoch(e)]  # fmt: skip
    first = build(table, m=2, k=2)
    it = first.iter_epoch(0)
    next(it), next(it)
    state = first.state_dict()
    assert (state["epoch"], state["step_in_epoch"]) == (0, 2)
    resumed = build(table, m=2, k=2, workers=1)
    resumed.load_state_dict(state)
    got = [[(detok(t), img) for images, texts in b.micro_batches for t, img in zip(texts, images)]
           for b in resumed.iter_epoch(state["epoch"], state["step_in_epoch"])]  # fmt: skip
    got += [[(detok(t), img) for images, texts in b.micro_batches for t, img in zip(texts, images)]
            for b in resumed.iter_epoch(1)]  # fmt: skip
    assert len(got) == len(expected) - 2
    for a, b in zip(got, expected[2:]):
        assert [c for c, _ in a] == [c for c, _ in b]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
    assert resumed.state_dict()["epoch"] == 2


def test_missing_and_undecodable_images_are_counted_and_replaced(tmp_path, caplog):
    """Row 3's image is deleted, row 5's is not an image, row 8's caption is empty: each is counted under
    its reason, logged, and replaced by the next row of the order; every micro-batch keeps m pairs, the
    epoch its 4 steps, and every good row is trained; the counts survive state_dict()."""
    table = write_table(tmp_path, 16)
    (tmp_path / "3.png").unlink()
    (tmp_path / "5.png").write_bytes(b"not a png")
    lines = table.read_text().splitlines()
    lines[1 + 8] = lines[1 + 8].split("\t")[0] + "\t "
    table.write_text("\n".join(lines) + "\n")
    data = build(table, m=2, k=2, workers=1)
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        batches = list(data.iter_epoch(0))
    assert len(batches) == 4
    assert all(images.shape[0] == 2 for b in batches for images, _ in b.micro_batches)
    seen = Counter(detok(t) for b in batches for _, texts in b.micro_batches for t in texts)
    assert sum(seen.values()) == 16
    assert set(seen) == {f"c{i}" for i in range(16)} - {"c3", "c5", "c8"}
    assert data.skip_counts == {"missing_image": 1, "bad_image": 1, "missing_caption": 1}
    assert "skipped missing_image in row 3" in caplog.text and "skipped bad_image in row 5" in caplog.text
    assert data.state_dict()["skip_counts"] == data.skip_counts


def test_bad_input_is_an_error_naming_the_flag(tmp_path, capsys, monkeypatch):
    """Flags (ds-clip-train exits 2 with one line) and files (DataError, exit 2 through ds-clip-train):
    a missing file, a missing column, a wrong separator, a ragged row, fewer rows than one global batch,
    image paths that resolve to nothing."""
    table = write_table(tmp_path / "ok", 8)
    assert parse_settings(["--train-data", str(table)]).data.dataset_type == "csv"  # open_clip's "auto"
    for argv, needle in [
        (["--train-data", str(tmp_path / "missing.tsv")], "--train-data"),
        (
            ["--train-data", str(table), "--dataset-resampled", "--train-num-samples", "8"],
            "--dataset-resampled",
        ),
        (["--train-data", str(table), "--csv-separator", "ab"], "--csv-separator"),
        (["--train-data", str(table), "--csv-img-key", ""], "--csv-img-key"),
    ]:
        assert train_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err

    def error(path: Path, **kw) -> str:
        with pytest.raises(DataError) as info:
            build(path, **kw)
        assert info.value.exit_code == 2
        return str(info.value)

    message = error(table, csv_img_key="image")
    assert "--csv-img-key 'image'" in message and str(table) in message and "filepath, title" in message
    assert "--csv-caption-key 'caption'" in error(table, csv_caption_key="caption")
    commas = write_table(tmp_path / "commas", 8, sep=",")
    assert "--csv-separator '\\t'" in error(commas) and "','-separated" in error(commas)
    assert len(build(commas, csv_separator=",").dataset) == 8
    assert len(build(table, csv_separator="\\t").dataset) == 8  # backslash-t: a tab, as pandas reads it
    assert "fewer than one global batch N = W*k*m = 16" in error(table, world_size=4, m=2, k=2)
    assert "--train-data" in error(table, world_size=4, m=2, k=2)
    ragged = tmp_path / "ragged.tsv"
    ragged.write_text(table.read_text() + "x.png\tcaption\textra\n")
    assert "line 10" in error(ragged) and "--csv-separator" in error(ragged)
    relative = tmp_path / "ok" / "relative.tsv"
    relative.write_text("filepath\ttitle\n" + "".join(f"{i}.png\tc{i}\n" for i in range(8)))
    monkeypatch.chdir(tmp_path)
    message = error(relative)
    assert (
        "--csv-img-key" in message and "working directory" in message and "relative to the file's" in message
    )
    monkeypatch.chdir(tmp_path / "ok")
    assert build(relative).steps_per_epoch == 2  # paths are taken from the working directory, as written


@pytest.mark.e2e
@pytest.mark.slow
def test_ds_clip_train_on_a_tsv_under_the_deepspeed_launcher_resumes(tmp_path):
    """`deepspeed --num_gpus 2 --module ds_clip.train --train-data train.tsv` (csv from the extension, as
    open_clip's auto) trains 2 steps of k*m*W pairs on 2 CPU ranks; `--resume latest` continues at step 2
    into the next epoch (48 rows, N = 16: 3 steps an epoch)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    model = f"local-dir:{tmp_path / 'model'}"
    table = write_table(tmp_path / "data", 3 * K * M * W, size=32)
    data = ["--train-data", str(table)]
    proc = _run(launch.deepspeed(*data, *_train_args(model, tmp_path, "csv", steps=2)))
    _check_run(proc, tmp_path / "csv", steps=2)
    assert json.loads((tmp_path / "csv" / "settings.json").read_text())["dataset_type"] == "csv"
    proc = _run(launch.deepspeed(*data, *_train_args(model, tmp_path, "csv", steps=4), "--resume", "latest"))
    assert "resumed from" in proc.stdout + proc.stderr and "at step 2" in proc.stdout + proc.stderr
    _check_run(proc, tmp_path / "csv", steps=4, first=3)
    assert "step 4/4 | epoch 1 |" in proc.stdout

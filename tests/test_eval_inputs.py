"""Evaluation inputs checked before the first step, --val-data as open_clip takes it (a CSV/TSV file with the
--csv-* keys, or shards), zero-shot on your own class folders, and a reused run folder refused.

Contract: a bad evaluation input is one EvalError line naming the flag and the file, raised by the check the
trainer and ds-clip-eval run before any model or process group; a CSV row whose image is missing is skipped
and counted, every other row read once across ranks; a class-folder zero-shot scores top-1 (and top-5 with
five or more classes) exactly on constructed features; a run folder with checkpoints is refused without
--resume, in one line naming the folder, --resume latest and --name.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from ds_clip import evaluate as ev
from ds_clip.checkpoint import RunFolderError, check_fresh_run_folder
from ds_clip.evaluate.agreement import agree
from ds_clip.evaluate.classes import folder_classes, load_templates
from ds_clip.evaluate.inputs import check_zeroshot_folder
from ds_clip.evaluate.settings import is_table
from ds_clip.evaluate.zeroshot import classify_folders

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def _png(path: Path, rgb=(255, 0, 0)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), rgb).save(path)
    return path


def _table(tmp_path: Path, rows: list[tuple[str, str]], sep: str = ",") -> Path:
    f = tmp_path / "val.csv"
    f.write_text("\n".join([f"filepath{sep}title", *(f"{p}{sep}{c}" for p, c in rows)]) + "\n")
    return f


def _settings(val_data: Path | str, **kw) -> ev.EvalSettings:
    return ev.EvalSettings(val_data=str(val_data), table=is_table(str(val_data)), **kw)


def test_val_data_kind_follows_open_clip():
    assert is_table("val.csv") and is_table("/d/VAL.TSV") and not is_table("synthetic")
    assert not is_table("val/{0..3}.tar") and not is_table("val.tar", "csv")
    assert is_table("val.txt", "csv") and not is_table("val.txt", "webdataset")


def test_csv_val_data_is_read_with_the_csv_keys_each_row_once(tmp_path):
    """Rank r of 3 reads rows i = r (mod 3); a row whose image is missing is skipped; labels from captions."""
    rows = [(str(_png(tmp_path / f"{i}.png", COLORS["red"])), f"a red circle {i}") for i in range(7)]
    rows[3] = (str(tmp_path / "missing.png"), "a blue square")
    f = _table(tmp_path, rows)
    s = _settings(f, batch_size=2, csv_separator=",")
    ev.check_val_data(s)
    seen = {}
    for rank in range(3):
        for idx, images, texts, labels in ev.iter_val_batches(
            s, rank=rank, world=3, preprocess=lambda im: torch.zeros(3, 4, 4),
            tokenizer=lambda t: torch.tensor([[len(x)] for x in t]), classnames=["circle", "square"],
        ):  # fmt: skip
            assert images.shape[1:] == (3, 4, 4) and len(texts) == len(idx)
            for i, label in zip(idx.tolist(), labels.tolist()):
                assert i % 3 == rank and i not in seen
                seen[i] = label
    assert sorted(seen) == [0, 1, 2, 4, 5, 6] and set(seen.values()) == {0}


@pytest.mark.parametrize(
    "case, want",
    [
        ("separator", "--csv-separator"),  # a comma file read with open_clip's default tab
        ("column", "--csv-img-key 'filepath'"),
        ("images", "--csv-img-key: none of the first"),
        ("empty", "has a header but no rows"),
    ],
)
def test_bad_csv_val_data_is_one_line_naming_the_flag(tmp_path, case, want):
    img = str(_png(tmp_path / "a.png"))
    if case == "column":
        f = tmp_path / "val.csv"
        f.write_text(f"path,title\n{img},a red circle\n")
    elif case == "images":
        f = _table(tmp_path, [("nowhere/a.png", "a red circle")])
    elif case == "empty":
        f = _table(tmp_path, [])
    else:
        f = _table(tmp_path, [(img, "a red circle")])
    s = _settings(f, csv_separator="\t" if case == "separator" else ",")
    with pytest.raises(ev.EvalError, match="--val-data|--csv") as err:
        ev.check_val_data(s)
    assert want in str(err.value) and "\n" not in str(err.value)


def _shard(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_bad_shards_are_one_line_naming_the_keys(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    good = _shard(tmp_path / "good.tar", {"0.png": buf.getvalue(), "0.txt": b"a red circle"})
    ev.check_val_data(_settings(good, image_key="png"))
    with pytest.raises(ev.EvalError, match=r"--image-key jpg\).*sample '0' holds \.png, \.txt"):
        ev.check_val_data(_settings(good, image_key="jpg"))
    text = tmp_path / "val.txt"
    text.write_text("filepath,title\n")  # a table without a .csv name: read as a shard, so refused as one
    with pytest.raises(ev.EvalError, match="not a readable tar shard.*--dataset-type csv"):
        ev.check_val_data(_settings(text))


def _class_tree(root: Path) -> Path:
    """red/ (2 red images), green/ (1 green, 1 red: wrong at top-1), blue/ (2 blue)."""
    for name, colors in {"red": ["red", "red"], "green": ["green", "red"], "blue": ["blue", "blue"]}.items():
        for i, c in enumerate(colors):
            _png(root / name / f"{i}.png", COLORS[c])
    return root


def _color_model():
    """Image features = mean RGB; the text of a prompt = the one-hot of the colour word in it: the classifier is
    the identity on RGB, so an image's class is its colour."""
    words = list(COLORS)

    def preprocess(im):
        return torch.tensor(im.convert("RGB").getpixel((0, 0)), dtype=torch.float32) / 255

    def tokenizer(texts):
        return torch.tensor([[float(w in t) for w in ("red", "green", "blue")] for t in texts])

    def forward(image=None, text=None):
        out = {}
        if image is not None:
            out["image_features"] = image.float().reshape(image.shape[0], -1)[:, :3]
        if text is not None:
            out["text_features"] = text.float()
        return out

    return words, preprocess, tokenizer, forward


def test_class_folder_zeroshot_known_answer(tmp_path):
    root = _class_tree(tmp_path / "colors")
    folders, names = folder_classes(str(root))
    assert folders == ["blue", "green", "red"] and names == folders
    _, preprocess, tokenizer, forward = _color_model()
    task = ev.folder_task(str(root), None, "simple")
    check_zeroshot_folder(str(root), None, "simple")
    m = classify_folders(
        forward, [task], preprocess=preprocess, tokenizer=tokenizer, batch_size=4, device="cpu"
    )
    assert m == {
        "zeroshot-folder-top1": pytest.approx(5 / 6),
        "zeroshot-folder-samples": 6.0,
    }  # no top-5: 3 classes


def test_an_undecodable_class_image_is_skipped_and_counted_not_the_whole_zeroshot_result(tmp_path, caplog):
    """One undecodable image in a --zeroshot-folder: the start-up check passes, the evaluation classifies the
    other images and says in one line how many it skipped (as a bad --val-data sample or shard sample is)."""
    root = _class_tree(tmp_path / "colors")
    (root / "green" / "0.png").write_bytes(b"\xff\xd8 not a jpeg")
    check_zeroshot_folder(str(root), None, "simple")
    _, preprocess, tokenizer, forward = _color_model()
    task = ev.folder_task(str(root), None, "simple")
    with caplog.at_level(logging.WARNING, logger="ds_clip"):
        m = classify_folders(
            forward, [task], preprocess=preprocess, tokenizer=tokenizer, batch_size=4, device="cpu"
        )
    assert m == {"zeroshot-folder-top1": pytest.approx(4 / 5), "zeroshot-folder-samples": 5.0}
    said = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(said) == 1 and "skipped 1 image(s)" in said[0] and "green/0.png" in said[0], said


def test_class_names_from_a_json_map_and_templates_from_a_file(tmp_path):
    root = tmp_path / "tree"
    for f in ("n01", "n02_x"):
        _png(root / f / "a.png")
    assert folder_classes(str(root))[1] == ["n01", "n02 x"]
    names = tmp_path / "names.json"
    names.write_text(json.dumps({"n01": "tench", "n02_x": "goldfish"}))
    assert folder_classes(str(root), str(names))[1] == ["tench", "goldfish"]
    names.write_text(json.dumps({"n01": "tench"}))
    with pytest.raises(ev.EvalError, match="--zeroshot-classnames .*no name for 1 of the 2 class folders"):
        folder_classes(str(root), str(names))
    templates = tmp_path / "t.txt"
    templates.write_text("a photo of {c}.\n\nart of {c}\n")
    assert [t("ox") for t in load_templates(str(templates))] == ["a photo of ox.", "art of ox"]
    templates.write_text("no placeholder\n")
    with pytest.raises(ev.EvalError, match="--zeroshot-templates"):
        load_templates(str(templates))
    (root / "n01" / "a.png").write_bytes(b"not an image")
    check_zeroshot_folder(str(root), None, "openai")  # one bad image: skipped and counted when evaluated
    (root / "n02_x" / "a.png").write_bytes(b"not an image either")
    with pytest.raises(ev.EvalError, match="--zeroshot-folder .*none of its first 2 images decodes"):
        check_zeroshot_folder(str(root), None, "openai")


def test_a_failed_part_is_agreed_and_raised_as_eval_failed():
    agree(None)
    with pytest.raises(ev.EvalFailed, match="shard gone"):
        agree("--val-data x: shard gone")


def test_evaluate_raises_eval_failed_when_its_samples_cannot_be_read(tmp_path):
    s = _settings("synthetic", val_num_samples=4, batch_size=2)

    def unreadable():
        raise OSError("store gone away")

    with pytest.raises(ev.EvalFailed, match="--val-data synthetic: OSError: store gone away"):
        ev.evaluate(lambda **kw: {}, s, preprocess=None, tokenizer=None, before_read=unreadable)


def test_reused_run_folder_with_checkpoints_is_refused(tmp_path):
    run = tmp_path / "run"
    check_fresh_run_folder(run, "run")  # no folder yet
    (run / "checkpoints").mkdir(parents=True)
    check_fresh_run_folder(run, "run")  # a folder without checkpoints (a run that stopped before saving)
    (run / "checkpoints" / "step_00000005").mkdir()
    with pytest.raises(RunFolderError) as err:
        check_fresh_run_folder(run, "run")
    msg = str(err.value)
    assert str(run) in msg and "--resume latest" in msg and "another --name" in msg and "step_00000005" in msg


# -------------------------------------------------------------------------------------------- ds-clip-eval

TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.mark.slow
def test_ds_clip_eval_on_a_csv_and_class_folders(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY, "preprocess_cfg": {}}))
    rows = [(str(_png(tmp_path / "img" / f"{i}.png", COLORS["red"])), f"a red circle {i}") for i in range(5)]
    table = _table(tmp_path, rows, sep="\t")  # open_clip's default separator
    root = _class_tree(tmp_path / "colors")
    out = tmp_path / "m.json"
    code = ev.main(
        [str(model), "--val-data", str(table), "--zeroshot-folder", str(root), "--zeroshot-templates", "simple",
         "--out", str(out)]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    m = json.loads(out.read_text())
    assert m["val_samples"] == 5 and 0 <= m["i2t_R@1"] <= 1
    assert m["zeroshot-folder-samples"] == 6 and 0 <= m["zeroshot-folder-top1"] <= 1
    capsys.readouterr()
    assert ev.main([str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to evaluate" in err[0]


@pytest.mark.slow
def test_ds_clip_eval_reads_any_table_with_dataset_type_csv_and_skips_a_bad_class_image(tmp_path, capsys):
    """A table not named .csv/.tsv with --dataset-type csv (the flag the refusal of such a file names), saved
    with a byte-order mark; a class folder holding an undecodable image: metrics, exit 0, and the evaluation
    raises no "requires_grad=True to a scalar" warning (it runs under no_grad)."""
    import warnings

    model = tmp_path / "model"
    model.mkdir()
    (model / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY, "preprocess_cfg": {}}))
    rows = [(str(_png(tmp_path / "img" / f"{i}.png", COLORS["red"])), f"a red circle {i}") for i in range(5)]
    table = tmp_path / "val.txt"
    table.write_text("filepath\ttitle\n" + "".join(f"{p}\t{c}\n" for p, c in rows), encoding="utf-8-sig")
    root = _class_tree(tmp_path / "colors")
    (root / "blue" / "1.png").write_bytes(b"not a png")
    out = tmp_path / "m.json"
    argv = [
        str(model),
        "--val-data",
        str(table),
        "--zeroshot-folder",
        str(root),
        "--zeroshot-templates",
        "simple",
    ]
    assert ev.main(argv) == 2  # read as shards without --dataset-type csv, and refused saying so
    assert "--dataset-type csv" in capsys.readouterr().err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = ev.main([*argv, "--dataset-type", "csv", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    m = json.loads(out.read_text())
    assert m["val_samples"] == 5 and m["zeroshot-folder-samples"] == 5
    assert not [w for w in caught if "requires_grad" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_default_run_folder_is_what_the_readme_says_and_its_name_is_not_reused(tmp_path):
    """One process, one step, no --report-to: settings.json, ds_config.json, command.txt and checkpoints/ only
    (docs/start.md); the same --name again without --resume: exit 2, one line, the first run's files untouched."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ds_clip.train", "--max-steps", "1", "--batch-size", "4", "--workers", "0",
           "--logs", str(tmp_path), "--name", "plain"]  # fmt: skip
    first = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "plain"
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoints",
        "command.txt",
        "ds_config.json",
        "settings.json",
    ]
    start = (root / "docs" / "start.md").read_text()
    assert "`metrics.csv` and `tensorboard/` only with `--report-to csv,tensorboard`" in start
    settings = (run / "settings.json").read_text()
    again = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
    lines = [ln for ln in again.stderr.splitlines() if ln.startswith("ds-clip-train: error:")]
    assert len(lines) == 1 and str(run) in lines[0] and "--resume latest" in lines[0], again.stderr[-2000:]
    assert (run / "settings.json").read_text() == settings

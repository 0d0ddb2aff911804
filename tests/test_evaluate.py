"""Evaluation metrics on constructed cases with known answers, and recall on the built-in dataset.

Contract: recall@K / median rank count the true partner's rank among all N_val candidates (ties broken by
sample index, so a collapsed model scores chance); val loss is open_clip's own loss on all pairs as one
batch; zero-shot is open_clip's classifier recipe (mean of normalised template embeddings).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ds_clip import evaluate as ev
from ds_clip.evaluate.classes import label_from_caption, load_zeroshot
from ds_clip.evaluate.metrics import _true_ranks, contrastive_val_loss, retrieval_metrics, zeroshot_accuracy
from ds_clip.evaluate.reporting import report
from ds_clip.evaluate.zeroshot import zeroshot_classifier

ROOT = Path(__file__).resolve().parents[1]


def test_retrieval_perfect_shifted_and_collapsed():
    n = 20
    basis = torch.eye(n)
    m = retrieval_metrics(basis, basis)
    assert m["i2t_R@1"] == m["t2i_R@1"] == 1.0 and m["i2t_median_rank"] == 1.0
    # Text i = e_(i+1) + 0.5 e_i: image i+1 scores 1, its own image 0.5, so every true pair has rank 2.
    image = basis
    text_swapped = basis.roll(-1, dims=0) + 0.5 * basis
    m = retrieval_metrics(image, text_swapped)
    assert m["t2i_R@1"] == 0.0 and m["t2i_R@5"] == 1.0 and m["t2i_median_rank"] == 2.0
    # Text i = e_i + 0.5 e_(i+1): its own image scores highest.
    assert retrieval_metrics(image, basis + 0.5 * basis.roll(-1, dims=0))["t2i_R@1"] == 1.0
    # Everything maps to one point: all scores tie; ties go by index, so pair i has rank i: chance.
    same = torch.ones(n, 4)
    m = retrieval_metrics(same, same)
    assert m["i2t_R@1"] == pytest.approx(1 / n) and m["i2t_R@5"] == pytest.approx(5 / n)
    assert m["i2t_R@10"] == pytest.approx(10 / n) and m["i2t_median_rank"] == pytest.approx(10.5)


def test_retrieval_ranks_are_exact_for_a_known_permutation():
    """Image i's own text sits at a known position: rank(i) = i % 7 (1-based: +1)."""
    torch.manual_seed(0)
    n, d = 30, 64
    text = F.normalize(torch.randn(n, d), dim=-1)
    want = torch.arange(n) % 7
    # Score of image i against text j: a strictly decreasing ladder, its own text at position want[i].
    scores = torch.empty(n, n)
    for i in range(n):
        others = [j for j in range(n) if j != i]
        order = others[: want[i]] + [i] + others[want[i] :]
        for pos, j in enumerate(order):
            scores[i, j] = 1.0 - pos / n
    image = scores @ torch.linalg.pinv(text.T)  # image @ text.T == scores (text has full column rank here)
    ranks = _true_ranks(image, text)
    assert torch.equal(ranks, want)


def test_val_loss_is_open_clips_loss_on_the_whole_batch():
    from open_clip.loss import ClipLoss, SigLipLoss

    torch.manual_seed(1)
    img, txt = F.normalize(torch.randn(50, 8), dim=-1), F.normalize(torch.randn(50, 8), dim=-1)
    scale = 7.5
    ours = contrastive_val_loss(img, txt, scale)
    assert ours == pytest.approx(float(ClipLoss()(img, txt, torch.tensor(scale))), rel=1e-5)
    ours = contrastive_val_loss(img, txt, scale, logit_bias=-3.0)
    ref = SigLipLoss()(img, txt, torch.tensor(scale), torch.tensor(-3.0))
    assert ours == pytest.approx(float(ref), rel=1e-5)


def test_zeroshot_accuracy_known_answer():
    classifier = torch.eye(6)
    image = torch.eye(6)[[0, 1, 2, 3, 4, 5, 0, 0]]
    image[5, 1] = (
        0.5  # sample 5 (label 1) points at class 5 first, class 1 second: wrong at top-1, right at top-5
    )
    labels = torch.tensor([0, 1, 2, 3, 4, 1, 0, -1])  # the last has no label: not counted
    m = zeroshot_accuracy(image, labels, classifier)
    assert m["zeroshot_samples"] == 7
    assert m["zeroshot_top1"] == pytest.approx(6 / 7)
    assert m["zeroshot_top5"] == pytest.approx(1.0)


def test_zeroshot_classifier_is_mean_of_normalised_templates():
    calls = []

    def forward(image=None, text=None):
        calls.append(image is not None)
        return {"text_features": text.float()}

    tokenizer = lambda texts: torch.tensor([[len(t), 1.0] for t in texts])  # noqa: E731
    templates = [lambda c: f"a {c}", lambda c: f"a big {c}"]
    cls = zeroshot_classifier(forward, tokenizer, ["ox", "horse"], templates, device="cpu")
    want = F.normalize(F.normalize(torch.tensor([[4.0, 1], [8.0, 1]]), dim=-1).mean(0), dim=-1)
    torch.testing.assert_close(cls[0], want)
    assert cls.shape == (2, 2) and calls == [False, False]


def test_labels_from_captions_and_class_files(tmp_path):
    names = ["circle", "square", "top left"]
    assert label_from_caption("a small red circle in the center", names) == 0
    assert label_from_caption("a square in the top left", names) == -1  # two classes: not counted
    assert label_from_caption("a circles party", names) == -1  # whole words only
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"classnames": ["a", "b"], "templates": ["x {c} y"]}))
    classes, templates = load_zeroshot(str(f))
    assert classes == ["a", "b"] and [t("a") for t in templates] == ["x a y"]
    txt = tmp_path / "c.txt"
    txt.write_text("dog\n\ncat\n")
    classes, templates = load_zeroshot(str(txt))
    assert classes == ["dog", "cat"] and len(templates) > 1
    f.write_text(json.dumps({"classnames": ["a"], "templates": ["no placeholder"]}))
    with pytest.raises(ev.EvalError, match="--zeroshot-classes"):
        load_zeroshot(str(f))
    with pytest.raises(ev.EvalError, match="no such file"):
        load_zeroshot(str(tmp_path / "missing.json"))


def test_report_writes_json_history_and_csv(tmp_path):
    m = {"val_samples": 4.0, "val_loss": 1.0, "i2t_R@1": 0.5}
    report(tmp_path, 10, m)
    report(tmp_path, 20, {**m, "val_loss": 0.5})
    report(tmp_path, 20, {**m, "val_loss": 0.25})  # a resumed run re-evaluating step 20 replaces it
    hist = json.loads((tmp_path / "eval_results.json").read_text())
    assert [(h["step"], h["val_loss"]) for h in hist] == [(10, 1.0), (20, 0.25)]
    assert (tmp_path / "val_metrics.csv").read_text().splitlines()[0] == "step,val_samples,val_loss,i2t_R@1"


def test_ds_clip_eval_bad_input_is_one_line(tmp_path, capsys):
    assert ev.main([str(tmp_path), "--val-data", "/nonexistent/{0..3}.tar"]) == 2
    err = capsys.readouterr().err
    assert "ds-clip-eval: error: --val-data" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ learning, end to end

# Tiny CLIP (ViT 32 px, one layer per tower, 16-d embeddings) on the built-in captioned shapes, one
# process, 200 steps of 32 pairs. Evaluated on 200 held-out pairs: chance is R@1 = 1/200 = 0.005 and
# R@5 = 0.025. Measured on this machine: i2t/t2i R@5 ~ 0.75/0.82, R@1 ~ 0.2 at step 200. The thresholds
# (R@5 >= 0.35, 14x chance; R@1 >= 0.06, 12x chance) leave room for float differences across CPUs and
# still fail for a model that learned nothing (or an evaluation that mis-pairs images and texts).
RECALL_MODEL = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.mark.e2e
@pytest.mark.slow
def test_builtin_dataset_reaches_recall_well_above_chance(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": RECALL_MODEL, "preprocess_cfg": {}})
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    cmd = [
        sys.executable, "-m", "ds_clip.train", "--model", f"local-dir:{model}", "--batch-size", "32",
        "--max-steps", "200", "--lr", "2e-3", "--wd", "0", "--warmup", "20", "--log-every-n-steps", "100",
        "--logs", str(tmp_path), "--name", "recall", "--workers", "0", "--val-data", "synthetic",
        "--val-num-samples", "200", "--val-every-n-steps", "100", "--report-to", "csv",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    history = json.loads((tmp_path / "recall" / "eval_results.json").read_text())
    assert [h["step"] for h in history] == [100, 200]
    final = history[-1]
    assert final["val_samples"] == 200
    for d in ("i2t", "t2i"):
        assert final[f"{d}_R@5"] >= 0.35, final
        assert final[f"{d}_R@1"] >= 0.06, final
    assert final["val_loss"] < history[0]["val_loss"] or final["i2t_R@5"] >= history[0]["i2t_R@5"]
    assert "val step 200" in proc.stdout + proc.stderr


def test_webdataset_val_slices_are_disjoint_and_complete(tmp_path):
    """Rank r of W reads samples i = r (mod W): every sample once; labels from `cls`, else the caption."""
    import io
    import tarfile

    from PIL import Image

    def add(tf, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))

    for shard in range(2):
        with tarfile.open(tmp_path / f"val-{shard}.tar", "w") as tf:
            for j in range(4):
                key = f"{shard}{j:03d}"
                buf = io.BytesIO()
                Image.new("RGB", (8, 8), (10 * j, 0, 0)).save(buf, format="PNG")
                add(tf, f"{key}.png", buf.getvalue())
                add(tf, f"{key}.txt", (b"a red circle" if j % 2 else b"a blue square"))
                if shard == 1:
                    add(tf, f"{key}.cls", b"1")
    s = ev.EvalSettings(val_data=str(tmp_path / "val-{0..1}.tar"), batch_size=3)
    tokenizer = lambda texts: torch.tensor([[len(t)] for t in texts])  # noqa: E731
    preprocess = lambda im: torch.zeros(3, 4, 4)  # noqa: E731
    seen = {}
    for rank in range(3):
        for idx, images, texts, labels in ev.iter_val_batches(
            s, rank=rank, world=3, preprocess=preprocess, tokenizer=tokenizer, classnames=["circle", "square"]
        ):
            assert images.shape[1:] == (3, 4, 4) and len(texts) == len(idx) <= 3
            for i, label in zip(idx.tolist(), labels.tolist()):
                assert i % 3 == rank and i not in seen
                seen[i] = label
    assert sorted(seen) == list(range(8))
    # shard 0: from the caption (odd j: circle = 0, even j: square = 1); shard 1: its cls member
    assert [seen[i] for i in range(8)] == [1, 0, 1, 0, 1, 1, 1, 1]


def _val_shards(folder: Path, shards: int, per_shard: int, sizes: bool) -> str:
    from ds_clip.shards import main

    assert main(["--synthetic", str(shards * per_shard), "--output", str(folder), "--image-size", "16",
                 "--samples-per-shard", str(per_shard)]) == 0  # fmt: skip
    if not sizes:
        (folder / "sizes.json").unlink()
    return str(folder / f"{{00000..{shards - 1:05d}}}.tar")


def test_webdataset_val_with_at_least_w_shards_gives_each_rank_its_own_shards(tmp_path):
    """With at least W shards each rank reads only shards r, r + W, ... (the set is read once in all): every
    sample once, the gathered order (sorted by index) that of one process, for W = 2, 3, 4 over 4 shards;
    --val-num-samples keeps the first N in shard order where sizes.json places each shard, and falls back to
    samples i % W == rank (every rank reading) where it does not."""
    from ds_clip.data.wds import SkipCounter, expand_urls
    from ds_clip.evaluate.datasets import _wds_raw

    for sizes in (True, False):
        urls = expand_urls(_val_shards(tmp_path / f"s{sizes}", 4, 5, sizes), "--val-data")
        for limit in (None, 13):
            one = [raw.key for _, _, raw in _wds_raw(urls, 0, 1, limit, SkipCounter())]
            assert len(one) == (limit or 20)
            for world in (2, 3, 4):
                got = {}
                for rank in range(world):
                    for index, url, raw in _wds_raw(urls, rank, world, limit, SkipCounter()):
                        assert index not in got
                        got[index] = raw.key
                        if limit is None or sizes:  # its own shards only
                            assert urls.index(url) % world == rank, (world, rank, url)
                        else:
                            assert index % world == rank
                assert [got[i] for i in sorted(got)] == one, (sizes, limit, world)

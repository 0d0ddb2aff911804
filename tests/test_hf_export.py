"""ds-clip-export's two formats end to end: runs trained by the real CLI (a CLIP under the deepspeed launcher on 2
ranks, a SigLIP-trained CLIP, a SigLIP-architecture model and a CoCa as single processes), exported as open_clip and
as transformers folders (CLIPModel, SiglipModel), loaded by open_clip and by transformers (offline), and compared:
features, token ids, preprocessing, model cards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ds_clip.distributed import _free_port
from ds_clip.export.hf_clip import unmappable
from ds_clip.export.openclip import main as export_main
from ds_clip_harness.models import (
    COCA_E2E_MODEL,
    CONFIGS,
    E2E_MODEL,
    SIGLIP_E2E_MODEL,
    SIGLIP_PREPROCESS,
    write_siglip_dir,
)
from tests.test_e2e import _run

transformers = pytest.importorskip("transformers")

# Every test here runs again in tests/test_install.py with the newest transformers.
pytestmark = [pytest.mark.newest_clients]

# Captions of several lengths: short, with punctuation ("!" is also the pad token's text), mixed case and
# spacing, and one longer than the context length (truncated, end-of-text kept last).
CAPTIONS = [
    "a red circle",
    "Wow!!! a BLUE   square, on a white background; 2 of them.",
    "a photo of a triangle!",
    " ".join(["a green diamond next to a yellow circle"] * 8),
]
TRAIN = ["--batch-size", "4", "--max-steps", "2", "--workers", "1", "--report-to", "csv", "--warmup", "1"]


def _train(cmd: list[str]) -> None:
    proc = _run(cmd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Four trained runs: 'clip' (ds-clip-tiny, deepspeed launcher, 2 ranks, validation and zero-shot at the end),
    'siglip' (ds-clip-tiny-siglip with --siglip, ds-clip-train, k = 2), 'siglip_vit' (the SigLIP architecture of
    open_clip's SigLIP configs: a timm vit_*_siglip_* tower, its Hugging Face tokenizer in the model's folder, with
    --siglip) and 'coca' (a tiny CoCa, one step)."""
    root = tmp_path_factory.mktemp("hf_runs")
    classes = root / "classes.json"
    classes.write_text(json.dumps({"classnames": ["circle", "square", "triangle", "diamond"]}))
    coca = root / "coca_model"
    coca.mkdir()
    (coca / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": COCA_E2E_MODEL, "preprocess_cfg": {}})
    )
    logs = ["--logs", str(root / "logs")]
    _train([
        "deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "--module", "ds_clip.train",
        "--model", "ds-clip-tiny", "--name", "clip", *logs, *TRAIN, "--val-data", "synthetic",
        "--val-num-samples", "16", "--zeroshot-classes", str(classes),
    ])  # fmt: skip
    _train(["ds-clip-train", "--model", "ds-clip-tiny-siglip", "--siglip", "--accum-freq", "2", "--name", "siglip", *logs, *TRAIN])  # fmt: skip
    _train(["ds-clip-train", "--model", f"local-dir:{coca}", "--name", "coca", *logs, *TRAIN[:2], "--max-steps", "1", "--workers", "1"])  # fmt: skip
    siglip_vit = write_siglip_dir(root / "siglip_model")
    _train(["ds-clip-train", "--model", siglip_vit, "--siglip", "--name", "siglip_vit", *logs, *TRAIN])  # fmt: skip
    return {name: root / "logs" / name for name in ("clip", "siglip", "siglip_vit", "coca")}


def _export(capsys, run: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    rc = export_main([str(run), str(out), *extra])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _images() -> list:
    """RGB images whose resize + centre crop land on the same pixels in torchvision and transformers (an even
    number of pixels cropped: docs/checkpoints.md says why)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
        for h, w in ((64, 64), (80, 96), (72, 50), (200, 120))
    ]


def _processed_pixels(hf_dir: Path, preprocess, std: list[float], levels: int = 1) -> torch.Tensor:
    """The export's image processor gives open_clip's eval transform's pixels on _images(): the PIL one (transformers
    4.x's default) resizes as torchvision does on PIL images, the same pixels; the torch one (5.x's default,
    use_fast=True) resizes with torch, a few pixels within ``levels`` 8-bit levels. Returns the PIL one's pixels."""
    from transformers import AutoProcessor

    images = _images()
    expected = torch.stack([preprocess(im) for im in images])
    pil = AutoProcessor.from_pretrained(hf_dir, use_fast=False, local_files_only=True).image_processor
    pixels = pil(images=images, return_tensors="pt")["pixel_values"]
    _close(pixels, expected, 1e-5)
    fast = AutoProcessor.from_pretrained(hf_dir, use_fast=True, local_files_only=True).image_processor
    _close(
        fast(images=images, return_tensors="pt")["pixel_values"], expected, (levels + 0.01) / 255 / min(std)
    )
    return pixels


def _features(out) -> torch.Tensor:
    """get_image_features / get_text_features: a tensor in transformers 4.x, an output whose pooler_output holds
    the projected features in 5.x."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() <= tol, (a - b).abs().max().item()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_transformers_export_equals_open_clip(runs, tmp_path, capsys, name):
    """`ds-clip-export RUN OUT --format transformers` of a trained run loads offline with AutoModel, CLIPModel,
    CLIPVisionModel(WithProjection), CLIPTextModel(WithProjection), AutoTokenizer and AutoProcessor, and equals the
    open_clip export of the same checkpoint loaded by open_clip: image and text features (<= 1e-4, fp32; random
    pixels and processed images; captions of four lengths, one truncated), logits, token ids position by position
    (padding included), and the processor's resize, crop and normalisation (its settings, and its pixels: equal
    with the PIL image processor, within one 8-bit level with the torch one). A
    SigLIP-trained CLIP keeps its logit_bias in the config. Both folders carry a model card, and the export prints
    the hub's upload command."""
    import open_clip
    from transformers import (
        AutoModel,
        AutoProcessor,
        AutoTokenizer,
        CLIPModel,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        CLIPVisionModel,
        CLIPVisionModelWithProjection,
    )

    hf_dir, oc_dir = tmp_path / "hf", tmp_path / "oc"
    rc, out, err = _export(capsys, runs[name], hf_dir, "--format", "transformers")
    assert rc == 0, err
    assert f"hf upload YOUR_ORG/YOUR_MODEL {hf_dir} . --repo-type model" in out
    rc, out, err = _export(capsys, runs[name], oc_dir)
    assert rc == 0, err
    assert f"hf upload YOUR_ORG/YOUR_MODEL {oc_dir} . --repo-type model" in out

    oc_model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{oc_dir}")
    oc_model.eval()
    tokenizer = open_clip.get_tokenizer(f"local-dir:{oc_dir}")
    load = {"local_files_only": True}
    model = AutoModel.from_pretrained(hf_dir, **load).eval()
    assert type(model) is CLIPModel
    processor = AutoProcessor.from_pretrained(hf_dir, **load)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir, **load)
    context = oc_model.context_length

    # Token ids: open_clip's tokenizer (padded with 0 to the context length, truncated with end-of-text last).
    ids = tokenizer(CAPTIONS)
    hf_ids = hf_tok(CAPTIONS, padding="max_length", truncation=True, return_tensors="pt")["input_ids"]
    assert hf_ids.shape[1] == context and torch.equal(hf_ids, ids), (hf_ids, ids)
    assert ids[-1, -1].item() == 49407 and (ids[:, -1] == 49407).sum() == 1  # the long caption was truncated

    # Preprocessing: the processor's settings are the model's preprocess config, and its pixels open_clip's.
    cfg = json.loads((oc_dir / "open_clip_config.json").read_text())["preprocess_cfg"]
    ip = processor.image_processor
    side = cfg["size"][0]
    assert ip.size == {"shortest_edge": side} and ip.crop_size == {"height": side, "width": side}
    assert ip.do_center_crop and ip.resample == 3 and cfg["interpolation"] == "bicubic"
    assert np.allclose(ip.image_mean, cfg["mean"]) and np.allclose(ip.image_std, cfg["std"])
    pixels = _processed_pixels(hf_dir, preprocess, cfg["std"])

    pixels = torch.cat([pixels, torch.randn(2, 3, side, side)])
    inputs = processor(text=CAPTIONS, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        img, txt = oc_model.encode_image(pixels), oc_model.encode_text(ids)
        _close(_features(model.get_image_features(pixel_values=pixels)), img)
        _close(
            _features(model.get_text_features(**inputs)), txt
        )  # padded to the longest caption only: same features
        got = model(pixel_values=pixels, **inputs)
        scale = oc_model.logit_scale.exp()
        _close(got.logits_per_image, scale * (img / img.norm(dim=-1, keepdim=True)) @ (txt / txt.norm(dim=-1, keepdim=True)).T)  # fmt: skip
        # Each tower alone.
        vision = CLIPVisionModelWithProjection.from_pretrained(hf_dir, **load).eval()
        _close(vision(pixel_values=pixels).image_embeds, img)
        text = CLIPTextModelWithProjection.from_pretrained(hf_dir, **load).eval()
        _close(text(**inputs).text_embeds, txt)
        pooled = CLIPVisionModel.from_pretrained(hf_dir, **load).eval()(pixel_values=pixels).pooler_output
        _close(pooled @ model.visual_projection.weight.T, img)
        pooled = CLIPTextModel.from_pretrained(hf_dir, **load).eval()(**inputs).pooler_output
        _close(pooled @ model.text_projection.weight.T, txt)
    if name == "siglip":
        assert model.config.logit_bias == pytest.approx(oc_model.logit_bias.item(), abs=1e-6)
    else:
        assert getattr(model.config, "logit_bias", None) is None

    for folder, library in ((hf_dir, "transformers"), (oc_dir, "open_clip")):
        card = (folder / "README.md").read_text()
        model_name = "ds-clip-tiny-siglip" if name == "siglip" else "ds-clip-tiny"
        for needle in (
            f"library_name: {library}",
            "# license: FILL IN before sharing",
            f"| model | `{model_name}`",
            "| global batch | 8 pairs per optimizer step (W = 2 ranks x k = 1" if name == "clip" else
            "| global batch | 8 pairs per optimizer step (W = 1 rank x k = 2",
            "| steps | 2 ",
            "| precision | fp32, DeepSpeed ZeRO stage",
            f"ds-clip-train --model {model_name} ",
            f"--name {name} --logs",
            f"ds-clip-export {runs[name]} {folder}",
            "SigLIP (sigmoid loss)" if name == "siglip" else "CLIP (softmax contrastive loss)",
        ):  # fmt: skip
            assert needle in card, (needle, card)
        if name == "clip":
            assert "| zeroshot_top1 |" in card and "| i2t_R@1 |" in card
        else:
            assert "No validation or zero-shot results" in card


@pytest.mark.e2e
@pytest.mark.slow
def test_siglip_architecture_exports_as_siglip_model(runs, tmp_path, capsys):
    """A SigLIP-architecture run (timm vit_*_siglip_* tower with MAP pooling, bidirectional text tower pooled at its
    last position, a Hugging Face tokenizer with open_clip's canonicalize cleaning), trained with --siglip and
    exported with --format transformers, loads offline as SiglipModel (AutoModel), SiglipVisionModel,
    SiglipTextModel, AutoTokenizer and AutoProcessor (SiglipProcessor), and equals the open_clip export loaded by
    open_clip: image and text features (<= 1e-4, fp32; captions of five lengths, punctuation, case and "_" cleaned,
    one truncated), logits with the learnt bias and the sigmoid pair probabilities, token ids position by position
    (no attention mask returned), and the processor's squash resize and normalisation (settings and pixels). The
    mapping uses every open_clip tensor: one more is refused by name. The model card names SiglipModel."""
    import open_clip
    from transformers import (
        AutoModel,
        AutoProcessor,
        AutoTokenizer,
        SiglipModel,
        SiglipProcessor,
        SiglipTextModel,
        SiglipVisionModel,
    )

    from ds_clip.export.hf_siglip import siglip_state_dict
    from ds_clip.export.hf_towers import UnmappableError

    hf_dir, oc_dir = tmp_path / "hf", tmp_path / "oc"
    for folder, fmt in ((hf_dir, "transformers"), (oc_dir, "open_clip")):
        rc, out, err = _export(capsys, runs["siglip_vit"], folder, "--format", fmt)
        assert rc == 0, err
    oc_model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{oc_dir}")
    oc_model.eval()
    tokenizer = open_clip.get_tokenizer(f"local-dir:{oc_dir}")
    load = {"local_files_only": True}
    model = AutoModel.from_pretrained(hf_dir, **load).eval()
    assert type(model) is SiglipModel and model.config.architectures == ["SiglipModel"]
    processor = AutoProcessor.from_pretrained(hf_dir, **load)
    assert type(processor) is SiglipProcessor
    hf_tok = AutoTokenizer.from_pretrained(hf_dir, **load)

    # Token ids: open_clip's HFTokenizer (cleaned, padded to the context length, end-of-text 1 kept last when cut).
    captions = [*CAPTIONS, "a_small  STAR... in the top_left"]
    ids = tokenizer(captions)
    got = hf_tok(captions, padding="max_length", truncation=True, return_tensors="pt")
    assert list(got) == ["input_ids"] and torch.equal(got["input_ids"], ids), (got["input_ids"], ids)
    assert ids.shape[1] == oc_model.context_length and ids[3, -1].item() == 1  # the long caption was cut
    assert (ids == 2).sum() == 0  # every word known: the cleaning (punctuation, case, "_") happened in both

    # Preprocessing: squash to the tower's square size, bicubic, the model's mean and std; the same pixels.
    cfg = json.loads((oc_dir / "open_clip_config.json").read_text())["preprocess_cfg"]
    assert {k: cfg[k] for k in SIGLIP_PREPROCESS} == SIGLIP_PREPROCESS
    ip = processor.image_processor
    assert ip.size == {"height": 256, "width": 256} and ip.resample == 3 and ip.do_resize
    assert not getattr(ip, "do_center_crop", False)
    assert np.allclose(ip.image_mean, cfg["mean"]) and np.allclose(ip.image_std, cfg["std"])
    pixels = _processed_pixels(hf_dir, preprocess, cfg["std"], levels=2)  # upsampled to 256: torch's bicubic
    pixels = torch.cat([pixels, torch.randn(2, 3, 256, 256)])
    inputs = processor(text=captions, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        img, txt = oc_model.encode_image(pixels), oc_model.encode_text(ids)
        _close(_features(model.get_image_features(pixel_values=pixels)), img)
        _close(_features(model.get_text_features(**inputs)), txt)
        out = model(pixel_values=pixels, **inputs)
        logits = oc_model.logit_scale.exp() * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
        logits = logits + oc_model.logit_bias
        _close(out.logits_per_image, logits)
        _close(torch.sigmoid(out.logits_per_image), torch.sigmoid(logits))
        direct = SiglipModel.from_pretrained(hf_dir, **load).eval()
        _close(direct(pixel_values=pixels, **inputs).logits_per_image, logits)
        vision = SiglipVisionModel.from_pretrained(hf_dir, **load).eval()
        _close(vision(pixel_values=pixels).pooler_output, img)
        text = SiglipTextModel.from_pretrained(hf_dir, **load).eval()
        _close(text(**inputs).pooler_output, txt)
    assert model.logit_bias.item() == pytest.approx(oc_model.logit_bias.item(), abs=1e-6)
    assert model.logit_scale.item() == pytest.approx(oc_model.logit_scale.item(), abs=1e-6)

    state = dict(oc_model.state_dict())
    state["visual.trunk.blocks.0.ls1.gamma"] = torch.ones(768)
    with pytest.raises(
        UnmappableError, match=r"visual\.trunk\.blocks\.0\.ls1\.gamma cannot be mapped .* SiglipModel"
    ):
        siglip_state_dict(state)
    card = (hf_dir / "README.md").read_text()
    assert (
        "# SiglipModel" in card and "SiglipModel's `logit_bias`" in card and "SigLIP (sigmoid loss)" in card
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_unmappable_model_and_missing_transformers_are_refused_before_writing(
    runs, tmp_path, capsys, monkeypatch
):
    """A CoCa run exported with --format transformers is refused in one line naming CoCa's text decoder, exit 2,
    nothing written (its open_clip export still works, with a model card); without transformers installed the
    transformers format is refused in one line naming `pip install 'ds_clip[hf]'`, exit 2, nothing written."""
    out = tmp_path / "coca_hf"
    rc, _, err = _export(capsys, runs["coca"], out, "--format", "transformers")
    assert rc == 2 and err.strip().count("\n") == 0, err
    assert "CoCa's text decoder (multimodal_cfg) cannot be mapped to transformers' CLIPModel" in err
    assert not out.exists()
    rc, _, err = _export(capsys, runs["coca"], tmp_path / "coca_oc")
    assert rc == 0 and (tmp_path / "coca_oc" / "README.md").is_file(), err

    monkeypatch.setitem(
        sys.modules, "transformers", None
    )  # what `import transformers` meets when not installed
    out = tmp_path / "no_transformers"
    rc, _, err = _export(capsys, runs["clip"], out, "--format", "transformers")
    assert rc == 2 and err.strip().count("\n") == 0 and "pip install 'ds_clip[hf]'" in err, err
    assert not out.exists()


def _siglip(vision: dict | None = None, text: dict | None = None, **top) -> dict:
    """SIGLIP_E2E_MODEL with some of its settings changed."""
    return {
        **SIGLIP_E2E_MODEL,
        **top,
        "vision_cfg": {**SIGLIP_E2E_MODEL["vision_cfg"], **(vision or {})},
        "text_cfg": {**SIGLIP_E2E_MODEL["text_cfg"], "hf_tokenizer_name": "tok", **(text or {})},
    }


@pytest.mark.parametrize(
    "model_cfg, preprocess_cfg, needle",
    [
        (CONFIGS["coca"], {}, "CoCa's text decoder"),
        (CONFIGS["timm_dropout"], {}, "the timm image tower 'test_vit'"),
        (CONFIGS["resnet_bn"], {}, "the ResNet image tower"),
        (
            {**E2E_MODEL, "text_cfg": {"hf_model_name": "roberta-base"}},
            {},
            "the Hugging Face text tower 'roberta-base'",
        ),
        (
            {**E2E_MODEL, "vision_cfg": {**E2E_MODEL["vision_cfg"], "attentional_pool": True}},
            {},
            "attentional pooler",
        ),
        ({**E2E_MODEL, "vision_cfg": {**E2E_MODEL["vision_cfg"], "pool_type": "avg"}}, {}, "pool_type='avg'"),
        ({**E2E_MODEL, "vision_cfg": {**E2E_MODEL["vision_cfg"], "ls_init_value": 0.1}}, {}, "layer scale"),
        ({**E2E_MODEL, "text_cfg": {**E2E_MODEL["text_cfg"], "pool_type": "last"}}, {}, "pool_type='last'"),
        ({**E2E_MODEL, "text_cfg": {**E2E_MODEL["text_cfg"], "no_causal_mask": True}}, {}, "causal mask"),
        (
            {**E2E_MODEL, "text_cfg": {**E2E_MODEL["text_cfg"], "hf_tokenizer_name": "t5-base"}},
            {},
            "'t5-base'",
        ),
        (E2E_MODEL, {"resize_mode": "longest"}, "resize_mode 'longest'"),
        (CONFIGS["vit"], {}, "text_cfg.vocab_size 64"),
        (E2E_MODEL, {"resize_mode": "squash"}, None),
        ({**E2E_MODEL, "quick_gelu": True, "custom_text": True}, {}, None),
        # The SigLIP architecture (SiglipModel): open_clip's published configs map; what SiglipModel lacks is named.
        (_siglip(), SIGLIP_PREPROCESS, None),
        ("ViT-B-16-SigLIP", {**SIGLIP_PREPROCESS, "size": 224}, None),
        ("ViT-SO400M-14-SigLIP2", {}, "resize_mode 'shortest'"),
        (_siglip(vision={"timm_model_name": "vit_base_patch16_siglip_gap_224", "timm_pool": "avg"}), {}, "timm_pool 'avg'"),
        (_siglip(vision={"timm_model_name": "vit_small_patch16_224"}), {}, "'vit_small_patch16_224' (vision_cfg.timm_model_name: its class or register tokens)"),
        (_siglip(vision={"timm_model_name": "eva02_tiny_patch14_224"}), {}, "'eva02_tiny_patch14_224' (vision_cfg.timm_model_name; SiglipModel holds"),
        (_siglip(vision={"timm_proj": "linear"}), {}, "timm_proj='linear'"),
        (_siglip(embed_dim=512), {}, "embed_dim 512"),
        (_siglip(text={"no_causal_mask": False}), {}, "causal mask"),
        (_siglip(text={"pool_type": "argmax"}), {}, "pool_type='argmax'"),
        (_siglip(text={"proj_bias": False}), {}, "proj_bias"),
        (_siglip(text={"hf_tokenizer_name": None}), {}, "open_clip's CLIP tokenizer"),
        (_siglip(text={"tokenizer_kwargs": {"clean": "canonicalize", "strip_sep_token": True}}), {}, "strip_sep_token"),
        (_siglip(text={"ls_init_value": 0.1}), {}, "layer scale (text_cfg.ls_init_value)"),
        (_siglip(init_logit_bias=None), SIGLIP_PREPROCESS, "without logit_bias"),
        (_siglip(), {**SIGLIP_PREPROCESS, "size": 224}, "preprocess_cfg size 224"),
    ],
)  # fmt: skip
def test_what_transformers_cannot_represent_is_named(model_cfg, preprocess_cfg, needle):
    """Each open_clip feature transformers' CLIPModel or SiglipModel lacks is named (the export's one-line refusal);
    CLIP's own variants (QuickGELU, a CustomTextCLIP text tower, squash resizing) map to CLIPModel, open_clip's
    published SigLIP configs (a name: open_clip's own config) and the test's tiny one to SiglipModel."""
    import open_clip

    if isinstance(model_cfg, str):
        model_cfg = open_clip.get_model_config(model_cfg)
    problem = unmappable(model_cfg, preprocess_cfg)
    assert (problem is None) if needle is None else (needle in (problem or "")), problem


def test_model_card_reads_what_the_run_recorded(tmp_path):
    """The card quotes every launch of the run (the launcher's --local_rank dropped), the evaluation of the
    exported step or the last one before it, and says what the run did not record instead of guessing."""
    from ds_clip.export.model_card import card_text, launch_command

    run = tmp_path / "run1"
    ckpt = run / "checkpoints" / "step_00000006"
    ckpt.mkdir(parents=True)
    (run / "command.txt").write_text(
        launch_command(["--local_rank=1", "--name", "run1", "--lr", "1e-3"]) + "\n"
        + launch_command(["--name", "run1", "--resume", "latest"]) + "\n"
    )  # fmt: skip
    (run / "eval_results.json").write_text(
        json.dumps([{"step": 4, "zeroshot_top1": 0.5}, {"step": 8, "zeroshot_top1": 0.9}])
    )
    meta = {
        "step": 6, "model": "ds-clip-tiny", "model_cfg": E2E_MODEL, "world_size": 4, "accum_freq": 2,
        "micro_batch_size": 8, "global_batch_size": 64, "precision": "bf16", "zero_stage": 2,
        "settings": {"siglip": False, "name": "run1", "train_data": "/data/{00000..00099}.tar", "dataset_type": "webdataset"},
    }  # fmt: skip
    card = card_text(
        meta=meta, checkpoint=ckpt, fmt="open_clip", weights="trained weights", command="ds-clip-export x y"
    )
    assert "ds-clip-train --name run1 --lr 1e-3\nds-clip-train --name run1 --resume latest\n" in card
    assert "Validation at step 4" in card and "| zeroshot_top1 | 0.5 |" in card and "0.9" not in card
    assert (
        "| global batch | 64 pairs per optimizer step (W = 4 ranks x k = 2 micro-batches x m = 8 pairs at this "
        "checkpoint) |" in card
    )
    assert (
        "| precision | bf16, DeepSpeed ZeRO stage 2 |" in card
        and "`/data/{00000..00099}.tar` (webdataset)" in card
    )
    elsewhere = tmp_path / "step_00000006"  # a checkpoint copied out of its run folder
    elsewhere.mkdir()
    card = card_text(
        meta=meta, checkpoint=elsewhere, fmt="transformers", weights="trained weights", command="x"
    )
    assert (
        "(not recorded: the run folder has no command.txt)" in card
        and "No validation or zero-shot results" in card
    )


@pytest.fixture(scope="module")
def clip_export(tmp_path_factory) -> Path:
    """A transformers export of a fresh ds-clip-tiny-shaped open_clip model (E2E_MODEL, random weights), written by
    the export's own build and save (no training: what is checked is the folder and its tokenizer)."""
    import open_clip

    from ds_clip.export import hf_clip
    from ds_clip.export.openclip import build_open_clip_model

    model = build_open_clip_model(E2E_MODEL, {})
    state = {k: v.float() for k, v in model.state_dict().items()}
    built = hf_clip.build_transformers(state, E2E_MODEL, open_clip.get_model_preprocess_cfg(model))
    folder = tmp_path_factory.mktemp("clip_export")
    hf_clip.save_transformers(folder, built)
    return folder


def test_transformers_export_holds_the_files_of_transformers_4_and_5(clip_export):
    """The folder holds what transformers 4.x reads and what 5.x reads, whichever version wrote it: 5.x saves the
    image processor inside processor_config.json and the tokenizer as tokenizer.json alone, which 4.x's
    AutoProcessor, CLIPProcessor and zero-shot pipeline refuse (no preprocessor_config.json, a nested image
    processor, the tokenizer class TokenizersBackend). Loaded here with this transformers; tests/test_install.py
    loads each version's export with the other."""
    from PIL import Image
    from transformers import AutoProcessor, CLIPProcessor, pipeline

    folder = clip_export
    names = {p.name for p in folder.iterdir()}
    need = {"config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"}  # fmt: skip
    assert need <= names, sorted(names)
    if "processor_config.json" in names:  # 5.x: its nested image processor is one 4.x cannot take
        held = json.loads((folder / "processor_config.json").read_text())
        assert not [k for k, v in held.items() if isinstance(v, dict)], held
    assert (
        json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
        != "TokenizersBackend"
    )
    assert json.loads((folder / "preprocessor_config.json").read_text())["image_processor_type"].startswith(
        "CLIPImageProcessor"
    )
    assert type(AutoProcessor.from_pretrained(folder, local_files_only=True)) is CLIPProcessor
    CLIPProcessor.from_pretrained(folder, local_files_only=True)
    image = Image.fromarray(np.zeros((40, 48, 3), np.uint8), "RGB")
    scores = pipeline("zero-shot-image-classification", model=str(folder))(image, candidate_labels=["a", "b"])
    assert (
        sorted(s["label"] for s in scores) == ["a", "b"] and abs(sum(s["score"] for s in scores) - 1) < 1e-5
    )


# Captions a crawl holds: HTML entities, mojibake (UTF-8 read as Latin-1), curly quotes, emoji, CJK, accents.
REAL_CAPTIONS = [
    "rock &amp; roll",
    "Tom &#39;n&#39; Jerry &lt;3 &quot;cartoon&quot;",
    "cafÃ© au lait on a table",
    "\u201ccurly quotes\u201d and \ufb01ne ligatures",
    "a dog \U0001f436 running on the beach \U0001f3d6\ufe0f",
    "\u4e00\u53ea\u732b\u5750\u5728\u6905\u5b50\u4e0a",
    "\u6771\u4eac\u30bf\u30ef\u30fc at night",
    "Cr\u00e8me br\u00fbl\u00e9e \u00e0 la fran\u00e7aise",
    "  spaces\tand\nnewlines  ",
]


def test_exported_tokenizer_ids_on_real_captions(clip_export, tmp_path):
    """open_clip cleans a caption (ftfy.fix_text, html.unescape, whitespace, lower case) before its BPE; the
    exported CLIP tokenizer collapses whitespace and lower-cases only. On captions without entities or mojibake
    (emoji, CJK, accents, odd spacing) the ids are open_clip's as they are; on every caption they are after
    open_clip's basic_clean, the one call the model card gives; the card says which captions differ."""
    import open_clip
    from open_clip.tokenizer import basic_clean
    from transformers import AutoTokenizer

    from ds_clip.export.model_card import card_text

    folder = clip_export
    hf_tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    context = E2E_MODEL["text_cfg"].get("context_length", 77)
    oc = open_clip.tokenize  # open_clip's SimpleTokenizer, as open_clip.get_tokenizer gives E2E_MODEL
    expected = oc(REAL_CAPTIONS, context_length=context)

    def ids(texts):
        return hf_tok(texts, padding="max_length", truncation=True, return_tensors="pt")["input_ids"]

    assert torch.equal(ids([basic_clean(t) for t in REAL_CAPTIONS]), expected)
    raw = ids(REAL_CAPTIONS)
    differ = [t for t, a, b in zip(REAL_CAPTIONS, raw, expected) if not torch.equal(a, b)]
    assert differ == REAL_CAPTIONS[:4], differ  # entities, mojibake, curly quotes and ligatures
    meta = {"step": 1, "model_cfg": E2E_MODEL, "settings": {}}
    card = card_text(meta=meta, checkpoint=tmp_path / "step_1", fmt="transformers", weights="w", command="x")
    for needle in ("`basic_clean`", "`html.unescape`", "ftfy's `fix_text`", "&amp;",
                   "processor(text=[basic_clean(t) for t in texts]", "use 4.42 or later for captions with a \"!\""):  # fmt: skip
        assert needle in card, (needle, card)


def test_card_redacts_credentials_and_keeps_command_txt_whole(tmp_path):
    """A published card never carries the run's secrets: a pipe: source's header value, a URL's user-info, a
    signed query string (S3, Azure SAS), curl -u, a secret-named variable are REDACTED in the data line and the
    command lines, the card says so, and the shell quoting of each line still reads as one argument per flag;
    command.txt itself is untouched."""
    import shlex

    from ds_clip.export.model_card import card_text, launch_command

    secrets = ["abc123tok", "hunter2", "deadbeefsig", "AKIAXXXX", "sasSIG", "s3cr3t", "alicepw"]
    data = ("pipe:curl -L -s -H 'Authorization: Bearer abc123tok' https://bob:hunter2@host/{0..9}.tar "
            "::https://b.s3.amazonaws.com/x.tar?X-Amz-Credential=AKIAXXXX&X-Amz-Signature=deadbeefsig&X-Amz-Expires=60")  # fmt: skip
    run = tmp_path / "run1"
    ckpt = run / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    lines = [
        launch_command(["--train-data", data, "--name", "run1"]),
        launch_command(["--train-data", "pipe:AWS_SECRET_ACCESS_KEY=s3cr3t curl -u alice:alicepw https://h/a.tar",
                        "--val-data", "https://a.blob.core.windows.net/c/v.tar?sv=1&sig=sasSIG", "--resume", "latest"]),
    ]  # fmt: skip
    (run / "command.txt").write_text("\n".join(lines) + "\n")
    meta = {"step": 2, "model_cfg": E2E_MODEL, "settings": {"train_data": data, "dataset_type": "webdataset"}}
    card = card_text(meta=meta, checkpoint=ckpt, fmt="open_clip", weights="w", command="x")
    assert not [s for s in secrets if s in card], card
    assert "Authorization: REDACTED" in card and "https://REDACTED@host" in card
    assert "X-Amz-Signature=REDACTED" in card and "X-Amz-Expires=60" in card and "sig=REDACTED" in card
    assert "shown as REDACTED; the run folder's command.txt keeps them whole" in card
    shown = card.split("```bash\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert [shlex.split(ln)[1:3:1][0] for ln in shown] == ["--train-data", "--train-data"]
    assert (run / "command.txt").read_text() == "\n".join(lines) + "\n"
    assert all(s in (run / "command.txt").read_text() for s in secrets)
    elsewhere = tmp_path / "step_00000002"  # no run folder, no command.txt: the data line alone
    elsewhere.mkdir()
    card = card_text(meta=meta, checkpoint=elsewhere, fmt="open_clip", weights="w", command="x")
    assert not [s for s in secrets if s in card] and "shown as REDACTED" in card


def test_card_names_each_launch_geometry_ema_results_first_and_sigmoid_use(tmp_path):
    """A run trained on 2 ranks x k = 4 and resumed on 1 rank x k = 8: the card gives each launch its own W and k
    (command.txt records them beside each line) and the global batch at the exported checkpoint. An EMA export
    lists the weight EMA's metrics first (eval_results.json's ema/ keys), a live export the live ones. A
    CLIP-architecture model trained with the SigLIP loss exported as CLIPModel shows sigmoid(logits_per_image +
    logit_bias) and is not tagged for the zero-shot pipeline (its softmax); a CLIP-trained one is."""
    from ds_clip.export.model_card import card_text, launch_command
    from ds_clip.geometry import BatchGeometry

    run = tmp_path / "run1"
    ckpt = run / "checkpoints" / "step_00000008"
    ckpt.mkdir(parents=True)
    (run / "command.txt").write_text(
        launch_command(["--local_rank=0", "--name", "run1", "--accum-freq", "4"], BatchGeometry(2, 4, 8)) + "\n"
        + launch_command(["--name", "run1", "--accum-freq", "8", "--resume", "latest"], BatchGeometry(1, 8, 8)) + "\n"
    )  # fmt: skip
    (run / "eval_results.json").write_text(
        json.dumps([{"step": 8, "zeroshot_top1": 0.25, "ema/zeroshot_top1": 0.75}])
    )
    meta = {"step": 8, "model_cfg": E2E_MODEL, "world_size": 1, "accum_freq": 8, "micro_batch_size": 8,
            "global_batch_size": 64, "settings": {"siglip": True, "ema_decay": 0.99}}  # fmt: skip
    card = card_text(meta=meta, checkpoint=ckpt, fmt="transformers", weights="weight EMA", command="x",
                     logit_bias=-10.0, ema=True)  # fmt: skip
    assert "ds-clip-train --name run1 --accum-freq 4  # W = 2 ranks x k = 4 x m = 8\n" in card
    assert "--resume latest  # W = 1 rank x k = 8 x m = 8\n" in card
    assert "(W = 1 rank x k = 8 micro-batches x m = 8 pairs at this checkpoint)" in card
    assert "on 1 ranks" not in card and "1 ranks" not in card
    ema_row, live_row = (
        "| weight EMA (exported) | zeroshot_top1 | 0.75 |",
        "| live weights | zeroshot_top1 | 0.25 |",
    )
    assert card.index(ema_row) < card.index(live_row), card
    assert "torch.sigmoid(out.logits_per_image + model.config.logit_bias)" in card
    assert "pipeline_tag" not in card and "zero-shot-image-classification]" not in card
    live = card_text(meta={**meta, "settings": {"siglip": False}}, checkpoint=ckpt, fmt="transformers",
                     weights="trained weights", command="x")  # fmt: skip
    assert live.index("| live weights (exported) | zeroshot_top1 | 0.25 |") < live.index(
        "| weight EMA | zeroshot_top1 | 0.75 |"
    )
    assert "pipeline_tag: zero-shot-image-classification" in live and "sigmoid" not in live


def test_eval_of_a_transformers_folder_says_so_in_one_line(clip_export, capsys):
    """ds-clip-eval given a transformers export folder answers in one line that it is one and what to pass
    instead, not with open_clip's list of ~150 built-in model names."""
    from ds_clip.evaluate.cli import main as eval_main

    folder = clip_export
    rc = eval_main([str(folder), "--val-data", "synthetic"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{folder} is a transformers folder (config.json, model_type clip)" in err
    assert "ds-clip-export RUN OUT" in err and "built-ins" not in err


# ------------------------------------------------------------------------------------------- SigLIP 2 exports


def _settings(*flags: str) -> dict:
    """settings.json of a run launched with ``flags`` (the flat settings the trainer writes and saves)."""
    from ds_clip.config import parse_settings, settings_to_dict

    return settings_to_dict(parse_settings(["--model", "ds-clip-tiny-siglip", *flags]))


def _saved_run(
    run: Path, config: dict, state: dict, settings: dict, ema: dict | None = None, teacher: dict | None = None
) -> Path:
    """A run folder as a ZeRO-0 save leaves it, no engine: settings.json, and a checkpoint with DeepSpeed's model
    state file holding ``state`` (the module's keys), the meta, manifest, marker and pointer; ``ema``: the weight
    EMA of those parameters as ``ema_rank0.pt`` (ds_clip.step.ema's ZeRO-0 layout, one flat partition);
    ``teacher``: a --siglip2 run's EMA teacher, the file of its own beside them."""
    from ds_clip import checkpoint as ck
    from ds_clip.checkpoint.manifest import _manifest

    root = run / "checkpoints"
    path = root / ck.tag_for(4)
    path.mkdir(parents=True)
    (run / "settings.json").write_text(json.dumps(settings))
    torch.save({"module": state}, path / "mp_rank_00_model_states.pt")
    if ema is not None:
        fragments, offset = [], 0
        for name, value in ema.items():
            fragments.append((name, offset, 0, value.numel()))
            offset += value.numel()
        flat = torch.cat([v.reshape(-1) for v in ema.values()])
        torch.save({"format": 1, "kind": "zero0-fp32", "world_size": 1, "updates": 4, "flats": [flat],
                    "fragments": [fragments], "shapes": {n: list(v.shape) for n, v in ema.items()}},
                   path / "ema_rank0.pt")  # fmt: skip
    if teacher is not None:
        torch.save(teacher, path / "siglip2_teacher.pt")
    meta = {"step": 4, "model": "ds-clip-tiny-siglip", **config, "settings": settings}
    (path / ck.META).write_text(json.dumps(meta))
    (path / ck.MANIFEST).write_text(json.dumps(_manifest(path, None)))
    (path / ck.MARKER).write_text("4")
    (root / ck.POINTER).write_text(path.name)
    return run


def _training_parts(width: int) -> dict[str, torch.Tensor]:
    """Tensors a --siglip2 model holds under its ``siglip2`` attribute: a decoder layer, a head, the mask token."""
    g = torch.Generator().manual_seed(1)
    return {
        "siglip2.decoder.layers.0.cross_attn.in_proj_weight": torch.randn(3 * width, width, generator=g),
        "siglip2.decoder.layers.0.cross_attn.in_proj_bias": torch.randn(3 * width, generator=g),
        "siglip2.silc_head.weight": torch.randn(16, width, generator=g),
        "siglip2.mask_token": torch.randn(1, 1, width, generator=g),
    }


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of an export folder, either format."""
    from safetensors.torch import load_file

    name = "model.safetensors" if (folder / "config.json").exists() else "open_clip_model.safetensors"
    return load_file(str(folder / name))


@pytest.mark.parametrize(
    "width, factor",
    [(192, 0.25), (384, 0.25), (768, 0.25), (896, 0.25), (1024, 0.5), (1152, 1.0), (1280, 1.0), (1536, 0.5), (2048, 1.0)],
)  # fmt: skip
def test_siglip2_size_factor_is_the_papers_and_fills_unset_weights(width, factor):
    """SigLIP 2's weights of SILC (1) and TIPS (0.25) times the factor of the image tower's width: the paper's
    0.25 / 0.5 / 1 / 0.5 for B (768), L (1024), So400m (1152), g (1536); any other width below 1024 as B, from
    1024 up as So400m. A weight the run set is kept."""
    from ds_clip.siglip2.defaults import siglip2_selfsup_weights, siglip2_size_factor

    assert siglip2_size_factor(width) == factor
    assert siglip2_selfsup_weights(None, None, width) == (factor, 0.25 * factor)
    assert siglip2_selfsup_weights(0.7, None, width) == (0.7, 0.25 * factor)


def test_siglip2_run_exports_its_encoders_as_a_plain_siglip_export(tmp_path, capsys):
    """A --siglip2 run whose checkpoint and weight EMA hold the training-time parts (siglip2.decoder.*, a head, the
    mask token), its EMA teacher in siglip2_teacher.pt beside them, exports, trained weights and --ema alike, exactly what the same run without them exports: the same
    tensors, no siglip2 key, loaded strictly by open_clip (local-dir:); one line says what was left out and how
    many parameters. The card names SigLIP 2's objective with the weights as trained (SILC and TIPS unset: the
    defaults for the 128-wide tower, 0.25 and 0.0625) and says the export is the encoders only. A checkpoint holding
    siglip2 tensors whose settings have no --siglip2 is refused in one line, exit 2, nothing written."""
    import open_clip

    import ds_clip
    from ds_clip.export.openclip import build_open_clip_model

    shipped = Path(ds_clip.__file__).parent / "model_configs" / "ds-clip-tiny-siglip.json"
    config = {"model_cfg": json.loads(shipped.read_text()), "preprocess_cfg": {}}
    torch.manual_seed(0)
    model = build_open_clip_model(config["model_cfg"])
    encoders = {k: v.detach().clone() for k, v in model.state_dict().items()}
    averaged = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
    parts = _training_parts(128)
    count = sum(v.numel() for v in parts.values())
    flags = ["--siglip2-locca-weight", "2", "--siglip2-parallel-fraction", "0.25", "--siglip2-selfsup-start", "0.9",
             "--siglip2-teacher-momentum", "0.999", "--ema-decay", "0.99"]  # fmt: skip
    siglip2 = _saved_run(tmp_path / "s2", config, {**encoders, **parts}, _settings("--siglip2", *flags),
                         {**averaged, **{k: v * 0.5 for k, v in parts.items()}},
                         teacher={k: v * 3 for k, v in averaged.items() if k.startswith("visual.")})  # fmt: skip
    plain = _saved_run(
        tmp_path / "plain", config, encoders, _settings("--siglip", "--ema-decay", "0.99"), averaged
    )

    for extra in ((), ("--ema",)):
        tag = "-".join(("oc", *extra))
        rc, out, err = _export(capsys, siglip2, tmp_path / tag, *extra)
        assert rc == 0, err
        said = [ln for ln in out.splitlines() if "left out" in ln]
        assert said == [
            f"ds-clip-export: --siglip2: left out the LocCa decoder and the self-supervised heads, training-time parts "
            f"({count:,} parameters in {len(parts)} tensors under siglip2.), as the paper does: the export holds the encoders"
        ], out
        rc, out, err = _export(capsys, plain, tmp_path / f"plain-{tag}", *extra)
        assert rc == 0 and "left out" not in out, err
        got, want = _weights(tmp_path / tag), _weights(tmp_path / f"plain-{tag}")
        assert got.keys() == want.keys() and not [k for k in got if "siglip2" in k]
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert torch.equal(
            got["visual.conv1.weight"], (averaged if extra else encoders)["visual.conv1.weight"]
        )
        # open_clip loads a local-dir: folder strictly: every key of its model, nothing more.
        open_clip.create_model_and_transforms(f"local-dir:{tmp_path / tag}")

    card = (tmp_path / "oc").joinpath("README.md").read_text()
    assert (
        "| objective | SigLIP 2 objective: sigmoid loss + LocCa decoder (weight 2, parallel share 0.25) + SILC "
        "self-distillation (weight 0.25) and TIPS masked prediction (weight 0.0625) from 90% of training (teacher "
        "momentum 0.999) |"
    ) in card, card
    assert "| exported parts | the image and text encoders only (with the logit scale and bias): SigLIP 2's " \
           f"training-time parts (the LocCa decoder, the self-supervised heads, the mask token; {count:,} " \
           "parameters) are left out, as in the paper |" in card  # fmt: skip
    assert "A SigLIP 2 model" in card and "SigLIP 2" not in (tmp_path / "plain-oc/README.md").read_text()

    mixed = _saved_run(tmp_path / "mixed", config, {**encoders, **parts}, _settings("--siglip"))
    rc, out, err = _export(capsys, mixed, tmp_path / "mixed-out")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds SigLIP 2's training-time parts (siglip2.decoder.layers.0.cross_attn.in_proj_bias and 3 more " \
           "tensors) but its settings have no --siglip2" in err  # fmt: skip
    assert not (tmp_path / "mixed-out").exists()


def test_siglip2_run_exports_as_a_plain_siglip_model(tmp_path, capsys):
    """The SigLIP architecture (a timm vit_*_siglip_* tower) trained with --siglip2: `--format transformers` leaves
    the siglip2 tensors out and writes the SiglipModel a plain SigLIP export writes (every tensor equal to the
    mapping of the encoders alone), which transformers loads with no key missing or unexpected; the card names the
    objective, SILC's weight as set and TIPS' the default for the 768-wide timm tower (0.25 x 0.25)."""
    from transformers import SiglipModel

    from ds_clip.export.hf_siglip import siglip_state_dict
    from ds_clip.export.openclip import build_open_clip_model

    write_siglip_dir(tmp_path / "siglip_model")
    config = json.loads((tmp_path / "siglip_model/open_clip_config.json").read_text())
    torch.manual_seed(0)
    encoders = build_open_clip_model(config["model_cfg"], config["preprocess_cfg"]).state_dict()
    parts = _training_parts(768)
    run = _saved_run(
        tmp_path / "s2", config, {**encoders, **parts}, _settings("--siglip2", "--siglip2-silc-weight", "0.3")
    )

    rc, out, err = _export(capsys, run, tmp_path / "hf", "--format", "transformers")
    assert rc == 0, err
    count = sum(v.numel() for v in parts.values())
    assert (
        f"left out the LocCa decoder and the self-supervised heads, training-time parts ({count:,} parameters"
        in out
    )
    got = _weights(tmp_path / "hf")
    want = siglip_state_dict(
        encoders
    )  # what the export of the encoders alone maps (open_clip's names and shapes)
    assert got.keys() == want.keys() and not [k for k in got if "siglip2" in k]
    assert all(torch.equal(got[k], want[k]) for k in want)
    _, info = SiglipModel.from_pretrained(tmp_path / "hf", local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info
    card = (tmp_path / "hf/README.md").read_text()
    assert "+ SILC self-distillation (weight 0.3) and TIPS masked prediction (weight 0.0625) from 80% of training " \
           "(teacher momentum 0.996)" in card and "library_name: transformers" in card  # fmt: skip

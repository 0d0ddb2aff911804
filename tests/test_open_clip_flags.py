"""An open_clip_train command line runs unchanged: every option of open_clip_train's own parser is
either accepted by ds-clip-train with open_clip's meaning, or answered with one line (exit 2) that names the
flag, says why ds_clip has no such thing and what to use instead. Never argparse's bare "unrecognized
arguments" or "invalid choice" for an open_clip flag or value.

The walk builds open_clip_train's parser itself (open_clip_train.params.parse_args, captured when it parses),
so a flag open_clip adds shows up here. Single process, no engine; the model-flag tests build tiny models.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from ds_clip import train
from ds_clip.config import ANSWERED, TrainSettings, build_parser, flags, parse_settings
from ds_clip.config.resolve import resolve_deepspeed_for, resolve_ds_config
from ds_clip.ds_config.presets import PRECISION_MAP, SettingsError
from tests import launch
from tests.test_config import _doc_generator  # scripts/gen_configuration_doc.py also reads open_clip's parser

REPO = Path(__file__).resolve().parent.parent


def _values(action: argparse.Action) -> list[list[str]]:
    """The words to try after the option: none for a switch, every choice, else a value of its type."""
    if action.nargs == 0:
        return [[]]
    if action.choices:
        return [[str(c)] for c in action.choices]
    d = action.default
    if isinstance(d, (int, float, str)) and not isinstance(d, bool) and d not in ("", None) and d != "\t":
        return [[str(d)]]
    if action.dest == "aug_cfg":
        return [["scale=(0.9,1.0)"]]
    kind = action.type if action.type in (int, float) else str
    return [[{int: "1", float: "0.5", str: "x"}[kind]]]


@pytest.fixture(scope="module")
def oc_actions() -> list[argparse.Action]:
    gen = _doc_generator()
    return gen.open_clip_options(gen.open_clip_train_parser())


def _ours() -> set[str]:
    return {o for f in flags() for o in f.options}


def test_open_clip_has_90_options_each_accepted_or_answered_once(oc_actions):
    options = [a.option_strings[0] for a in oc_actions]
    assert len(options) == 90  # open_clip_train 3.3.0; a new release's flags would fail the lines below
    unplaced = [o for o in options if o not in _ours() and o not in ANSWERED]
    assert unplaced == []
    assert [o for o in options if o in _ours() and o in ANSWERED] == []
    assert [o for o in ANSWERED if o not in options] == []  # no stale answers
    doc = (REPO / "docs" / "configuration.md").read_text()  # (its freshness: tests/test_config.py)
    assert [o for o in options if f"| `{o}` |" not in doc] == []


def test_every_accepted_option_and_choice_parses(oc_actions):
    """ds-clip-train's own parser takes every accepted open_clip option with each value open_clip allows."""
    parser = build_parser()
    for action in oc_actions:
        option = action.option_strings[0]
        if option not in _ours():
            continue
        for words in _values(action):
            try:
                parser.parse_args([option, *words])
            except SystemExit as exc:  # argparse's "invalid choice" / "expected one argument"
                pytest.fail(f"{option} {' '.join(words)}: argparse refused it (exit {exc.code})")


def test_every_answered_option_is_one_line_naming_it_exit_2(oc_actions, capsys):
    for action in oc_actions:
        option = action.option_strings[0]
        if option not in ANSWERED:
            continue
        for words in _values(action) + ([[]] if action.nargs != 0 else []):  # with and without its value
            assert train.main([option, *words]) == 2, option
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(f"ds-clip-train: error: {option} is open_clip"), (
                err
            )
            assert "unrecognized" not in err and "invalid choice" not in err


def test_open_clip_values_reach_the_settings(tmp_path):
    """The values of open_clip's that ds_clip reads its own way: auto dataset type, the precision names, the
    epoch cadences, --delete-previous-checkpoint."""
    s = parse_settings(["--dataset-type", "auto"])
    assert s.data.dataset_type == "synthetic"
    for name, target in PRECISION_MAP.items():
        assert parse_settings(["--precision", name]).dist.precision == target
    s = parse_settings(
        ["--save-frequency", "1", "--val-frequency", "2", "--zeroshot-frequency", "1", "--save-most-recent"]
        + ["--delete-previous-checkpoint", "--skip-scheduler", "--wandb-project-name", "p", "--log-local"]
    )
    assert (s.checkpoint.save_frequency, s.eval.val_frequency, s.eval.zeroshot_frequency) == (1, 2, 1)
    assert s.checkpoint.keep_checkpoints == 1 and s.checkpoint.save_most_recent
    assert s.optim.skip_scheduler and s.logging.wandb_project_name == "p" and s.logging.log_local


def test_precision_mapping_is_in_help():
    text = " ".join(build_parser().format_help().split())
    by_target: dict[str, list[str]] = {}
    for name, target in PRECISION_MAP.items():
        by_target.setdefault(target, []).append(name)
    for target, names in by_target.items():
        assert f"{', '.join(names)} -> {target}" in text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--opt", "timm/adamw"], "--opt timm/adamw: ds_clip has DeepSpeed build the optimizer"),
        (["--opt", "adafactor"], "--opt must be one of adamw, adam, lamb, lion, muon, sgd"),
        (["--momentum", "0.9"], "--momentum applies to --opt sgd"),
        (["--opt", "sgd", "--momentum", "1.5"], "--momentum must be in [0, 1)"),
        (["--save-frequency", "-1"], "--save-frequency must be >= 0"),
        (["--val-frequency", "-1"], "--val-frequency must be >= 0"),
        (["--delete-previous-checkpoint", "--keep-checkpoints", "3"], "--delete-previous-checkpoint keeps 1"),
        (["--skip-scheduler", "--lr-scheduler", "const"], "--skip-scheduler trains at the peak LR"),
        (["--force-context-length", "0"], "--force-context-length must be >= 1"),
        (["--opt", "lamb", "--ds-config", "zero2_offload_fp32"], "--opt lamb with zero_optimization.offload"),
    ],
)
def test_bad_open_clip_values_name_the_flag(argv, needle):
    with pytest.raises(SettingsError) as e:
        parse_settings(argv)
    assert needle in str(e.value)


def test_opt_builds_deepspeeds_optimizer_block():
    """--opt goes into the resolved JSON's "optimizer" block (DeepSpeed builds it, offload included), each
    optimizer with the hyper-parameters its class takes; a preset's block must agree with --opt."""

    def block(*argv):
        return resolve_ds_config(parse_settings(list(argv)), 2)["optimizer"]

    assert block() == {
        "type": "AdamW",
        "params": {
            "lr": 5e-4,
            "weight_decay": 0.2,
            "betas": [0.9, 0.98],
            "eps": 1e-6,
            "torch_adam": True,
            "fused": True,
        },
    }
    assert block("--opt", "lamb") == {
        "type": "Lamb", "params": {"lr": 5e-4, "weight_decay": 0.2, "betas": [0.9, 0.98], "eps": 1e-6}
    }  # fmt: skip
    assert block("--opt", "lion", "--ds-config", "zero2_offload_fp32") == {
        "type": "Lion", "params": {"lr": 5e-4, "weight_decay": 0.2, "betas": [0.9, 0.98]}
    }  # fmt: skip
    assert block("--opt", "sgd", "--momentum", "0.9") == {
        "type": "SGD", "params": {"lr": 5e-4, "weight_decay": 0.2, "momentum": 0.9}
    }  # fmt: skip


def test_preset_optimizer_type_must_match_a_passed_opt(tmp_path):
    """The file's optimizer is --opt when the flag is left out; a passed --opt of another kind is refused."""
    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"zero_optimization": {"stage": 1}, "optimizer": {"type": "Lion"}}))
    with pytest.raises(SettingsError, match=r'optimizer.type="Lion" in .* conflicts with --opt adamw'):
        parse_settings(["--ds-config", str(preset), "--opt", "adamw"])
    assert parse_settings(["--ds-config", str(preset)]).optim.optimizer == "lion"
    assert (
        resolve_ds_config(parse_settings(["--ds-config", str(preset), "--opt", "lion"]), 1)["optimizer"][
            "type"
        ]
        == "Lion"
    )


def test_what_deepspeed_cannot_build_on_the_cpu_is_refused():
    """Measured on DeepSpeed 0.19.8's CPU accelerator: Lamb (FusedLamb) and Lion without offload (FusedLion)
    have no CPU kernel; Lion under offload runs DeepSpeed's CPU Lion. On CUDA all build."""

    def why(*argv, accelerator="cpu"):
        return resolve_deepspeed_for(
            parse_settings(list(argv)), None, accelerator=accelerator
        ).optimizer_blocker

    assert "FusedLamb" in why("--opt", "lamb")
    assert "zero2_offload_fp32" in why("--opt", "lion")
    assert why("--opt", "lion", "--ds-config", "zero2_offload_fp32") is None
    assert why("--opt", "sgd") is None and why() is None
    assert why("--opt", "lamb", accelerator="cuda") is None


def test_dry_run_prints_settings_and_json_and_starts_nothing(capsys, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "4")  # what a launcher would set: the JSON is resolved for it
    argv = ["--dry-run", "--precision", "amp_bf16", "--batch-size", "3", "--save-frequency", "1"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert not dist.is_initialized()
    blocks = [b for b in re.split(r"^# .*$", out, flags=re.M) if b.strip().startswith("{")]
    settings, ds_json = json.loads(blocks[0]), json.loads(blocks[1])
    assert settings["precision"] == "bf16" and settings["save_frequency"] == 1
    assert TrainSettings.of(**settings).dist.dry_run
    assert ds_json["train_batch_size"] == 12 and ds_json["bf16"]["enabled"] is True
    assert "amp, fp16, pure_fp16 -> DeepSpeed fp16" in out and "nothing was started" in out


def test_dry_run_finds_the_errors_a_run_would_meet_at_start(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    preset = tmp_path / "p.json"
    triple = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    preset.write_text(json.dumps({"zero_optimization": {"stage": 1}, **triple}))
    assert train.main(["--dry-run", "--ds-config", str(preset)]) == 2  # 8 != 2 x 1 x 2
    assert "train_batch_size=8" in capsys.readouterr().err
    assert train.main(["--dry-run", "--horovod"]) == 2
    assert capsys.readouterr().err.startswith("ds-clip-train: error: --horovod is open_clip_train's flag")


def test_model_flags_reach_open_clip():
    """--force-quick-gelu, --force-custom-text, --force-context-length, --image-resize-mode are passed to
    open_clip as open_clip_train passes them (model, tokenizer, transforms) and recorded in the model config."""
    import open_clip
    from torchvision import transforms as T

    from ds_clip.training.engine import build_model_bundle

    s = parse_settings(
        [
            "--force-quick-gelu",
            "--force-custom-text",
            "--force-context-length",
            "16",
            "--image-resize-mode",
            "squash",
        ]
    )
    b = build_model_bundle(s.model, seed=s.data.seed)
    assert isinstance(b.model, open_clip.CustomTextCLIP)
    assert any(isinstance(m, open_clip.model.QuickGELU) for m in b.model.modules())
    assert b.tokenizer(["a photo"]).shape[-1] == 16
    assert (
        b.model_cfg["quick_gelu"]
        and b.model_cfg["custom_text"]
        and b.model_cfg["text_cfg"]["context_length"] == 16
    )
    assert not any(isinstance(t, T.CenterCrop) for t in b.preprocess_val.transforms)  # squash: resize only


# ------------------------------------------------------------------------------------ ImageNet zero-shot


def _write_images(root, labels: dict[int, list[int]], images) -> None:
    """Class folders named by class index (ImageNetV2's layout) holding the given images (PNG)."""
    from torchvision.transforms.functional import to_pil_image

    for cls, idx in labels.items():
        (root / str(cls)).mkdir(parents=True, exist_ok=True)
        for i in idx:
            to_pil_image(images[i]).save(root / str(cls) / f"{i:03d}.png")


@pytest.mark.slow
def test_imagenet_zeroshot_matches_open_clip_train(tmp_path):
    """ds_clip's --imagenet-val top-1/top-5 are those of open_clip's own zero-shot classifier
    (build_zero_shot_classifier with IMAGENET_CLASSNAMES and OPENAI_IMAGENET_TEMPLATES, as open_clip_train
    builds it). The folder is filed from that classifier's predictions (half the images under their top-1
    class, half under their 3rd), so the expected accuracies are 0.5 and 1.0, not a random model's 0."""
    import open_clip
    import torch

    from ds_clip.evaluate.zeroshot import imagenet_zeroshot
    from ds_clip.models.model import build_model
    from ds_clip_harness.models import E2E_MODEL

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    b = build_model(f"local-dir:{model_dir}", seed=0)
    model = b.model.eval()
    torch.manual_seed(0)
    images = torch.rand(8, 3, 40, 40)
    classifier = open_clip.build_zero_shot_classifier(
        model,
        b.tokenizer,
        open_clip.IMAGENET_CLASSNAMES,
        open_clip.OPENAI_IMAGENET_TEMPLATES,
        num_classes_per_batch=10,
        device="cpu",
        use_tqdm=False,
    ).T  # fmt: skip  ([1000, d]; open_clip keeps it [d, 1000])
    from torchvision.transforms.functional import to_pil_image

    with torch.no_grad():
        feats = model.encode_image(
            torch.stack([b.preprocess_val(to_pil_image(x)) for x in images]), normalize=True
        )
    ranked = (feats @ classifier.T).argsort(dim=1, descending=True)
    labels: dict[int, list[int]] = {}
    for i in range(8):
        labels.setdefault(int(ranked[i, 0 if i % 2 == 0 else 2]), []).append(i)
    _write_images(tmp_path / "val", labels, images)

    def forward(image=None, text=None):
        return model(image=image, text=text)

    ours = imagenet_zeroshot(
        forward, {"--imagenet-val": str(tmp_path / "val")}, preprocess=b.preprocess_val, tokenizer=b.tokenizer,
        batch_size=3, device="cpu",
    )  # fmt: skip
    assert ours["imagenet-zeroshot-val-samples"] == 8
    # open_clip's classifier files half the images under their top-1 class, all under one of their top 5
    assert ours["imagenet-zeroshot-val-top1"] == 0.5
    assert ours["imagenet-zeroshot-val-top5"] == 1.0


def test_imagenet_folder_rule(tmp_path):
    (tmp_path / "n01440764").mkdir()
    with pytest.raises(SettingsError, match="--imagenet-val .*expected 1000 class folders.*found 1"):
        parse_settings(["--imagenet-val", str(tmp_path)])
    with pytest.raises(SettingsError, match="--imagenet-v2 .*no such folder"):
        parse_settings(["--imagenet-v2", str(tmp_path / "missing")])
    (tmp_path / "n01440764").rmdir()
    for c in ("0", "17", "999"):
        (tmp_path / c).mkdir()
    assert parse_settings(["--imagenet-val", str(tmp_path)]).eval.imagenet_val == str(tmp_path)


# ------------------------------------------------------------------------------- one open_clip run, end to end


@pytest.mark.e2e
@pytest.mark.slow
def test_open_clip_command_line_trains_under_the_deepspeed_launcher(tmp_path):
    """An open_clip_train command line (epoch cadences, --save-most-recent, --imagenet-val/--imagenet-v2,
    --opt lion, --skip-scheduler, open_clip's --precision and --dataset-type names) trains through
    `deepspeed --num_gpus 2 --module ds_clip.train`: 3 epochs of 4 steps; checkpoints at epoch 2
    (--save-frequency 2) and the end, epoch 1's --save-most-recent one removed once epoch 2's is complete;
    --val-data evaluated every epoch, ImageNet zero-shot at epoch 2 (--zeroshot-frequency 2) and the end, on
    both ranks' shares of the 12 images; Lion (DeepSpeed's CPU Lion under the offload preset; on CUDA its
    FusedLion) at a constant LR. One launch."""
    import csv

    import torch

    from ds_clip_harness.models import E2E_MODEL

    model = tmp_path / "model"
    model.mkdir()
    (model / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    _write_images(tmp_path / "inet", {0: [0, 1, 2], 207: [3, 4, 5], 281: [6, 7, 8], 999: [9, 10, 11]},
                  torch.rand(12, 3, 40, 40))  # fmt: skip
    argv = [
        "--model", f"local-dir:{model}", "--dataset-type", "synthetic", "--train-num-samples", "16",
        "--batch-size", "2", "--epochs", "3", "--precision", "fp32", "--opt", "lion", "--lr", "1e-3", "--wd", "0.1",
        "--skip-scheduler", "--warmup", "10000", "--ds-config", "zero2_offload_fp32",
        "--save-frequency", "2", "--save-most-recent", "--val-data", "synthetic", "--val-num-samples", "8",
        "--val-frequency", "1", "--zeroshot-frequency", "2", "--imagenet-val", str(tmp_path / "inet"),
        "--imagenet-v2", str(tmp_path / "inet"), "--workers", "1", "--log-every-n-steps", "1",
        "--report-to", "csv", "--logs", str(tmp_path / "logs"), "--name", "oc",
    ]  # fmt: skip
    proc = launch.run(launch.deepspeed(*argv), timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run = tmp_path / "logs" / "oc"
    assert (
        "optimizer parameter groups (--opt lion: DeepSpeed Lion" in out
        and "--precision: DeepSpeed fp32 here" in out
    )
    assert "removed step_00000004: --save-most-recent" in out
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_00000008", "step_00000012"]
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert len(rows) == 12 and {float(r["lr"]) for r in rows} == {1e-3}  # no warmup, no decay
    assert json.loads((run / "ds_config.json").read_text())["optimizer"]["type"] == "Lion"
    val = {int(r["step"]): r for r in csv.DictReader((run / "val_metrics.csv").open())}
    assert sorted(val) == [4, 8, 12] and all(val[s]["val_loss"] for s in val)
    for step, has_imagenet in ((4, False), (8, True), (12, True)):
        for name in ("imagenet-zeroshot-val", "imagenetv2-zeroshot-val"):
            assert bool(val[step].get(f"{name}-top1")) == has_imagenet, (step, name)
            if has_imagenet:
                assert float(val[step][f"{name}-samples"]) == 12  # both ranks' shares, each image once
                assert 0 <= float(val[step][f"{name}-top1"]) <= float(val[step][f"{name}-top5"]) <= 1


def test_step_and_epoch_cadences_combine():
    """A step is on a cadence if it is on the step cadence or ends an epoch on the epoch cadence (0/None: off)."""
    from ds_clip.checkpoint import epochs_done_at, on_cadence

    spe = 4  # steps per epoch
    assert [epochs_done_at(s, spe) for s in (0, 3, 4, 8, 9)] == [None, None, 1, 2, None]
    assert epochs_done_at(4, None) is None

    def fired(every_steps, every_epochs):
        return [s for s in range(1, 17) if on_cadence(s, every_steps, epochs_done_at(s, spe), every_epochs)]

    assert fired(None, 2) == [8, 16]
    assert fired(6, None) == [6, 12]
    assert fired(6, 2) == [6, 8, 12, 16]
    assert fired(None, 0) == [] and fired(None, None) == []


def test_skip_scheduler_is_the_peak_from_the_first_step():
    from ds_clip.training.schedule import schedule_for

    o = parse_settings(["--skip-scheduler", "--warmup", "100"]).optim
    sched = schedule_for(o, total_steps=50)
    assert [sched.multiplier(s) for s in (0, 1, 25, 49)] == [1.0] * 4


def test_resume_refuses_another_optimizer():
    """A checkpoint's optimizer state belongs to its --opt (and --momentum): a resume with another is exit 2."""
    from ds_clip.checkpoint import ResumeSettingsError
    from ds_clip.checkpoint.load import check_resume_settings
    from ds_clip.config import settings_to_dict

    saved = settings_to_dict(parse_settings(["--opt", "sgd", "--momentum", "0.9"]))
    with pytest.raises(ResumeSettingsError, match="--opt sgd there, adamw here"):
        check_resume_settings(saved, settings_to_dict(parse_settings([])), "--resume x")
    check_resume_settings(saved, dict(saved), "--resume x")
    old = {
        k: v for k, v in saved.items() if k not in ("optimizer", "momentum")
    }  # a checkpoint from before --opt
    check_resume_settings(old, settings_to_dict(parse_settings([])), "--resume x")


def test_use_bn_sync_converts_batchnorm_and_is_refused_on_the_cpu(tmp_path, capsys):
    """--use-bn-sync turns a ResNet tower's BatchNorm into SyncBatchNorm, after locking, as open_clip_train does
    (the cached step's no-grad pass freezes running statistics of any _BatchNorm, SyncBatchNorm included). torch's
    SyncBatchNorm refuses CPU tensors in a process group (one rank too), so the CPU is refused before starting;
    on GPUs it is not refused (the GPU run itself is not checked here: no GPU on the CI machines)."""
    import torch

    from ds_clip.config import resolve_deepspeed_for as resolve
    from ds_clip.training.engine import build_model_bundle
    from ds_clip_harness.models import write_model_dirs

    model = write_model_dirs(tmp_path)["resnet_bn"]
    s = parse_settings(["--model", model, "--use-bn-sync"])
    bns = [
        m
        for m in build_model_bundle(s.model, seed=s.data.seed).model.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    ]
    assert bns and all(isinstance(m, torch.nn.SyncBatchNorm) for m in bns)
    assert "GPUs only" in resolve(s, None, accelerator="cpu").bn_sync_blocker
    assert resolve(s, None, accelerator="cuda").bn_sync_blocker is None
    assert resolve(parse_settings(["--model", model]), None, accelerator="cpu").bn_sync_blocker is None
    if not torch.cuda.is_available():  # (DeepSpeed's accelerator is the CPU here)
        assert train.main(["--dry-run", "--model", model, "--use-bn-sync"]) == 2
        assert "--use-bn-sync on the CPU" in capsys.readouterr().err

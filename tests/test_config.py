"""Unit tests of the settings and the DeepSpeed JSON resolution (single process, no engine).

Contract: CLI > preset > defaults; every bad input is a SettingsError naming the flag or JSON key;
every shipped preset resolves into a config DeepSpeed 0.19.8 parses without unknown or deprecated keys.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
from pathlib import Path

import pytest

from ds_clip.config import (
    SettingsError,
    TrainSettings,
    build_parser,
    flags,
    parse_settings,
    resolve_deepspeed_for,
    resolve_ds_config,
    settings_to_dict,
    validate,
)
from ds_clip.ds_config import rules as dsc  # where the step's keys and the rules that merge them live
from ds_clip.ds_config.resolve import (
    PRESET_DIR,
    default_preset,
    list_presets,
    load_preset,
    write_run_files,
)


def _preset_precision(preset: dict) -> str:
    if preset.get("bf16", {}).get("enabled"):
        return "bf16"
    if preset.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def _write_json(tmp_path: Path, data: dict, name: str = "custom.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


# ---------------------------------------------------------------- defaults and precedence


def test_defaults_parse_and_resolve_to_zero1_fp32():
    s = parse_settings([])
    assert (
        s.optim.batch_size,
        s.optim.accum_freq,
        s.optim.epochs,
        s.dist.precision,
        s.data.dataset_type,
    ) == (
        8,
        1,
        1,
        "fp32",
        "synthetic",
    )
    assert s.loss.loss_impl == "auto" and s.logging.report_to == [] and s.dist.local_rank == -1
    assert s.logging.name.endswith("-model_ds-clip-tiny-m_8-k_1") and s.logging.name[:4].isdigit()
    cfg = resolve_ds_config(s, world_size=8)
    assert cfg["zero_optimization"]["stage"] == 1  # default preset zero1_<precision> beyond 4 fp32 ranks
    assert cfg["train_micro_batch_size_per_gpu"] == 8
    assert cfg["gradient_accumulation_steps"] == 1
    assert cfg["train_batch_size"] == 8 * 8  # m * W: accumulation is ds_clip's, not the engine's
    assert cfg["bf16"]["enabled"] is False and cfg["fp16"]["enabled"] is False
    assert cfg["gradient_clipping"] == 0.0
    assert cfg["optimizer"] == {
        "type": "AdamW",
        "params": {
            "lr": 5e-4,
            "betas": [0.9, 0.98],
            "eps": 1e-6,
            "weight_decay": 0.2,
            "torch_adam": True,
            "fused": True,  # torch's one-pass AdamW kernel, not its per-tensor loop
        },
    }
    assert cfg["zero_allow_untested_optimizer"] is True and cfg["wall_clock_breakdown"] is False
    assert cfg["steps_per_print"] >= 10**9
    assert "scheduler" not in cfg


def test_cli_overrides_preset_and_preset_overrides_defaults():
    # Preset over default: zero2_bf16 sets the precision when --precision is not given.
    s = parse_settings(["--ds-config", "zero2_bf16"])
    assert s.dist.precision == "bf16"
    cfg = resolve_ds_config(s, world_size=2)
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["bf16"]["enabled"] is True
    assert (
        cfg["zero_optimization"]["reduce_bucket_size"]
        == load_preset("zero2_bf16")["zero_optimization"]["reduce_bucket_size"]
    )  # engine settings come from the preset untouched
    # CLI over preset: --zero-stage replaces the preset's stage; batch/optimizer flags fill the rest.
    s = parse_settings(
        ["--ds-config", "zero2_bf16", "--zero-stage", "3", "--batch-size", "5", "--accum-freq", "3"]
        + ["--lr", "1e-3", "--wd", "0.1", "--beta1", "0.8", "--beta2", "0.95", "--eps", "1e-8"]
        + ["--grad-clip-norm", "2.5"]
    )
    cfg = resolve_ds_config(s, world_size=2)
    assert cfg["zero_optimization"]["stage"] == 3
    assert (
        cfg["train_micro_batch_size_per_gpu"],
        cfg["train_batch_size"],
        cfg["gradient_accumulation_steps"],
    ) == (
        5,
        10,
        1,
    )
    assert cfg["gradient_clipping"] == 2.5
    assert cfg["optimizer"]["params"] == {
        "lr": 1e-3,
        "betas": [0.8, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "torch_adam": True,
        "fused": True,
    }
    # The default preset follows --precision.
    assert resolve_ds_config(parse_settings(["--precision", "bf16"]), 1)["bf16"]["enabled"] is True


def test_default_preset_follows_the_world_size_and_explicit_choices_stand():
    """Without --ds-config, one process trains on ZeRO-0 (nothing to partition the optimizer state with), fp32
    on 2-4 ranks too (ZeRO-1 saves little or no memory there), bf16 on several ranks and fp32 on more than 4 on
    ZeRO-1; --zero-stage, --ds-config, --coalesce-grad-reduction on and fp16 keep a ZeRO preset."""

    def stage(argv: list[str], world: int) -> int:
        return resolve_ds_config(parse_settings(argv), world)["zero_optimization"]["stage"]

    assert stage([], 1) == 0 and stage(["--precision", "bf16"], 1) == 0
    assert [stage([], w) for w in (2, 3, 4, 5, 8)] == [0, 0, 0, 1, 1]
    assert stage(["--precision", "bf16"], 2) == 1 and stage(["--precision", "bf16"], 4) == 1
    preset, why = default_preset(parse_settings([]).deepspeed_request(), 1)
    assert preset == "zero0_fp32" and "one process" in why
    preset, why = default_preset(parse_settings([]).deepspeed_request(), 2)
    assert preset == "zero0_fp32" and "as DDP does" in why
    assert default_preset(parse_settings([]).deepspeed_request(), 8)[0] == "zero1_fp32"
    assert stage(["--zero-stage", "1"], 2) == 1 and stage(["--coalesce-grad-reduction", "on"], 2) == 1
    assert stage(["--zero-stage", "1"], 1) == 1 and stage(["--zero-stage", "2"], 1) == 2
    assert stage(["--ds-config", "zero1_fp32"], 1) == 1 and stage(["--ds-config", "zero3_fp32"], 1) == 3
    assert stage(["--coalesce-grad-reduction", "on"], 1) == 1  # DeepSpeed coalesces on ZeRO 1-3 only
    assert stage(["--precision", "fp16"], 1) == 1  # ZeRO-0 fp16 is refused
    # The ZeRO-1 preset's buckets under an explicit --zero-stage, as before.
    cfg = resolve_ds_config(parse_settings(["--zero-stage", "0"]), 1)
    assert cfg["zero_optimization"] == {**load_preset("zero1_fp32")["zero_optimization"], "stage": 0}
    # auto finds no ZeRO optimizer to coalesce on one default process, and says so.
    auto = parse_settings(["--coalesce-grad-reduction", "auto"])
    assert "ZeRO stage 0" in resolve_deepspeed_for(auto, 1).coalesce_fallback
    assert (
        "ZeRO stage 0" in resolve_deepspeed_for(auto, 2).coalesce_fallback
    )  # the fp32 2-rank default: ZeRO-0
    assert resolve_deepspeed_for(auto, 8).coalesce_fallback is None
    # The resolved value says which preset and why (the start-up log line), and nothing when it was chosen.
    resolved = resolve_deepspeed_for(parse_settings([]), 1)
    assert (resolved.preset, resolved.default_reason) == default_preset(
        parse_settings([]).deepspeed_request(), 1
    )
    assert resolve_deepspeed_for(parse_settings(["--ds-config", "zero2_fp32"]), 1).default_reason is None


def test_resolve_does_not_mutate_the_preset_and_is_repeatable():
    s = parse_settings(["--ds-config", "zero3_bf16", "--zero-stage", "1"])
    first = resolve_ds_config(s, 2)
    assert load_preset("zero3_bf16")["zero_optimization"]["stage"] == 3
    assert resolve_ds_config(s, 2) == first


def test_dataset_type_follows_train_data(tmp_path):
    for i in range(2):
        (tmp_path / f"shard-{i:03d}.tar").write_bytes(b"")
    pattern = str(tmp_path / "shard-{000..001}.tar")
    s = parse_settings(["--train-data", pattern + "::pipe:curl -s http://x/{0..3}.tar"])
    assert s.data.dataset_type == "webdataset"
    assert parse_settings([]).data.dataset_type == "synthetic"


def test_report_to_is_a_list_and_settings_are_json_able():
    s = parse_settings(["--report-to", "tensorboard, csv", "--name", "run1"])
    assert s.logging.report_to == ["tensorboard", "csv"] and s.logging.name == "run1"
    assert json.loads(json.dumps(settings_to_dict(s)))["report_to"] == ["tensorboard", "csv"]


@pytest.mark.parametrize("argv", [["--local_rank=3"], ["--local_rank", "3"], ["--local-rank=3"]])
def test_local_rank_appended_by_the_launcher_is_accepted(argv):
    assert parse_settings(["--batch-size", "4", *argv]).dist.local_rank == 3


def test_help_names_every_flag():
    text = build_parser().format_help()
    for flag in ("--accum-freq", "--batch-size", "--ds-config", "--zero-stage", "--precision", "--report-to"):
        assert flag in text
    assert "--local_rank" not in text  # set by the launcher, not by users
    assert "SUPPRESS" not in text and "--dist-url [VALUE]" in text  # answered open_clip flags show a metavar


def test_argparse_type_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        parse_settings(["--batch-size", "many"])
    assert e.value.code == 2


# ---------------------------------------------------------------- bad inputs name the flag


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--accum-freq", "0"], "--accum-freq must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size"),
        (["--epochs", "0"], "--epochs"),
        (["--max-steps", "0"], "--max-steps"),
        (["--lr", "0"], "--lr"),
        (["--beta1", "1.0"], "--beta1"),
        (["--beta2", "-0.1"], "--beta2"),
        (["--eps", "0"], "--eps"),
        (["--warmup", "-1"], "--warmup"),
        (["--grad-clip-norm", "0"], "--grad-clip-norm"),
        (["--zero-stage", "4"], "--zero-stage"),
        (["--workers", "-1"], "--workers"),
        (["--log-every-n-steps", "0"], "--log-every-n-steps"),
        (["--save-every-n-steps", "0"], "--save-every-n-steps"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
        (["--zeroshot-classes", "/nonexistent/c.json"], "--zeroshot-classes needs --val-data"),
        (["--val-data", "synthetic", "--zeroshot-classes", "/nonexistent/c.json"], "--zeroshot-classes"),
        (["--local-loss"], "--gather-with-grad"),
        (["--dataset-type", "webdataset"], "--train-data"),
        (["--train-data", "/nonexistent/shard-{000..003}.tar"], "/nonexistent/shard-{000..003}.tar"),
        (["--val-data", "/nonexistent/val.tar"], "--val-data"),
        (["--pretrained", "/nonexistent/weights.pt"], "--pretrained"),
        (["--pretrained", "ftp://example.com/w.pt"], "--pretrained"),
        (["--pretrained", "openai"], "--pretrained"),
        (["--model", "ViT-B-16", "--pretrained", "laion2b_s34b_b79k"], "a tag of ViT-B-32"),
        (["--model", "local-dir:/nonexistent"], "--model"),
        (["--resume", "latest"], "--name"),
        (["--resume", "/nonexistent/ckpt"], "--resume"),
        (["--report-to", "tensorboard,mlflow"], "--report-to"),
        (["--name", "a/b"], "--name"),
        (["--ds-config", "zero9_fp64"], "--ds-config"),
        (["--ds-config", "/nonexistent/x.json"], "--ds-config"),
        (["--ds-config", "zero2_bf16", "--lr-scheduler", "const", "--ds-config", "DUMMY"], "--ds-config"),
        (["--ds-config", "zero1_fp16", "--zero-stage", "0"], "PR #8393"),
    ],
)
def test_bad_input_raises_settings_error_naming_the_flag(argv, needle):
    with pytest.raises(SettingsError) as e:
        parse_settings(argv)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_checkpoint_and_eval_flags(tmp_path):
    """--keep-checkpoints N, --val-data synthetic (no shard check), --zeroshot-classes FILE."""
    classes = tmp_path / "classes.txt"
    classes.write_text("circle\nsquare\n")
    s = parse_settings(
        ["--keep-checkpoints", "3", "--val-data", "synthetic", "--zeroshot-classes", str(classes)]
    )
    assert (s.checkpoint.keep_checkpoints, s.eval.val_data, s.eval.zeroshot_classes) == (
        3,
        "synthetic",
        str(classes),
    )
    d = parse_settings([])
    assert d.checkpoint.keep_checkpoints is None and d.eval.zeroshot_classes is None
    assert parse_settings(["--keep-checkpoints", "none"]).checkpoint.keep_checkpoints is None
    assert settings_to_dict(s)["keep_checkpoints"] == 3
    # --pretrained may name an exported folder, which must hold weights.
    folder = tmp_path / "export"
    folder.mkdir()
    with pytest.raises(SettingsError, match="--pretrained .* no \\*.safetensors"):
        parse_settings(["--model", "ViT-B-32", "--pretrained", str(folder)])
    (folder / "open_clip_model.safetensors").write_bytes(b"")
    parse_settings(["--model", "ViT-B-32", "--pretrained", str(folder)])


def test_local_loss_with_gather_with_grad_and_siglip_gather_are_fine():
    parse_settings(["--local-loss", "--gather-with-grad"])
    parse_settings(["--siglip", "--gather-with-grad", "--model", "ds-clip-tiny-siglip"])


def test_partly_missing_shards_are_an_error(tmp_path):
    (tmp_path / "s-0.tar").write_bytes(b"")
    with pytest.raises(SettingsError, match="1 of 2 shards"):
        parse_settings(["--train-data", str(tmp_path / "s-{0..1}.tar")])


def test_train_data_with_synthetic_type_is_an_error(tmp_path):
    (tmp_path / "s.tar").write_bytes(b"")
    with pytest.raises(SettingsError, match="--dataset-type"):
        parse_settings(["--train-data", str(tmp_path / "s.tar"), "--dataset-type", "synthetic"])


def test_model_names(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text("{}")
    parse_settings(["--model", f"local-dir:{folder}"])
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"")
    with pytest.raises(SettingsError, match="--pretrained is ignored"):
        parse_settings(["--model", f"local-dir:{folder}", "--pretrained", str(weights)])
    parse_settings(["--model", "ViT-B-32", "--pretrained", str(weights)])  # open_clip name + local file
    with pytest.raises(SettingsError, match="--model 'ViT-Q-99' is unknown"):
        parse_settings(["--model", "ViT-Q-99"])


def test_validate_checks_directly_built_settings():
    with pytest.raises(SettingsError, match="--precision"):
        validate(TrainSettings.of(precision="fp8"))
    with pytest.raises(SettingsError, match="--loss-impl"):
        validate(TrainSettings.of(loss_impl="sparse"))
    validate(TrainSettings())  # name None is fine: the trainer names the run


# ---------------------------------------------------------------- presets


def test_every_preset_resolves_and_deepspeed_parses_it_without_deprecated_keys():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as ds_logger

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    ds_logger.addHandler(handler)
    try:
        names = list_presets()
        assert {"zero0_fp32", "zero1_bf16", "zero2_fp16", "zero3_offload_bf16"} <= set(names)
        assert "zero0_fp16" not in names  # refused combination, see test_fp16_with_stage_0_is_refused
        for name in names:
            preset = load_preset(name)
            assert set(preset) <= {"zero_optimization", "bf16", "fp16"}, name  # engine settings only
            precision = _preset_precision(preset)
            # world_size=1: DeepSpeedConfig checks train_batch_size against this process's world size.
            cfg = resolve_ds_config(TrainSettings.of(ds_config=name, precision=precision), world_size=1)
            parsed = DeepSpeedConfig(json.loads(json.dumps(cfg)))
            assert parsed.zero_optimization_stage == preset["zero_optimization"]["stage"], name
            assert parsed.bfloat16_config.enabled is (precision == "bf16"), name
            assert parsed.float16_config.enabled is (precision == "fp16"), name
            assert parsed.train_batch_size == 8 and parsed.gradient_accumulation_steps == 1, name
            assert name.startswith(f"zero{parsed.zero_optimization_stage}_") and name.endswith(precision), (
                name
            )
            # A preset resolves only with the precision it is named for.
            for other in {"fp32", "bf16", "fp16"} - {precision}:
                with pytest.raises(SettingsError, match="--precision"):
                    resolve_ds_config(TrainSettings.of(ds_config=name, precision=other), world_size=2)
    finally:
        ds_logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if "deprecat" in r.getMessage().lower()]


def test_offload_drops_torch_adam_so_deepspeed_uses_cpu_adam():
    for name in ("zero2_offload_bf16", "zero3_offload_bf16"):
        cfg = resolve_ds_config(TrainSettings.of(ds_config=name, precision="bf16"), world_size=1)
        assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
        assert "torch_adam" not in cfg["optimizer"]["params"]
    cfg = resolve_ds_config(TrainSettings.of(ds_config="zero3_offload_bf16", precision="bf16"), 1)
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_fp16_with_stage_0_is_refused(tmp_path):
    path = _write_json(tmp_path, {"zero_optimization": {"stage": 0}, "fp16": {"enabled": True}})
    with pytest.raises(SettingsError, match="--zero-stage 1, 2 or 3"):
        parse_settings(["--ds-config", path])
    s = parse_settings(["--ds-config", "zero1_fp16"])
    assert resolve_ds_config(s, 1)["fp16"]["loss_scale"] == 0  # dynamic loss scaling


def test_fp16_gets_dynamic_loss_scale_when_preset_has_none(tmp_path):
    path = _write_json(tmp_path, {"zero_optimization": {"stage": 2}})
    cfg = resolve_ds_config(TrainSettings.of(ds_config=path, precision="fp16"), 1)
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0}


def test_unknown_preset_lists_the_presets_and_bad_json_names_the_file(tmp_path):
    with pytest.raises(SettingsError) as e:
        load_preset("zero5")
    assert "--ds-config" in str(e.value) and "zero2_bf16" in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(SettingsError, match=str(bad)):
        load_preset(str(bad))
    assert PRESET_DIR.name == "ds_configs" and PRESET_DIR.is_dir()


# ---------------------------------------------------------------- conflicts between preset and flags


# Settings not parsed from a command line (TrainSettings.of) cannot tell a choice from a default: every key that
# disagrees with them is refused, naming key and flag. Parsed settings take the key's value instead (the flag was
# left at its default: config.ds_json), or refuse what no flag can mean.
@pytest.mark.parametrize(
    ("extra", "needle", "parsed"),
    [
        ({"gradient_accumulation_steps": 4}, "use --accum-freq instead", ("accum_freq", 4)),
        ({"train_batch_size": 64}, "--accum-freq", ("global_batch_size", 64)),
        (
            {"train_micro_batch_size_per_gpu": 16},
            "train_micro_batch_size_per_gpu=16 in {label} conflicts with --batch-size 8",
            ("batch_size", 16),
        ),
        (
            {"gradient_clipping": 1.0},
            "gradient_clipping=1.0 in {label} conflicts with --grad-clip-norm",
            ("grad_clip_norm", 1.0),
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
            "optimizer.params.lr=0.1 in {label} conflicts with --lr",
            ("lr", 0.1),
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.0}}},
            "conflicts with --wd",
            ("wd", 0.0),
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}},
            "conflicts with --beta1/--beta2",
            ("beta2", 0.999),
        ),
        ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-8}}}, "conflicts with --eps", ("eps", 1e-8)),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type", ("optimizer", "lamb")),
        (
            {"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
            "optimizer.params.max_grad_norm",
            None,
        ),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler in {label}", ("lr_scheduler", "cosine")),
        (
            {"fp16": {"enabled": True}},
            "fp16.enabled=true in {label} conflicts with --precision fp32",
            ("precision", "fp16"),
        ),
        (
            {"bfloat16": {"enabled": True}},
            "bf16.enabled=true in {label} conflicts with --precision fp32",
            ("precision", "bf16"),
        ),
        ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled", ("precision", "bf16")),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op", None),
        ({"elasticity": {"enabled": True}}, "elasticity", None),
    ],
)
def test_preset_keys_against_unparsed_and_parsed_settings(tmp_path, extra, needle, parsed):
    path = _write_json(tmp_path, {"zero_optimization": {"stage": 1}, **extra})
    with pytest.raises(SettingsError) as e:
        resolve_ds_config(TrainSettings.of(ds_config=path), world_size=2)
    assert needle.format(label=path) in str(e.value)
    if parsed is None:
        with pytest.raises(SettingsError):  # the same check runs at parse time, before any process starts
            parse_settings(["--ds-config", path])
        return
    field, value = parsed
    s = parse_settings(["--ds-config", path])
    section = next(sec for sec in vars(s).values() if hasattr(sec, field))
    assert getattr(section, field) == value and s.sources[field] == "ds_json"
    resolve_ds_config(s, world_size=2)  # and it resolves


def test_keys_that_repeat_the_flags_are_fine(tmp_path):
    repeated = {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 16,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": False},
        "gradient_allreduce_op": "mean",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 5e-4, "betas": [0.9, 0.98], "eps": 1e-6, "torch_adam": False},
        },
    }
    path = _write_json(tmp_path, repeated)
    cfg = resolve_ds_config(parse_settings(["--ds-config", path, "--grad-clip-norm", "1"]), world_size=2)
    assert cfg["train_batch_size"] == 16 and cfg["gradient_clipping"] == 1.0
    assert cfg["optimizer"]["params"]["torch_adam"] is False  # an engine choice the preset may make
    # train_batch_size is m * W: right for W=2, wrong for W=4.
    with pytest.raises(SettingsError, match="train_batch_size=16"):
        resolve_ds_config(parse_settings(["--ds-config", path, "--grad-clip-norm", "1"]), world_size=4)


def test_step_engine_keys_are_merged_and_guarded(tmp_path, monkeypatch):
    monkeypatch.setattr(dsc, "STEP_ENGINE_KEYS", {"managed_gradient_accumulation": False})
    cfg = resolve_ds_config(TrainSettings(), world_size=1)
    assert cfg["managed_gradient_accumulation"] is False
    path = _write_json(tmp_path, {"zero_optimization": {"stage": 1}, "managed_gradient_accumulation": True})
    with pytest.raises(SettingsError, match="managed_gradient_accumulation=true"):
        resolve_ds_config(TrainSettings.of(ds_config=path), world_size=1)
    # Nested keys merge into the preset's sections instead of replacing them.
    monkeypatch.setattr(dsc, "STEP_ENGINE_KEYS", {"zero_optimization": {"overlap_comm": False}})
    cfg = resolve_ds_config(TrainSettings.of(ds_config="zero2_fp32"), world_size=1)
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["zero_optimization"]["overlap_comm"] is False
    path = _write_json(tmp_path, {"zero_optimization": {"stage": 1, "overlap_comm": True}})
    with pytest.raises(SettingsError, match="zero_optimization.overlap_comm=true"):
        resolve_ds_config(TrainSettings.of(ds_config=path), world_size=1)


def test_offload_needs_a_zero_stage_that_supports_it():
    with pytest.raises(SettingsError, match="offload_optimizer"):
        parse_settings(["--ds-config", "zero2_offload_fp32", "--zero-stage", "0"])
    with pytest.raises(SettingsError, match="offload_param"):
        parse_settings(["--ds-config", "zero3_offload_fp32", "--zero-stage", "2"])
    assert parse_settings(["--ds-config", "zero2_offload_fp32", "--zero-stage", "1"]).dist.zero_stage == 1


# ---------------------------------------------------------------- run files


def test_write_run_files_writes_settings_and_ds_config(tmp_path):
    s = parse_settings(["--name", "r", "--ds-config", "zero2_bf16", "--accum-freq", "4"])
    ds = resolve_deepspeed_for(s, world_size=2)
    cfg = ds.config
    run_dir = tmp_path / "logs" / s.logging.name
    write_run_files(run_dir, settings_to_dict(s), ds)
    saved = json.loads((run_dir / "settings.json").read_text())
    assert saved["accum_freq"] == 4 and saved["ds_config"] == "zero2_bf16"
    assert TrainSettings.of(**saved) == s  # a faithful dump: the settings read back are the settings
    assert json.loads((run_dir / "ds_config.json").read_text()) == cfg
    assert (run_dir / "ds_config.json").read_text().startswith("{\n  ")  # indented


# ---------------------------------------------------------------- docs and launch files

REPO = Path(__file__).resolve().parent.parent


def _doc_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_configuration_doc", REPO / "scripts" / "gen_configuration_doc.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_doc_is_generated_from_the_settings():
    """docs/configuration.md is what scripts/gen_configuration_doc.py writes from the fields: a field added,
    renamed or re-documented without regenerating the doc fails here."""
    gen = _doc_generator()
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == gen.render(), f"docs/configuration.md is stale: run {gen.COMMAND}"
    for f in flags():  # every flag has a row, every shipped preset is named
        assert f"| `{f.option}`" in committed, f.option
    assert [p for p in list_presets() if f"`{p}`" not in committed] == []


def test_every_field_is_one_flag_with_a_docstring_and_help():
    """One definition per flag: the parser's options are exactly the fields' flags, each with help text."""
    parser = build_parser()
    # (the answered open_clip flags parse to no dest: tests/test_open_clip_flags.py)
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", argparse.SUPPRESS)}
    assert sorted(actions) == sorted(f.name for f in flags())
    for f in flags():
        assert tuple(actions[f.name].option_strings) == f.options, f.name
        assert f.doc and re.match(r"(same|differs: |ds_clip only)", f.meta["open_clip"]), f.name
    text = parser.format_help()
    for f in flags():
        assert (f.option in text) != f.meta["hidden"], f.option
    for flag in ("--synthetic-image-size", "--shuffle-buffer", "--log-dir", "(unit: steps; default: 10)"):
        assert flag in text
    # Every section field is reachable from the flat names used by the parser and settings.json.
    assert settings_to_dict(TrainSettings()).keys() == {f.name for f in flags()}


def test_eval_parser_reuses_the_training_fields():
    """ds-clip-eval's shared flags come from the same fields (same option, help, type), defaults aside."""
    from ds_clip import evaluate
    from ds_clip.evaluate.settings import EVAL_BATCH_SIZE

    train = {a.dest: a for a in build_parser()._actions}
    evals = {a.dest: a for a in evaluate.build_parser()._actions}
    for name in evaluate.SHARED_FLAGS:
        assert evals[name].option_strings == train[name].option_strings, name
        assert evals[name].type == train[name].type or evals[name].type.__name__ == train[name].type.__name__
    # --val-data is optional there: class folders alone (--zeroshot-folder, --imagenet-val) are an evaluation too.
    assert evals["batch_size"].default == EVAL_BATCH_SIZE and not evals["val_data"].required
    docs = {f.name: f.doc.replace("%", "%%") for f in flags()}
    assert all(
        evals[n].help.startswith(docs[n]) and train[n].help.startswith(docs[n]) for n in evaluate.SHARED_FLAGS
    )


def test_data_flags_reach_the_data_section():
    """--synthetic-image-size and --shuffle-buffer (documented in docs/data.md) are real flags; the data
    section is what ds_clip.data.build_train_data takes."""
    s = parse_settings(["--synthetic-image-size", "32", "--shuffle-buffer", "7", "--seed", "3"])
    assert (s.data.synthetic_image_size, s.data.shuffle_buffer, s.data.seed) == (32, 7, 3)
    # None: the model's image size, filled in by the trainer.
    assert parse_settings([]).data.synthetic_image_size is None
    # The section goes to the loader as it is: images rendered at --synthetic-image-size.
    import torch
    from torchvision.transforms import ToTensor

    from ds_clip.data import build_train_data
    from ds_clip.geometry import BatchGeometry

    s = parse_settings(["--synthetic-image-size", "32", "--workers", "0", "--train-num-samples", "4"])
    data = build_train_data(
        s.data, preprocess=ToTensor(), tokenizer=lambda caps: torch.zeros(len(caps), 4, dtype=torch.long),
        rank=0, geometry=BatchGeometry(world_size=1, accum_freq=1, micro_batch_size=2),
    )  # fmt: skip
    images, _ = next(iter(data.iter_epoch(0))).micro_batches[0]
    assert tuple(images.shape) == (2, 3, 32, 32)
    for argv, needle in (
        (["--synthetic-image-size", "4"], "--synthetic-image-size must be >= 8, got 4"),
        (["--shuffle-buffer", "-1"], "--shuffle-buffer must be >= 0, got -1"),
        (["--image-key", ";"], "--image-key must name at least one extension"),
    ):
        with pytest.raises(SettingsError, match=re.escape(needle)):
            parse_settings(argv)


def test_entry_point_prints_one_line_naming_the_flag_and_exits_2(capsys):
    from ds_clip.train import main

    assert main(["--accum-freq", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "ds-clip-train: error: --accum-freq must be >= 1, got 0\n"
    assert main(["--shuffle-buffer", "many"]) == 2  # argparse's own refusal: returned like every other one
    assert "--shuffle-buffer: invalid int value" in capsys.readouterr().err


def test_hostfile_example_parses_with_deepspeed():
    from deepspeed.launcher.runner import _parse_hostfile

    lines = (REPO / "hostfile.example").read_text().splitlines()
    assert _parse_hostfile(lines) == {"worker-1": 8, "worker-2": 8}


@pytest.mark.parametrize(
    "script", ["launch_single_node.sh", "launch_multi_node.sh", "launch_mpirun.sh", "launch_slurm.sbatch"]
)
def test_launch_scripts_pass_flags_through_and_parse(script):
    import subprocess

    path = REPO / "scripts" / script
    text = path.read_text()
    assert text.splitlines()[1].startswith("# Runs: ") and '"$@"' in text and "ds_clip.train" in text
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_loss_tile_size_reaches_the_built_loss_and_refuses_zero():
    """--loss-tile-size is the tile of the loss ds_clip.training.engine builds (what the equivalence matrix's tiled
    cases set to 3 so an 8-pair batch spans several tiles); 0 is refused naming the flag."""
    assert parse_settings(["--loss-tile-size", "3"]).loss.loss_tile_size == 3
    with pytest.raises(SettingsError, match="--loss-tile-size"):
        parse_settings(["--loss-tile-size", "0"])


def test_loader_workers_prefetch_a_whole_step():
    """Each loader worker may prepare ceil(k / workers) micro-batches ahead (at least DataLoader's 4), so the
    workers fill a step's k micro-batches while the previous step computes; none without workers."""
    from ds_clip.data.base import prefetch_factor

    assert prefetch_factor(1, 1) == 4 and prefetch_factor(8, 1) == 8 and prefetch_factor(8, 4) == 4
    assert prefetch_factor(32, 3) == 11 and prefetch_factor(8, 0) is None


def test_a_silent_rank_leaves_rank_0_time_to_report_a_refusal(monkeypatch, capsys):
    """A refusal every rank meets is written by rank 0 alone; another rank exits without a word, but only after a
    grace, because the launcher ends the job at the first rank's exit and would take rank 0's line with it."""
    import ds_clip.train as train_cli

    waited = []
    monkeypatch.setattr(train_cli.time, "sleep", waited.append)
    monkeypatch.setenv("RANK", "1")
    assert train_cli.main(["--batch-size", "0"]) == 2
    assert capsys.readouterr().err == "" and waited == [train_cli.QUIET_EXIT_GRACE_S]
    monkeypatch.setenv("RANK", "0")
    assert train_cli.main(["--batch-size", "0"]) == 2
    assert "ds-clip-train: error:" in capsys.readouterr().err and waited == [train_cli.QUIET_EXIT_GRACE_S]

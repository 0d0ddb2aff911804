"""A DeepSpeed JSON of the user's own (`--ds-config FILE`): precedence flag > file > default, "auto" filled, the
batch triple, optimizer and scheduler blocks, precision sections, refusals and --dry-run's provenance.

Unit tests of the parse and the resolution (no process group); the public files train or are refused under two
ranks in tests/test_public_ds_configs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_clip.config import SettingsError, parse_settings, resolve_deepspeed_for, resolve_geometry
from ds_clip.ds_config.resolve import fill_start_keys

PUBLIC = Path(__file__).resolve().parent / "data" / "ds_configs"


def _json(tmp_path: Path, data: dict, name: str = "mine.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _resolve(argv: list[str], world_size: int = 2):
    s = parse_settings(argv)
    return s, resolve_deepspeed_for(s, world_size, accelerator="cpu")


def _sources(ds) -> dict[str, str]:
    return dict(ds.sources)


HF_EXPLICIT = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.05},
    },
    "zero_optimization": {"stage": 2},
}


def test_file_values_fill_the_flags_left_at_their_defaults(tmp_path):
    """No default the user did not pass conflicts with the file: its values become the settings."""
    s, ds = _resolve(["--ds-config", _json(tmp_path, HF_EXPLICIT)])
    o = s.optim
    assert (o.batch_size, o.accum_freq, o.grad_clip_norm) == (16, 2, 1.0)
    assert (o.lr, o.beta1, o.beta2, o.eps, o.wd) == (1e-4, 0.9, 0.95, 1e-8, 0.05)
    assert {s.sources[f] for f in ("batch_size", "accum_freq", "lr", "beta2", "wd")} == {"ds_json"}
    cfg = ds.config
    assert cfg["optimizer"]["params"]["lr"] == 1e-4 and cfg["gradient_clipping"] == 1.0
    # k = 2 is exact cached accumulation; the engine runs one micro-batch per step.
    assert (
        cfg["gradient_accumulation_steps"],
        cfg["train_micro_batch_size_per_gpu"],
        cfg["train_batch_size"],
    ) == (
        1,
        16,
        32,
    )
    assert any("gradient_accumulation_steps=2" in n and "--accum-freq 2" in n for n in ds.notes), ds.notes
    assert resolve_geometry(s, 2).global_batch == 64


def test_a_passed_flag_wins_over_the_file_and_says_so(tmp_path):
    path = _json(tmp_path, HF_EXPLICIT)
    s, ds = _resolve(["--ds-config", path, "--lr", "3e-4", "--batch-size", "8", "--grad-clip-norm", "2"])
    assert s.optim.lr == 3e-4 and s.optim.batch_size == 8 and s.sources["lr"] == "flag"
    cfg = ds.config
    assert cfg["optimizer"]["params"]["lr"] == 3e-4 and cfg["gradient_clipping"] == 2.0
    assert cfg["train_micro_batch_size_per_gpu"] == 8
    assert f"--lr 0.0003 over optimizer.params.lr=0.0001 in {path}" in ds.notes
    assert f"--batch-size 8 over train_micro_batch_size_per_gpu=16 in {path}" in ds.notes
    sources = _sources(ds)
    assert sources["optimizer.params.lr"] == "flag --lr"
    assert sources["optimizer.params.eps"] == "JSON file"
    # A shipped preset's precision yields to a passed --precision the same way.
    s, ds = _resolve(["--ds-config", "zero2_bf16", "--precision", "fp32"])
    assert s.dist.precision == "fp32" and ds.config["bf16"]["enabled"] is False
    assert "--precision fp32 over bf16.enabled=true in ds_configs/zero2_bf16.json" in ds.notes


def test_auto_is_filled_from_flags_and_defaults():
    """Hugging Face's test config, all "auto": filled from the flags given and ds_clip's defaults."""
    path = str(PUBLIC / "hf-transformers_ds_config_zero2.json")
    argv = [
        "--ds-config",
        path,
        "--lr",
        "1e-3",
        "--grad-clip-norm",
        "2",
        "--precision",
        "bf16",
        "--warmup",
        "5",
    ]
    s, ds = _resolve(argv)
    cfg = ds.config
    assert cfg["optimizer"]["params"]["lr"] == 1e-3 and cfg["optimizer"]["params"]["betas"] == [0.9, 0.98]
    assert cfg["optimizer"]["params"]["eps"] == 1e-6 and cfg["optimizer"]["params"]["weight_decay"] == 0.2
    assert (
        cfg["gradient_clipping"] == 2.0 and cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    )
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (8, 1)
    sources = _sources(ds)
    assert sources["optimizer.params.lr"] == "auto <- flag --lr"
    assert sources["optimizer.params.betas"] == "auto <- default (--beta1/--beta2)"
    assert sources["bf16.enabled"] == "auto <- flag --precision"
    assert sources["train_micro_batch_size_per_gpu"] == "auto <- default (--batch-size)"
    assert sources["zero_optimization.stage"] == "JSON file"
    assert sources["managed_gradient_accumulation"].startswith("ds_clip")
    # ZeRO buckets that depend on the model's hidden size are filled when the model is built.
    s, ds = _resolve(["--ds-config", str(PUBLIC / "hf-accelerate_ds_config_zero3.json")])
    # --warmup 0 (the default) fills WarmupLR's "auto" warmup_num_steps with 1, the least DeepSpeed takes.
    assert ds.config["scheduler"]["params"]["warmup_num_steps"] == 1
    assert dict(ds.start_keys) == {
        "zero_optimization.reduce_bucket_size": "the model's hidden size at start",
        "zero_optimization.stage3_prefetch_bucket_size": "the model's hidden size at start",
        "zero_optimization.stage3_param_persistence_threshold": "the model's hidden size at start",
    }
    cfg = ds.config
    fill_start_keys(cfg, hidden_size=64, total_steps=10)
    zero = cfg["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (4096, 3686)
    assert zero["stage3_param_persistence_threshold"] == 640
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False


def test_an_auto_with_nothing_to_fill_it_is_refused(tmp_path):
    path = _json(tmp_path, {"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}})
    with pytest.raises(SettingsError, match='zero_optimization.allgather_bucket_size="auto"'):
        parse_settings(["--ds-config", path])


@pytest.mark.parametrize(
    ("keys", "world_size", "mkn"),
    [
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, 2, (8, 4, 64)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 2, (16, 2, 64)),
        ({"train_batch_size": 32}, 2, (16, 1, 32)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (4, 3, 24)),
        (
            {"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
            4,
            (4, 3, 48),
        ),
    ],
)
def test_any_two_of_the_batch_triple_set_n_m_and_k(tmp_path, keys, world_size, mkn):
    """DeepSpeed's meaning: train_batch_size = micro x accumulation x W; k runs as cached accumulation."""
    s = parse_settings(["--ds-config", _json(tmp_path, {"zero_optimization": {"stage": 1}, **keys})])
    g = resolve_geometry(s, world_size)
    assert (g.micro_batch_size, g.accum_freq, g.global_batch) == mkn
    cfg = resolve_deepspeed_for(s, world_size).config
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["train_batch_size"] == mkn[0] * world_size


def test_a_triple_that_does_not_divide_on_the_launch_is_refused_with_the_numbers(tmp_path):
    path = _json(tmp_path, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8})
    s = parse_settings(["--ds-config", path])
    with pytest.raises(SettingsError) as e:
        resolve_geometry(s, 3)
    msg = str(e.value)
    assert "train_batch_size=64" in msg and "train_micro_batch_size_per_gpu=8" in msg and "3 ranks" in msg
    path = _json(
        tmp_path,
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
    )
    with pytest.raises(SettingsError, match="gradient_accumulation_steps=2"):
        resolve_geometry(parse_settings(["--ds-config", path]), 2)  # 8 x 2 x 2 = 32, not 64


@pytest.mark.parametrize(
    ("block", "opt", "kind"),
    [
        ({"type": "Adam", "params": {"lr": 1e-3}}, "adamw", "Adam"),
        ({"type": "AdamW", "params": {"torch_adam": True, "adam_w_mode": True}}, "adamw", "AdamW"),
        ({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}, "adam", "Adam"),
        ({"type": "Lamb", "params": {"max_coeff": 0.3, "min_coeff": 0.01}}, "lamb", "Lamb"),
        ({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99]}}, "lion", "Lion"),
        ({"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95}}, "muon", "Muon"),
    ],
)
def test_optimizer_blocks_run_as_written(tmp_path, block, opt, kind):
    s, ds = _resolve(
        ["--ds-config", _json(tmp_path, {"zero_optimization": {"stage": 1}, "optimizer": block})]
    )
    assert s.optim.optimizer == opt and s.sources["optimizer"] == "ds_json"
    out = ds.config["optimizer"]
    assert out["type"] == kind
    for key, value in block["params"].items():
        assert out["params"][key] == value, key
    if opt == "adam":
        assert out["params"]["adam_w_mode"] is False and out["params"]["weight_decay"] == 0.01


def test_optimizers_this_machine_cannot_build_are_refused_naming_the_key(tmp_path):
    lamb = _json(tmp_path, {"zero_optimization": {"stage": 1}, "optimizer": {"type": "Lamb"}}, "lamb.json")
    s, ds = _resolve(["--ds-config", lamb])
    assert ds.optimizer_blocker.startswith(
        f'optimizer.type="Lamb" in {lamb}: DeepSpeed 0.19.8 builds FusedLamb'
    )
    for kind in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        path = _json(tmp_path, {"optimizer": {"type": kind, "params": {"lr": 1e-3}}})
        with pytest.raises(SettingsError, match=f'optimizer.type="{kind}" in .*need CUDA GPUs'):
            parse_settings(["--ds-config", path])
    path = _json(tmp_path, {"optimizer": {"type": "Adagrad"}})
    with pytest.raises(SettingsError, match='optimizer.type="Adagrad" .* is not one ds_clip runs'):
        parse_settings(["--ds-config", path])
    path = _json(tmp_path, {"optimizer": {"type": "Lamb"}})
    with pytest.raises(SettingsError, match='optimizer.type="Lamb" in .* conflicts with --opt adamw'):
        parse_settings(["--ds-config", path, "--opt", "adamw"])


@pytest.mark.parametrize(
    "block",
    [
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}},
        {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": "auto"}},
        {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "cos_min_ratio": 0.1}},
        {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5},
        },
    ],
)
def test_scheduler_blocks_run_as_written(tmp_path, block):
    s, ds = _resolve(
        ["--ds-config", _json(tmp_path, {"zero_optimization": {"stage": 1}, "scheduler": block})]
    )
    assert s.sources["lr_scheduler"] == "ds_json"
    cfg = ds.config
    assert cfg["scheduler"]["type"] == block["type"]
    for key, value in block["params"].items():
        if value != "auto":
            assert cfg["scheduler"]["params"][key] == value, key
    if block["type"] in ("WarmupDecayLR", "WarmupCosineLR"):  # the run's length, known at start
        assert dict(ds.start_keys) == {
            "scheduler.params.total_num_steps": "the run's optimizer steps at start"
        }
        fill_start_keys(cfg, hidden_size=8, total_steps=40)
        assert cfg["scheduler"]["params"]["total_num_steps"] == 40


def test_a_scheduler_block_and_a_passed_schedule_flag_are_refused_together(tmp_path):
    path = _json(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {}}})
    with pytest.raises(
        SettingsError, match='scheduler.type="WarmupLR" in .* conflicts with --lr-scheduler const'
    ):
        parse_settings(["--ds-config", path, "--lr-scheduler", "const"])
    with pytest.raises(
        SettingsError, match="sets one LR for every parameter group, which would overwrite --visual-lr"
    ):
        parse_settings(["--ds-config", path, "--visual-lr", "1e-4"])
    cosine = _json(tmp_path, {"scheduler": {"type": "WarmupCosineLR", "params": {}}}, "cos.json")
    assert parse_settings(["--ds-config", cosine, "--visual-lr", "1e-4"]).optim.visual_lr == 1e-4
    path = _json(tmp_path, {"scheduler": {"type": "LRRangeTest", "params": {}}})
    with pytest.raises(SettingsError, match='scheduler.type="LRRangeTest"'):
        parse_settings(["--ds-config", path])


@pytest.mark.parametrize(
    ("sections", "precision"),
    [
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"bfloat16": {"enabled": True}}, "bf16"),
        ({"fp16": {"enabled": True, "loss_scale": 0}}, "fp16"),
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "bf16"),
        ({"torch_autocast": {"enabled": True, "dtype": "float16"}}, "fp16"),
        ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, "fp32"),
    ],
)
def test_precision_sections_become_the_precision(tmp_path, sections, precision):
    s, ds = _resolve(["--ds-config", _json(tmp_path, {"zero_optimization": {"stage": 1}, **sections})])
    assert s.dist.precision == precision
    cfg = ds.config
    assert cfg["bf16"]["enabled"] is (precision == "bf16") and cfg["fp16"]["enabled"] is (precision == "fp16")
    if "torch_autocast" in sections:
        assert cfg["torch_autocast"]["enabled"] is False
        assert any(n.startswith("torch_autocast in") for n in ds.notes)
    path = _json(tmp_path, {"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(SettingsError, match="enables fp16.enabled and bf16.enabled: keep one precision"):
        parse_settings(["--ds-config", path])


def test_keys_only_a_gpu_or_nvme_serves_are_refused_naming_key_and_hardware(tmp_path):
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}
    s, ds = _resolve(["--ds-config", _json(tmp_path, nvme)])
    assert ds.hardware_blocker.startswith('zero_optimization.offload_param.device="nvme"')
    assert "accelerator is cpu" in ds.hardware_blocker
    with pytest.raises(SettingsError, match="nvme"):
        ds.refuse_blocked()
    zpp = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    assert (
        "ZeRO++'s quantization runs CUDA kernels"
        in _resolve(["--ds-config", _json(tmp_path, zpp)])[1].hardware_blocker
    )
    assert (
        resolve_deepspeed_for(
            parse_settings(["--ds-config", _json(tmp_path, nvme)]), 2, accelerator="cuda"
        ).hardware_blocker
        is None
    )


@pytest.mark.parametrize(
    "key",
    [
        {"tensor_parallel": {"autotp_size": 2}},
        {"pipeline": {"stages": "auto"}},
        {"hybrid_engine": {"enabled": True}},
        {"compression_training": {"weight_quantization": {}}},
        {"curriculum_learning": {"enabled": True}},
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
    ],
)
def test_keys_for_what_ds_clip_does_not_do_are_refused_naming_the_key(tmp_path, key):
    name = next(iter(key)) if "zero_optimization" not in key else "zero_hpz_partition_size"
    with pytest.raises(SettingsError, match=name):
        parse_settings(["--ds-config", _json(tmp_path, key)])


def test_logging_and_legacy_keys_are_accepted(tmp_path):
    keys = {
        "steps_per_print": 100,
        "wall_clock_breakdown": True,
        "zero_allow_untested_optimizer": True,
        "flops_profiler": {"enabled": False},
        "comms_logger": {"enabled": False},
        "activation_checkpointing": {"partition_activations": False},
        "zero_optimization": {"stage": 2, "cpu_offload": True},
    }
    s, ds = _resolve(["--ds-config", _json(tmp_path, keys)])
    cfg = ds.config
    assert cfg["steps_per_print"] == 100 and cfg["wall_clock_breakdown"] is True
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}  # the legacy cpu_offload
    assert "torch_adam" not in cfg["optimizer"]["params"]  # DeepSpeed's CPU Adam runs the offloaded states


def test_dry_run_prints_every_key_with_its_source(capsys):
    from ds_clip.train import main

    path = str(PUBLIC / "hf-transformers_ds_config_zero2.json")
    assert main(["--dry-run", "--ds-config", path, "--lr", "1e-3"]) == 0
    out = capsys.readouterr().out
    table = out.split("# where each DeepSpeed key came from")[1]
    rows = {ln.split()[0]: ln for ln in table.splitlines()[1:] if ln and not ln.startswith("#")}
    assert rows["optimizer.params.lr"].endswith("auto <- flag --lr")
    assert rows["optimizer.params.weight_decay"].endswith("auto <- default (--wd)")
    assert rows["zero_optimization.offload_optimizer.device"].endswith("JSON file")
    assert rows["gradient_accumulation_steps"].split()[1] == "1"
    assert rows["steps_per_print"].endswith("JSON file")
    cfg = json.loads(out.split("(ds_config.json)\n", 1)[1].split("\n# where", 1)[0])
    assert set(rows) >= {p for p, _ in _flat(cfg)}


def _flat(node, path=""):
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _flat(v, f"{path}.{k}" if path else k)]
    return [(path, node)]


def test_muon_from_the_json_and_the_flag_prints_its_split_in_dry_run(tmp_path, capsys):
    from ds_clip.train import main
    from ds_clip_harness.models import E2E_MODEL

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    model = f"local-dir:{tmp_path / 'm'}"
    muon = _json(
        tmp_path, {"zero_optimization": {"stage": 1}, "optimizer": {"type": "Muon", "params": {"lr": 0.02}}}
    )
    for argv in (["--ds-config", muon], ["--opt", "muon", "--lr", "0.02"]):
        assert main(["--dry-run", "--model", model, *argv]) == 0
        out = capsys.readouterr().out
        split = out.split("# --opt muon: the towers' hidden matrices in Muon, the rest in AdamW\n")[1]
        muon_line, adam_line = split.splitlines()[:2]
        assert (
            muon_line.startswith("Muon (")
            and "visual.transformer.resblocks.0.attn.in_proj_weight" in muon_line
        )
        assert (
            adam_line.startswith("AdamW (")
            and "visual.conv1.weight" in adam_line
            and "logit_scale" in adam_line
        )
        assert '"type": "Muon"' in out


def test_a_zero_value_deepspeed_rejects_is_one_line_naming_the_key():
    """transformers' ZeRO-3 test file sets reduce_bucket_size 0, which DeepSpeed 0.19.8's config reader rejects:
    one line before any engine, not pydantic's traceback from deepspeed.initialize."""
    path = str(PUBLIC / "hf-transformers_ds_config_zero3.json")
    s, ds = _resolve(["--ds-config", path])
    with pytest.raises(SettingsError) as e:
        ds.refuse_blocked()
    assert str(e.value).startswith(
        f"zero_optimization.reduce_bucket_size=0 in {path}: DeepSpeed 0.19.8 refuses it"
    )


def test_apex_amp_off_is_dropped_and_on_is_refused(tmp_path):
    """DeepSpeed 0.19.8 removed apex and refuses an "amp" key even when it is off (EVA-CLIP's files have one)."""
    s, ds = _resolve(["--ds-config", _json(tmp_path, {"amp": {"enabled": False, "opt_level": "O2"}})])
    assert "amp" not in ds.config and any(n.startswith("amp (NVIDIA apex") for n in ds.notes)
    with pytest.raises(SettingsError, match="amp.enabled=true in .*: NVIDIA apex's amp was removed"):
        parse_settings(["--ds-config", _json(tmp_path, {"amp": {"enabled": True}})])

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


# ------------------------------------------------------------------ what DeepSpeed makes of a file

# A cluster's file as users write it: the optimizer's lr, and a warm-up to a higher peak (DeepSpeed's own docs pair).
PEAK = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.05}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 2},
    },
    "zero_optimization": {"stage": 1},
}


def test_a_warmup_schedulers_peak_is_the_lr_as_deepspeed_sets_it(tmp_path):
    """DeepSpeed's WarmupLR sets every group's lr itself and peaks at warmup_max_lr, whatever the optimizer's lr:
    the run's lr is 3e-4, and no line names --lr, which nobody passed. A passed --lr still wins, saying so."""
    path = _json(tmp_path, PEAK)
    s, ds = _resolve(["--ds-config", path])
    assert s.optim.lr == 3e-4 and s.sources["lr"] == "ds_json"
    assert ds.config["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    assert not [n for n in ds.notes if "--lr" in n], ds.notes
    assert any(
        "warmup_max_lr=0.0003" in n and "optimizer.params.lr=0.0001 is not used" in n for n in ds.notes
    )
    s, ds = _resolve(["--ds-config", path, "--lr", "1e-3"])
    assert ds.config["scheduler"]["params"]["warmup_max_lr"] == 1e-3
    assert f"--lr 0.001 over scheduler.params.warmup_max_lr=0.0003 in {path}" in ds.notes


MUON_RATES = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-4, "momentum": 0.95}},
    "zero_optimization": {"stage": 1},
}


def test_muons_two_rates_pass_on_and_a_passed_lr_replaces_both_in_one_line(tmp_path):
    path = _json(tmp_path, MUON_RATES)
    s, ds = _resolve(["--ds-config", path])
    params = ds.config["optimizer"]["params"]
    assert (params["muon_lr"], params["adam_lr"]) == (0.02, 3e-4) and not ds.notes
    s, ds = _resolve(["--ds-config", path, "--lr", "1e-3"])
    assert (
        "muon_lr" not in ds.config["optimizer"]["params"]
        and "adam_lr" not in ds.config["optimizer"]["params"]
    )
    assert ds.notes == (
        f"--lr 0.001 over optimizer.params.muon_lr=0.02 and optimizer.params.adam_lr=0.0003 in {path}: Muon and "
        "its AdamW both train at --lr",
    )
    # One LR for every group would overwrite both rates: refused, naming the keys.
    with_one_lr = {**MUON_RATES, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    with pytest.raises(
        SettingsError, match=r'scheduler.type="WarmupLR" .* overwrite optimizer.params.muon_lr and'
    ):
        parse_settings(["--ds-config", _json(tmp_path, with_one_lr)])


def _mt5_clip(tmp_path):
    """A CLIP whose text tower is an mT5 encoder (open_clip's mt5 towers, from a local config: no download)."""
    from open_clip.model import CustomTextCLIP
    from transformers import MT5Config

    MT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    ).save_pretrained(tmp_path / "mt5")  # fmt: skip
    return CustomTextCLIP(
        embed_dim=16,
        vision_cfg={"image_size": 32, "patch_size": 8, "width": 32, "layers": 1, "head_width": 16},
        text_cfg={"hf_model_name": str(tmp_path / "mt5"), "hf_model_pretrained": False, "hf_proj_type": "linear",
                  "hf_pooler_type": "mean_pooler", "context_length": 8, "vocab_size": 64},
    )  # fmt: skip


def test_muon_takes_hidden_matrices_by_module_type_not_by_shape(tmp_path):
    """T5's relative_attention_bias is a 2-D nn.Embedding inside a block: AdamW's. The blocks' Linear weights
    and the ViT's fused attention projection are Muon's."""
    from ds_clip.training.optim import pin_muon_tags

    muon, adam = pin_muon_tags(_mt5_clip(tmp_path))
    bias = "text.transformer.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert bias in adam and bias not in muon
    assert "text.transformer.block.0.layer.0.SelfAttention.q.weight" in muon
    assert "text.transformer.block.1.layer.1.DenseReluDense.wo.weight" in muon
    assert "visual.transformer.resblocks.0.attn.in_proj_weight" in muon
    assert "visual.transformer.resblocks.0.attn.out_proj.weight" in muon
    for name in ("text.transformer.embed_tokens.weight", "text.proj.weight", "visual.conv1.weight"):
        assert name in adam, name
    assert not [n for n in muon if "layer_norm" in n or n.endswith("bias")]


def test_muon_on_zero3_turns_reduce_scatter_off_in_one_line_or_refuses_a_files_true(tmp_path):
    """DeepSpeed's own configuration page's Muon example (ZeRO-3): DeepSpeed's default reduce_scatter true raises
    "Muon and reduce scatter cannot be used together" on every rank."""
    path = str(PUBLIC / "deepspeed_docs_config-json_muon_zero3.json")
    s, ds = _resolve(["--ds-config", path])
    assert s.optim.optimizer == "muon" and ds.config["zero_optimization"]["reduce_scatter"] is False
    assert [n for n in ds.notes if "reduce_scatter" in n] == [
        f"zero_optimization.reduce_scatter=false for Muon on ZeRO stage 3 ({path}; DeepSpeed's default true raises "
        "'Muon and reduce scatter cannot be used together'): the gradients are all-reduced instead"
    ]
    asked = json.loads(Path(path).read_text())
    asked["zero_optimization"]["reduce_scatter"] = True
    with pytest.raises(
        SettingsError, match=r"zero_optimization.reduce_scatter=true in .*: DeepSpeed's Muon on ZeRO"
    ):
        parse_settings(["--ds-config", _json(tmp_path, asked)])
    # The flags ask the same of a shipped ZeRO-3 preset, which sets it true: turned off, one note.
    s, ds = _resolve(["--opt", "muon", "--ds-config", "zero3_fp32"])
    assert ds.config["zero_optimization"]["reduce_scatter"] is False
    assert any("ds_configs/zero3_fp32.json set it to true" in n for n in ds.notes), ds.notes


def test_bf16_master_weights_with_torch_autocast_run_as_deepspeed_runs_them():
    """DeepSpeedExamples' bf16_master_weight config enables bf16 (bf16 master weights, gradients and optimizer
    states) and torch_autocast together: DeepSpeed runs the pair, and so does ds_clip, as written."""
    path = str(PUBLIC / "dse_bf16_master_weight_bf16_full.json")
    s, ds = _resolve(["--ds-config", path])
    assert s.dist.precision == "bf16" and s.sources["precision"] == "ds_json"
    cfg = ds.config
    assert cfg["torch_autocast"] == {"enabled": True, "dtype": "torch.bfloat16"}
    assert cfg["bf16"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    assert cfg["fp16"]["enabled"] is False and not ds.notes


def test_zenflow_is_refused_naming_the_key_and_why(tmp_path):
    """DeepSpeed's ZenFlow tutorial config: refused before any rank starts, in words a command-line user can act on
    (DeepSpeed's ZenFlow runs its own accumulation over update_interval steps)."""
    zenflow = {
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "zenflow": {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
                        "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-5}},
        "train_batch_size": 8,
        "gradient_accumulation_steps": 1,
    }  # fmt: skip
    path = _json(tmp_path, zenflow)
    with pytest.raises(SettingsError) as e:
        parse_settings(["--ds-config", path])
    msg = str(e.value)
    assert msg.startswith(f"zero_optimization.zenflow in {path}: ZenFlow") and "\n" not in msg
    assert "update_interval" in msg and "step_engine_config" not in msg and "remove it" in msg


@pytest.mark.parametrize(
    ("block", "says"),
    [
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6}},
         "ends at total_num_steps=6, and the run has 100 optimizer steps: the last 94 train at lr 0"),
        ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6, "cos_min_ratio": 0.1}},
         "the last 94 train at cos_min_ratio=0.1 of the peak lr"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_first_step_size": 3}},
         "cycle_first_step_size + cycle_second_step_size = 6 steps, and the run has 100 optimizer steps: the last "
         "94 train at cycle_min_lr=1e-05"),
        ({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 500}},
         "warms up over warmup_num_steps=500 steps, not fewer than the run's 100 optimizer steps"),
    ],
)  # fmt: skip
def test_a_json_schedule_shorter_than_the_run_is_warned_of(tmp_path, block, says):
    from ds_clip.ds_config.resolve import json_schedule_warning

    path = _json(tmp_path, {"zero_optimization": {"stage": 1}, "scheduler": block})
    s, ds = _resolve(["--ds-config", path])
    cfg = ds.config
    fill_start_keys(cfg, hidden_size=8, total_steps=100)
    warning = json_schedule_warning(cfg, path, 100)
    assert warning is not None and warning.startswith(f"scheduler {block['type']} in {path} ")
    assert says in warning, warning
    assert json_schedule_warning(cfg, path, 6 if block["type"] != "WarmupLR" else 501) is None


def test_dry_run_shows_the_values_that_run_and_names_no_flag_left_out(tmp_path, capsys):
    """total_num_steps "auto" as the run fills it, train_batch_size as the N of the file, the JSON's short schedule
    warned of, and k derived from the file's key, not from a --global-batch-size nobody passed."""
    from ds_clip.train import main

    short = {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1, "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 1},
    }
    path = _json(tmp_path, short)
    assert main(["--dry-run", "--ds-config", path, "--max-steps", "6"]) == 0
    out = capsys.readouterr().out
    table = out.split("# where each DeepSpeed key came from")[1]
    rows = {
        ln.split()[0]: ln.split(None, 2) for ln in table.splitlines()[1:] if ln and not ln.startswith("#")
    }
    assert rows["scheduler.params.total_num_steps"][1] == "6"
    assert rows["train_batch_size"][1] == "8" and rows["train_batch_size"][2].startswith(
        "N = m x k x W = 4 x 2 x 1"
    )
    assert rows["gradient_accumulation_steps"][1] == "2"
    cfg = json.loads(out.split("(ds_config.json)\n", 1)[1].split("\n# where", 1)[0])
    assert cfg["scheduler"]["params"]["total_num_steps"] == 6 and '"auto"' not in json.dumps(cfg)
    assert f"(k derived from train_batch_size=8 in {path} on 1 rank)" in out
    assert "--global-batch-size" not in out and "--batch-size" not in out and " 1 ranks" not in out
    # A file whose schedule ends before the run: warned of here as at start.
    short["scheduler"]["params"]["total_num_steps"] = 3
    assert main(["--dry-run", "--ds-config", _json(tmp_path, short), "--max-steps", "6"]) == 0
    assert "# warning: scheduler WarmupDecayLR in " in capsys.readouterr().out


def _trained_rates(model: str, runs: list[tuple[list[str], int]]) -> list[dict]:
    """One rank: the trainer's engine for each command line (its one engine builder), then that many optimizer
    steps; the lr of each optimizer group DeepSpeed built, before the first step and after the last."""
    from ds_clip.step.cached import cached_step
    from ds_clip.training.engine import build_engine, build_model_bundle, resolve_run
    from ds_clip_harness.runs import RunSpec, step_micro_batches

    out = []
    for argv, steps in runs:
        s = parse_settings(["--model", model, "--workers", "0", *argv])
        bundle = build_model_bundle(s.model, seed=s.data.seed)
        geometry, ds = resolve_run(s, 1)
        built = build_engine(
            bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed, rank=0,
            total_steps=100,
        )  # fmt: skip
        engine = built.engine
        names = {id(p): n for n, p in bundle.model.named_parameters()}

        def groups(engine=engine, names=names):
            return [
                (g.get("use_muon"), g["lr"], [names[id(p)] for p in g["params"] if id(p) in names])
                for g in engine.basic_optimizer.param_groups
            ]

        before = groups()
        spec = RunSpec(
            model=model, micro_batch_size=geometry.micro_batch_size, accum_freq=1, steps=max(steps, 1)
        )
        for step in range(steps):
            batches, _ = step_micro_batches(spec, bundle.model_cfg, step, 0, 1)
            cached_step(engine, batches, built.loss_fn)
        out.append({"before": before, "after": groups()})
        engine.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_the_engine_trains_at_the_files_peak_and_at_muons_two_rates(tmp_path):
    """Read back from the optimizer DeepSpeed built: after WarmupLR's two warm-up steps every group trains at
    warmup_max_lr 3e-4 (not the optimizer block's 1e-4); Muon's half of every group starts at muon_lr 0.02 and
    the AdamW half at adam_lr 3e-4; --text-lr scales both halves of the text tower as it scales --lr."""
    from ds_clip.training.optim import tower_of
    from ds_clip_harness.groups import spawn_group
    from ds_clip_harness.models import write_model_dirs

    model = write_model_dirs(tmp_path / "models")["vit"]
    peak = _json(tmp_path, PEAK, "peak.json")
    # ZeRO-0: the optimizer DeepSpeed built holds the model's own parameters, named here.
    muon = _json(tmp_path, {**MUON_RATES, "zero_optimization": {"stage": 0}}, "muon.json")
    lr = parse_settings([]).optim.lr
    runs = [(["--ds-config", peak], 3), (["--ds-config", muon, "--warmup", "0", "--text-lr", str(lr / 2)], 0)]
    peak_run, muon_run = spawn_group(1, _trained_rates, model, runs)
    assert [r for _, r, _ in peak_run["after"]] == pytest.approx([3e-4] * len(peak_run["after"]), rel=1e-12)
    halves = muon_run["before"]
    assert {m for m, _, _ in halves} == {True, False}
    for use_muon, rate, members in halves:
        towers = {tower_of(n) for n in members}
        assert "text" not in towers or towers == {"text"}, members  # a group holds one lr
        scale = 0.5 if towers == {"text"} else 1.0
        assert rate == pytest.approx((0.02 if use_muon else 3e-4) * scale, rel=1e-12), (use_muon, members)
    assert any(m and r == pytest.approx(0.01) for m, r, _ in halves)  # the text tower's Muon half

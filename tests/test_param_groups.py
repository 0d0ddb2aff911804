"""Per-tower optimisation (--visual-lr/--text-lr/--visual-wd/--text-wd/--visual-ld/--text-ld): the groups
give every trainable parameter of the tiny models exactly once the LR and weight decay the flags ask for
(EVA-CLIP's layer decay, open_clip's no-decay rule), the defaults build the two groups open_clip builds,
and on 2 ranks DeepSpeed's config-built optimizer (torch AdamW on ZeRO-1 and ZeRO-3, CPU Adam under
zero2_offload) runs each group at its own LR: a tower at --visual-lr 0 does not move."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from ds_clip.config import parse_settings
from ds_clip.models.model import build_model, prepare_for_deepspeed
from ds_clip.training.optim import ParamGroupError, format_groups, param_groups_for
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import CONFIGS, write_model_dirs
from ds_clip_harness.runs import RunSpec, step_micro_batches

LR, WD = 1e-3, 0.1
TEXT_ROOTS = ("transformer.", "token_embedding", "positional_embedding", "ln_final", "text_projection")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return write_model_dirs(tmp_path_factory.mktemp("models"))


def _model(models, name: str) -> torch.nn.Module:
    model = build_model(models[name]).model
    prepare_for_deepspeed(model)
    return model


def _tower(name: str) -> str:
    if name.startswith("visual."):
        return "visual"
    return "text" if name.startswith(TEXT_ROOTS) else "rest"


def _layer(name: str, tower: str, num_layers: int) -> int:
    """EVA-CLIP's rule written out for the tiny models' names: embeddings 0, block i -> i+1, rest L+1."""
    block = re.search(r"\.(?:resblocks|blocks)\.(\d+)\.", "." + name)
    if block:
        return int(block.group(1)) + 1
    embeddings = {
        "visual": ("visual.conv1.", "visual.class_embedding", "visual.positional_embedding", "visual.ln_pre.",
                   "visual.trunk.cls_token", "visual.trunk.pos_embed", "visual.trunk.patch_embed."),
        "text": ("token_embedding.", "positional_embedding"),
    }[tower]  # fmt: skip
    return 0 if name.startswith(embeddings) else num_layers + 1


def _no_decay(name: str, p: torch.Tensor) -> bool:  # open_clip_train/main.py's `exclude`
    return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def _expected(model, name: str, p, flags: dict) -> tuple[float, float]:
    tower = _tower(name)
    lr = flags.get(f"{tower}_lr", LR) if tower != "rest" else LR
    wd = flags.get(f"{tower}_wd", WD) if tower != "rest" else WD
    ld = flags.get(f"{tower}_ld", 1.0) if tower != "rest" else 1.0
    if ld != 1.0:
        blocks = (
            model.visual.trunk.blocks
            if hasattr(model.visual, "trunk")
            else model.visual.transformer.resblocks
        )
        num_layers = len(blocks) if tower == "visual" else len(model.transformer.resblocks)
        lr = lr * ld ** (num_layers + 1 - _layer(name, tower, num_layers))
    return lr, 0.0 if _no_decay(name, p) else wd


def _argv(model: str, flags: dict) -> list[str]:
    argv = ["--model", model, "--lr", str(LR), "--wd", str(WD)]
    for key, value in flags.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


FLAG_SETS = [
    {},
    {"visual_lr": 0.0, "text_lr": 2e-3},
    {"visual_wd": 0.05, "text_wd": 0.0, "visual_lr": 5e-4},
    {"visual_ld": 0.5, "text_ld": 0.75, "text_lr": 3e-3},
    {"visual_ld": 0.65, "visual_lr": 2e-3, "visual_wd": 0.3},
]


@pytest.mark.parametrize("name", ["vit", "vit_siglip", "timm_dropout"])
@pytest.mark.parametrize(
    "flags", FLAG_SETS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "defaults"
)
def test_every_trainable_parameter_once_with_the_flags_lr_and_wd(models, name, flags):
    model = _model(models, name)
    s = parse_settings(_argv(models[name], flags))
    groups, infos = param_groups_for(model, s.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = [names[id(p)] for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert len(seen) == len(set(seen))
    params = dict(model.named_parameters())
    for group, info in zip(groups, infos):
        assert [names[id(p)] for p in group["params"]] == info.members
        assert info.num_params == sum(p.numel() for p in group["params"])
        for n in info.members:
            lr, wd = _expected(model, n, params[n], flags)
            assert (group["lr"], group["weight_decay"]) == (pytest.approx(lr, rel=1e-12), wd), n
    assert "#params" in format_groups(infos)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_defaults_build_open_clips_two_groups(models, name):
    """No per-tower flag: exactly open_clip's groups (no decay, then decay at --wd), parameters in model
    order, the LR of every group --lr: the optimizer of every run before these flags."""
    model = _model(models, name)
    groups, _ = param_groups_for(model, parse_settings(_argv(models[name], {})).optim)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [[id(p) for p in g["params"]] for g in groups] == [
        [id(p) for n, p in named if _no_decay(n, p)],
        [id(p) for n, p in named if not _no_decay(n, p)],
    ]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(LR, 0.0), (LR, WD)]


def test_frozen_parameters_are_in_no_group(models):
    model = _model(models, "vit")
    for p in model.visual.parameters():
        p.requires_grad_(False)
    groups, _ = param_groups_for(model, parse_settings(_argv(models["vit"], {"visual_lr": 1e-4})).optim)
    frozen = {id(p) for p in model.visual.parameters()}
    assert not any(id(p) in frozen for g in groups for p in g["params"])
    assert sum(len(g["params"]) for g in groups) == sum(1 for p in model.parameters() if p.requires_grad)


def test_layer_decay_on_a_resnet_tower_is_refused_naming_the_flag(models):
    model = _model(models, "resnet_bn")
    with pytest.raises(ParamGroupError, match="--visual-ld"):
        param_groups_for(model, parse_settings(_argv(models["resnet_bn"], {"visual_ld": 0.5})).optim)
    # the text tower of the same model is a transformer: its layer decay works
    param_groups_for(model, parse_settings(_argv(models["resnet_bn"], {"text_ld": 0.5})).optim)


BAD = [
    (["--visual-lr=-1e-4"], "--visual-lr"),
    (["--text-lr=-1"], "--text-lr"),
    (["--visual-wd=-0.1"], "--visual-wd"),
    (["--text-wd=-0.1"], "--text-wd"),
    (["--visual-ld", "0"], "--visual-ld"),
    (["--text-ld", "1.5"], "--text-ld"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_per_tower_flags_exit_2_naming_the_flag(argv, flag, capsys):
    from ds_clip.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert flag in err and "error" in err and "expected one argument" not in err, err


# ------------------------------------------------------------------ 2 ranks, DeepSpeed's own optimizers

PRESETS = [("zero1_fp32", 1), ("zero3_fp32", 3), ("zero2_offload_fp32", 2)]
TOWER_FLAGS = {"visual_lr": 0.0, "text_lr": 2e-3, "text_ld": 0.5, "text_wd": 0.05}


def _group_engines(model: str) -> list[dict]:
    """Every rank: for each preset, build the trainer's engine from the flags, take one optimizer step."""
    import torch.distributed as dist

    from ds_clip.step.cached import cached_step
    from ds_clip.training.engine import build_engine, build_model_bundle, resolve_run
    from ds_clip_harness.runs import full_params

    rank, world = dist.get_rank(), dist.get_world_size()
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ds_clip")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = []
    for preset, stage in PRESETS:
        argv = _argv(model, TOWER_FLAGS) + [
            "--ds-config", preset, "--zero-stage", str(stage), "--batch-size", "2", "--warmup", "0",
            "--eps", "1e-4", "--workers", "0",
        ]  # fmt: skip
        s = parse_settings(argv)
        bundle = build_model_bundle(s.model, seed=s.data.seed)
        groups, infos = param_groups_for(bundle.model, s.optim)
        logged.clear()
        geometry, ds = resolve_run(s, world)
        built = build_engine(
            bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed,
            rank=rank, total_steps=10,
        )  # fmt: skip
        tables: list = [None] * world  # the table logged by each rank while building
        dist.all_gather_object(tables, [m for m in logged if "optimizer parameter groups" in m])
        engine = built.engine
        before = full_params(engine)
        lr_before = list(engine.get_lr())
        spec = RunSpec(model=model, micro_batch_size=2, accum_freq=1, steps=1)
        batches, _ = step_micro_batches(spec, bundle.model_cfg, 0, rank, world)
        result = cached_step(engine, batches, built.loss_fn)
        out.append(
            {
                "preset": preset,
                "optimizer": type(engine.basic_optimizer).__name__,
                "groups": [(i.members, g["lr"], g["weight_decay"]) for g, i in zip(groups, infos)],
                "lr_before": lr_before,
                "lr_after": list(engine.get_lr()),
                "wd": [g["weight_decay"] for g in engine.optimizer.param_groups],
                "before": before,
                "after": full_params(engine),
                "skipped": result.skipped,
                "tables": tables,
            }
        )
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def engines(models) -> dict[str, dict]:
    return {r["preset"]: r for r in spawn_group(2, _group_engines, models["vit"])}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p, _ in PRESETS])
def test_deepspeed_optimizer_runs_each_group_at_its_lr(engines, models, preset):
    """engine.get_lr() per group is the group's peak x the cosine schedule (step 0: x1, step 1:
    x cos-decay(1/10)); the image tower at --visual-lr 0 is bit-for-bit unchanged after a step while the
    text tower and logit_scale moved."""
    from ds_clip.training.schedule import cosine_with_warmup

    r = engines[preset]
    if preset.startswith("zero2_offload"):
        assert r["optimizer"] == "DeepSpeedCPUAdam"
    assert not r["skipped"]
    model = _model(models, "vit")
    params = dict(model.named_parameters())
    for members, lr, wd in r["groups"]:
        for n in members:
            assert (lr, wd) == (pytest.approx(_expected(model, n, params[n], TOWER_FLAGS)[0], rel=1e-12),
                                _expected(model, n, params[n], TOWER_FLAGS)[1]), n  # fmt: skip
    peaks = [lr for _, lr, _ in r["groups"]]
    assert len(r["lr_before"]) == len(peaks) > 2
    assert r["lr_before"] == pytest.approx(peaks, rel=1e-12)
    factor = cosine_with_warmup(1, warmup=0, total=10)
    assert r["lr_after"] == pytest.approx([p * factor for p in peaks], rel=1e-12)
    assert r["wd"] == [wd for _, _, wd in r["groups"]]
    visual = [n for n in r["before"] if n.startswith("visual.")]
    assert visual and all(torch.equal(r["before"][n], r["after"][n]) for n in visual)
    moved = [
        n
        for n in r["before"]
        if not n.startswith("visual.") and not torch.equal(r["before"][n], r["after"][n])
    ]
    assert "logit_scale" in moved and "token_embedding.weight" in moved and "text_projection" in moved
    rank0, rank1 = r["tables"]
    assert rank1 == [] and len(rank0) == 1  # logged once, by rank 0
    rows = rank0[0].splitlines()[2:]
    assert len(rows) == len(r["groups"])
    for row, (members, lr, wd) in zip(rows, r["groups"]):
        label_end = row.index(" decay") if " decay" in row else row.index(" no-decay")
        count, shown_lr, shown_wd = row[label_end:].split()[1:]
        assert int(count) == sum(dict(model.named_parameters())[n].numel() for n in members)
        assert float(shown_lr) == pytest.approx(lr, rel=1e-3) and float(shown_wd) == pytest.approx(wd)


def test_muon_takes_the_towers_hidden_matrices_and_adamw_the_rest(models):
    """--opt muon: attention and MLP weights of both towers' blocks in Muon; embeddings, the patch stem, the
    projections, logit_scale, norms and biases in AdamW, and the tag stands against DeepSpeed's own re-tagging
    (any 2-D weight without "embed" in its name) in deepspeed.initialize."""
    from ds_clip.training.optim import pin_muon_tags

    model = _model(models, "vit")
    muon, adam = pin_muon_tags(model)
    assert muon and all(re.search(r"\.(resblocks)\.\d+\.", n) for n in muon), muon
    assert all(p.ndim == 2 for n, p in model.named_parameters() if n in muon)
    for name in (
        "visual.conv1.weight",
        "visual.proj",
        "text_projection",
        "token_embedding.weight",
        "logit_scale",
    ):
        assert name in adam, name
    assert not [n for n in muon if n.endswith("bias") or ".ln_" in n]
    params = dict(model.named_parameters())
    params["visual.proj"].use_muon = True  # what deepspeed.initialize's own rule writes: ignored
    assert params["visual.proj"].use_muon is False and params[muon[0]].use_muon is True

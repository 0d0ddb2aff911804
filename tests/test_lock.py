"""Locked towers (open_clip's --lock-image / --lock-text and their sub-flags): open_clip's own lock methods
decide what is frozen; locked parameters get no optimizer state and never change on ZeRO 0-3 and with
offload; a fully locked tower is embedded once per micro-batch (not recomputed in the cached step's phase
3); bad combinations exit 2 naming the flag. Exactness of a LiT step against the single-process oracle is
in tests/test_equivalence.py (the "lit" cases, ZeRO 1 and 3).
"""

from __future__ import annotations

import json

import pytest
import torch

from ds_clip.config import parse_settings
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import CONFIGS, E2E_MODEL, PRETRAINED_SEED, write_pretrained_dir
from ds_clip_harness.runs import RunSpec

K = 2
STEPS = 2


def _grad_map(model: torch.nn.Module) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in model.named_parameters()}


def test_lock_flags_freeze_what_open_clips_own_methods_freeze():
    """--lock-image-unlocked-groups 2 and --lock-text-unlocked-layers 1 leave exactly the parameters
    trainable that open_clip's lock_image_tower / lock_text_tower leave on the same model."""
    import open_clip

    from ds_clip.models.model import frozen_towers
    from ds_clip.training.engine import build_model_bundle

    argv = ["--lock-image", "--lock-image-unlocked-groups", "2", "--lock-text", "--lock-text-unlocked-layers", "1",
            "--lock-text-freeze-layer-norm"]  # fmt: skip
    ours = build_model_bundle(parse_settings(argv).model, seed=0).model
    ref = open_clip.create_model("ds-clip-tiny")
    ref.lock_image_tower(unlocked_groups=2)
    ref.lock_text_tower(unlocked_layers=1, freeze_layer_norm=True)
    assert _grad_map(ours) == _grad_map(ref)
    assert ours.visual.proj.requires_grad and not ours.visual.conv1.weight.requires_grad
    assert ours.text_projection.requires_grad and not ours.token_embedding.weight.requires_grad
    assert ours.logit_scale.requires_grad
    assert frozen_towers(ours) == (False, False)  # partly unlocked: both recomputed

    full = build_model_bundle(parse_settings(["--lock-image"]).model, seed=0).model
    assert frozen_towers(full) == (True, False)
    assert not any(p.requires_grad for p in full.visual.parameters())
    both = build_model_bundle(
        parse_settings(["--lock-image", "--lock-text", "--lock-text-freeze-layer-norm"]).model, seed=0
    )
    assert frozen_towers(both.model) == (True, True)
    assert [n for n, p in both.model.named_parameters() if p.requires_grad] == ["logit_scale"]


def test_freeze_bn_stats_replaces_batchnorm_as_open_clip_does(tmp_path):
    from ds_clip.training.engine import build_model_bundle

    (tmp_path / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": CONFIGS["resnet_bn"], "preprocess_cfg": {}})
    )
    model = f"local-dir:{tmp_path}"
    argv = ["--model", model, "--lock-image", "--lock-image-freeze-bn-stats"]
    visual = build_model_bundle(parse_settings(argv).model, seed=0).model.visual
    kinds = {type(m).__name__ for m in visual.modules()}
    assert "FrozenBatchNorm2d" in kinds and "BatchNorm2d" not in kinds


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lock-image-unlocked-groups", "1"], "--lock-image-unlocked-groups needs --lock-image"),
        (["--lock-image-freeze-bn-stats"], "--lock-image-freeze-bn-stats needs --lock-image"),
        (["--lock-text-unlocked-layers", "2"], "--lock-text-unlocked-layers needs --lock-text"),
        (["--lock-text-freeze-layer-norm"], "--lock-text-freeze-layer-norm needs --lock-text"),
        (["--lock-image", "--lock-image-unlocked-groups", "-1"], "--lock-image-unlocked-groups must be >= 0"),
        (["--lock-text", "--lock-text-unlocked-layers", "-2"], "--lock-text-unlocked-layers must be >= 0"),
    ],
)
def test_bad_lock_flags_exit_2_naming_the_flag(argv, needle, capsys):
    from ds_clip.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-clip-train: error: ") and needle in err, err


def test_what_a_tower_refuses_is_a_user_error_naming_the_flag(tmp_path):
    """open_clip asserts (its own text tower cannot leave LayerNorm trainable; a ResNet cannot be partly
    unlocked); ds_clip turns that into a UserError (exit 2) that names the flag to change."""
    from ds_clip.errors import UserError
    from ds_clip.training.engine import build_model_bundle

    with pytest.raises(UserError, match="add --lock-text-freeze-layer-norm"):
        build_model_bundle(parse_settings(["--lock-text"]).model, seed=0)
    (tmp_path / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": CONFIGS["resnet_bn"], "preprocess_cfg": {}})
    )
    argv = ["--model", f"local-dir:{tmp_path}", "--lock-image", "--lock-image-unlocked-groups", "1"]
    with pytest.raises(UserError, match="--lock-image-unlocked-groups 1: this image tower"):
        build_model_bundle(parse_settings(argv).model, seed=0)


# ------------------------------------------------------------------------------------- on the engine

# (ZeRO stage, offload, precision, which tower is locked). "image2-ckpt": --lock-image
# --lock-image-unlocked-groups 2 with --grad-checkpointing (the last block, ln_post and proj train).
PARTIAL = "image2-ckpt"
ENGINE_CASES = [
    (0, False, "fp32", "image"),
    (1, False, "fp32", "image"),
    (2, False, "fp32", "image"),
    (3, False, "fp32", "image"),
    (2, True, "fp32", "image"),
    (3, True, "fp32", "image"),
    (1, False, "bf16", "image"),
    (3, False, "fp32", "text"),
    (2, False, "fp32", PARTIAL),
    (3, False, "fp32", PARTIAL),
]


def _optimizer_state_elements(engine) -> int:
    """Elements of AdamW's first-moment state this rank holds (whatever the ZeRO stage partitions)."""
    total = 0
    for state in engine.basic_optimizer.state.values():
        if "exp_avg" in state:
            total += state["exp_avg"].numel()
    return total


def _counter(calls: dict[str, int], key: str):
    def hook(*_):
        calls[key] += 1

    return hook


def _engine_runs(model: str, cases: list) -> list[dict]:
    """Every rank trains each case for STEPS cached steps of K micro-batches and reports the locked and
    trainable parameters before and after, the optimizer state size, and the tower forwards per step."""
    import torch.distributed as dist

    from ds_clip import distributed
    from ds_clip.step.cached import cached_step, micro_batch_seed
    from ds_clip.training.engine import build_engine, build_model_bundle, resolve_run
    from ds_clip_harness.runs import FLAT_SCHEDULE_STEPS, full_params, step_micro_batches, train_argv

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, offload, precision, tower in cases:
        spec = RunSpec(
            model=model, micro_batch_size=2, accum_freq=K, steps=STEPS, zero_stage=stage, offload=offload,
            precision=precision, lock_image=tower in ("image", PARTIAL), lock_text=tower == "text",
            grad_checkpointing=tower == PARTIAL,
        )  # fmt: skip
        partial = ["--lock-image-unlocked-groups", "2"] if tower == PARTIAL else []
        s = parse_settings(train_argv(spec) + partial)
        bundle = build_model_bundle(s.model, seed=s.data.seed)
        geometry, ds = resolve_run(s, world)
        engine = build_engine(
            bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed,
            rank=rank, total_steps=FLAT_SCHEDULE_STEPS,
        )  # fmt: skip
        engine, loss_fn = engine.engine, engine.loss_fn
        locked = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad)
        before = full_params(engine)
        calls = {"image": 0, "text": 0}
        engine.module.visual.register_forward_hook(_counter(calls, "image"))
        engine.module.transformer.register_forward_hook(_counter(calls, "text"))
        engine.train()
        for step in range(STEPS):
            batches, gids = step_micro_batches(spec, bundle.model_cfg, step, rank, world)
            seeds = [micro_batch_seed(spec.seed, step, g) for g in gids]
            cached_step(engine, batches, loss_fn, micro_batch_seeds=seeds)
        after = full_params(engine)
        state = distributed.all_reduce_sum(
            torch.tensor([_optimizer_state_elements(engine)], dtype=torch.float64)
        )
        out.append(
            {
                "case": (stage, offload, precision, tower),
                "locked": locked,
                "before": before,
                "after": after,
                "state_elements": int(state.item()) // (world if stage == 0 else 1),
                "calls": dict(calls),
            }
        )
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A LiT starting point: a tiny ViT saved as an open_clip folder (config + safetensors), and its weights."""
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("pretrained") / "lit"
    model = write_pretrained_dir(folder, CONFIGS["vit"], seed=PRETRAINED_SEED)
    return model, load_file(str(folder / "open_clip_model.safetensors"))


@pytest.fixture(scope="module")
def engine_runs(pretrained) -> dict:
    model, _ = pretrained
    return {r["case"]: r for r in spawn_group(2, _engine_runs, model, ENGINE_CASES)}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case", ENGINE_CASES, ids=lambda c: f"z{c[0]}{'-offload' if c[1] else ''}-{c[2]}-{c[3]}"
)
def test_locked_parameters_never_change_and_hold_no_optimizer_state(case, engine_runs, pretrained):
    """2 ranks, k=2, 2 AdamW steps from the pretrained folder: every locked parameter is bit-identical to the
    export (fp32; bf16: to its bf16 rounding, which DeepSpeed applies to the whole module) before and after
    the steps, while every trainable one moved; the optimizer's state (summed over ranks: ZeRO partitions
    it) covers the trainable parameters only; a fully locked tower runs once per micro-batch (the cache
    pass), the other twice (cache pass and recompute) except micro-batch 0, whose graph is kept. Partly
    unlocked (--lock-image-unlocked-groups 2) under --grad-checkpointing: only the last block, ln_post and
    proj of the image tower train, and both towers are recomputed."""
    _, weights = pretrained
    r = engine_runs[case]
    stage, _, precision, tower = case
    last = max(int(n.split(".")[3]) for n in r["before"] if n.startswith("visual.transformer.resblocks."))
    unlocked = (f"visual.transformer.resblocks.{last}.", "visual.ln_post.", "visual.proj")
    prefix_locked = {
        "image": lambda n: n.startswith("visual."),
        PARTIAL: lambda n: n.startswith("visual.") and not n.startswith(unlocked),
        "text": lambda n: not n.startswith("visual.") and n != "logit_scale",
    }[tower]
    expected_locked = sorted(n for n in r["before"] if prefix_locked(n))
    assert r["locked"] == expected_locked and expected_locked
    for name in r["locked"]:
        export = weights[name].float().reshape(r["before"][name].shape)
        if precision == "bf16":
            export = export.to(torch.bfloat16).float()
        assert torch.equal(r["before"][name], export), name
        assert torch.equal(r["after"][name], r["before"][name]), name
    moved = [
        n for n in r["before"] if n not in r["locked"] and not torch.equal(r["after"][n], r["before"][n])
    ]
    trainable = [n for n in r["before"] if n not in r["locked"]]
    # Attention key biases get exactly zero gradient (softmax ignores them); everything else moves.
    assert set(trainable) - set(moved) <= {n for n in trainable if "in_proj_bias" in n}
    trainable_numel = sum(r["before"][n].numel() for n in trainable)
    locked_numel = sum(r["before"][n].numel() for n in r["locked"])
    # ZeRO pads its flat partitions by a few elements; a locked tower is thousands.
    assert trainable_numel <= r["state_elements"] < trainable_numel + min(locked_numel // 10, 4096), r[
        "state_elements"
    ]
    if tower == PARTIAL:  # partly unlocked: both towers are recomputed (under activation checkpointing)
        assert r["calls"] == {"image": STEPS * (2 * K - 1), "text": STEPS * (2 * K - 1)}
        return
    frozen, live = ("image", "text") if tower == "image" else ("text", "image")
    assert r["calls"][frozen] == STEPS * K
    assert r["calls"][live] == STEPS * (2 * K - 1)


# ----------------------------------------------------------------------------- through the real trainer

TRAINER_STAGES = (1, 2, 3)


def _lit_trainer_runs(model: str, logs: str) -> None:
    """ds_clip.training.trainer.train (what ds-clip-train runs) on every rank: LiT from the pretrained folder, k=2,
    3 steps straight, and the same run interrupted after step 2 and resumed from that checkpoint."""
    from ds_clip.checkpoint import tag_for
    from ds_clip.training.trainer import train

    for zero in TRAINER_STAGES:
        common = [
            "--model", model, "--lock-image", "--batch-size", "2", "--accum-freq", "2", "--zero-stage", str(zero),
            "--lr", "1e-3", "--eps", "1e-4", "--warmup", "1", "--workers", "1", "--train-num-samples", "64",
            "--logs", logs, "--log-every-n-steps", "3", "--save-every-n-steps", "2",
        ]  # fmt: skip
        train(parse_settings([*common, "--max-steps", "3", "--name", f"lit_z{zero}"]))
        straight_at_2 = f"{logs}/lit_z{zero}/checkpoints/{tag_for(2)}"
        train(
            parse_settings(
                [*common, "--max-steps", "3", "--name", f"litres_z{zero}", "--resume", straight_at_2]
            )
        )


@pytest.fixture(scope="module")
def pretrained_e2e(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """As `pretrained`, with the full vocabulary the trainer's captions need (and FLIP patch dropout)."""
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("pretrained_e2e") / "lit"
    cfg = {**E2E_MODEL, "vision_cfg": {**E2E_MODEL["vision_cfg"], "patch_dropout": 0.25}}
    model = write_pretrained_dir(folder, cfg, seed=PRETRAINED_SEED)
    return model, load_file(str(folder / "open_clip_model.safetensors"))


@pytest.fixture(scope="module")
def trainer_runs(pretrained_e2e, tmp_path_factory):
    model, _ = pretrained_e2e
    logs = tmp_path_factory.mktemp("lit_logs")
    spawn_group(2, _lit_trainer_runs, model, str(logs))
    return logs


@pytest.mark.distributed
@pytest.mark.parametrize("zero", TRAINER_STAGES)
def test_lit_through_the_trainer_resumes_exactly_and_exports_the_pretrained_image_tower(
    zero, trainer_runs, pretrained_e2e, tmp_path
):
    """2 ranks, the real trainer: a LiT run resumed at step 2 ends where the straight run ends (fp32: equal to
    float rounding), and ds-clip-export of either gives an open_clip folder whose image tower is the
    pretrained one bit for bit while the text tower moved."""
    from safetensors.torch import load_file

    from ds_clip.checkpoint import tag_for
    from ds_clip.export.openclip import export

    _, weights = pretrained_e2e
    exported = {}
    for name in (f"lit_z{zero}", f"litres_z{zero}"):
        out = export(str(trainer_runs / name / "checkpoints" / tag_for(3)), tmp_path / name)
        exported[name] = load_file(str(out / "open_clip_model.safetensors"))
    straight, resumed = exported[f"lit_z{zero}"], exported[f"litres_z{zero}"]
    assert set(straight) == set(weights)
    for key, value in weights.items():
        if key.startswith("visual."):
            assert torch.equal(straight[key], value) and torch.equal(resumed[key], value), key
        assert float((resumed[key] - straight[key]).abs().max()) <= 1e-6, key
    assert not torch.equal(straight["text_projection"], weights["text_projection"])

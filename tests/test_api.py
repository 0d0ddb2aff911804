"""ds_clip's step in a user's own loop (docs/api.md, "The step in your own loop"): the public names, the config
helper, and examples/own_loop.py under the real deepspeed launcher against the one-process oracle.

What the step refuses when the engine or loss is built wrong (a raw DeepSpeed config, a loss of the wrong
world size) runs in tests/test_step_guards.py's process group, which starts no extra ranks for it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest
import torch

from ds_clip.ds_config.presets import SettingsError
from ds_clip.ds_config.resolve import COALESCE_ENGINE_KEYS, STEP_ENGINE_KEYS, step_engine_config
from tests import launch
from tests.launch import ROOT

EXAMPLE = ROOT / "examples" / "own_loop.py"
W, K, STEPS = 2, 2, 2


def test_import_ds_clip_stays_light_and_exports_the_step():
    """`import ds_clip` (in a fresh interpreter) loads neither torch nor DeepSpeed nor open_clip: settings
    validation runs before any of them. `from ds_clip import cached_step, ...` then gives the very objects the
    trainer uses, and an unknown name is an AttributeError."""
    code = 'import sys, ds_clip; print(sorted(m for m in ("torch", "deepspeed", "open_clip") if m in sys.modules))'
    proc = subprocess.run(
        [sys.executable, "-c", code], env=launch.environment(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-3000:]

    import ds_clip
    import ds_clip.ds_config.resolve
    import ds_clip.models.model
    import ds_clip.step.cached
    import ds_clip.step.clamp
    import ds_clip.step.loss
    from ds_clip import (
        ContrastiveLoss,
        LossSpec,
        StepResult,
        cached_step,
        clamp_logit_scale,
        prepare_for_deepspeed,
        step_engine_config,
    )

    assert cached_step is ds_clip.step.cached_step and StepResult is ds_clip.step.StepResult
    assert ContrastiveLoss is ds_clip.step.loss.ContrastiveLoss and LossSpec is ds_clip.step.loss.LossSpec
    assert step_engine_config is ds_clip.ds_config.resolve.step_engine_config
    assert prepare_for_deepspeed is ds_clip.models.model.prepare_for_deepspeed
    assert clamp_logit_scale is ds_clip.step.clamp.clamp_logit_scale
    assert set(ds_clip.__all__) <= set(dir(ds_clip))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ds_clip.no_such_name  # noqa: B018


def test_step_engine_config_sets_the_step_keys_and_keeps_the_rest():
    """The user's dict is left alone; the copy has gradient_accumulation_steps 1 and STEP_ENGINE_KEYS (managed
    accumulation off), or COALESCE_ENGINE_KEYS with coalesce=True; every other key is the user's."""
    mine = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
    }
    before = json.dumps(mine)
    cfg = step_engine_config(mine)
    assert json.dumps(mine) == before
    assert cfg == {**mine, "gradient_accumulation_steps": 1, **STEP_ENGINE_KEYS}
    assert cfg["managed_gradient_accumulation"] is False
    coalesced = step_engine_config({**mine, "gradient_accumulation_steps": 1}, coalesce=True)
    assert coalesced == {**mine, "gradient_accumulation_steps": 1, **COALESCE_ENGINE_KEYS}


@pytest.mark.parametrize(
    ("config", "coalesce", "names"),
    [
        ({"gradient_accumulation_steps": 4}, False, ["gradient_accumulation_steps=4", "cached_step"]),
        ({"managed_gradient_accumulation": True}, False, ["managed_gradient_accumulation=true", "remove it"]),
        ({"gradient_allreduce_op": "sum"}, False, ['gradient_allreduce_op="sum"', "remove it"]),
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4},
            False,
            ["train_batch_size=32", "train_micro_batch_size_per_gpu"],
        ),
        ({"fp16": {"enabled": True}}, False, ["fp16", "ZeRO stage 0"]),
        ({"zero_optimization": 2}, False, ["zero_optimization", "JSON object"]),
        ({"zero_optimization": {"stage": 0}}, True, ["coalesce=True", "ZeRO stage 0"]),
        (
            {"zero_optimization": {"stage": 2}, "managed_gradient_accumulation": False},
            True,
            ["coalesce=True", "managed_gradient_accumulation=false"],
        ),
    ],
    ids=[
        "gas",
        "managed",
        "allreduce-sum",
        "train-batch-size",
        "fp16-zero0",
        "zero-not-object",
        "coalesce-zero0",
        "coalesce-unmanaged",
    ],
)
def test_step_engine_config_refuses_what_would_train_something_else(config, coalesce, names):
    """A key that would change what the step trains (or that DeepSpeed would reject at initialize) is a
    one-line SettingsError (exit 2 in ds_clip's entry points) naming the key in the user's config."""
    with pytest.raises(SettingsError) as info:
        step_engine_config({"train_micro_batch_size_per_gpu": 4, **config}, coalesce=coalesce)
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in names), message


def _load_example():
    spec = importlib.util.spec_from_file_location("own_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _oracle(example, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The example's model, data and optimizer in ONE process: every step embeds all W*k global micro-batches
    (each with the seed the example gives it, so patch dropout draws the same patches), open_clip's own
    ClipLoss on the whole batch, backward, the same SGD step and temperature clamp."""
    from open_clip.loss import ClipLoss

    model = example.build_model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=example.LR)
    losses = []
    for step in range(steps):
        images, texts = [], []
        for g in range(W * K):
            torch.manual_seed(1000 * step + g)  # the example's micro_batch_seeds
            out = model(*example.micro_batch(step, g))
            images.append(out["image_features"])
            texts.append(out["text_features"])
        loss = ClipLoss()(torch.cat(images), torch.cat(texts), out["logit_scale"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.logit_scale.data.clamp_(0, math.log(100))  # open_clip's clamp, as the example applies it
        losses.append(float(loss.detach()))
    return {n: t.detach().clone() for n, t in model.state_dict().items()}, losses


@pytest.mark.e2e
@pytest.mark.slow
def test_example_under_deepspeed_launcher_trains_the_one_process_oracle(tmp_path):
    """`deepspeed --num_gpus 2 examples/own_loop.py` (the user's model, ZeRO-2 config, SGD and data; ds_clip's
    cached_step, 2 ranks x k=2 x m=4) ends 2 steps where one process training open_clip's ClipLoss on all
    N = 16 pairs per step ends: every parameter incl. logit_scale within 1e-5 of the oracle's total update
    (SGD: the update is the gradient, so a gradient counted k or W times would show in full), the same losses,
    and a state_dict in open_clip's names and shapes (0-dim logit_scale)."""
    out = tmp_path / "params.pt"
    cmd = launch.deepspeed(str(EXAMPLE), "--steps", str(STEPS), "--accum-freq", str(K), "--out", str(out),
                           ranks=W, module=None)  # fmt: skip
    proc = launch.run(cmd, cwd=tmp_path, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]

    example = _load_example()
    expected, oracle_losses = _oracle(example, STEPS)
    printed = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+) over 16 pairs$", proc.stdout, re.M)]
    assert printed == pytest.approx(oracle_losses, abs=1e-4), (printed, oracle_losses)

    got = torch.load(out, weights_only=True)
    initial = example.build_model().state_dict()
    assert set(got) == set(expected) and got["logit_scale"].shape == torch.Size([])
    total = float(torch.sqrt(sum((expected[n] - initial[n]).float().pow(2).sum() for n in expected)))
    errors = {
        n: float((got[n] - expected[n]).norm()) / max(float((expected[n] - initial[n]).norm()), 1e-3 * total)
        for n in expected
    }
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (worst, errors[worst])
    assert float((expected["logit_scale"] - initial["logit_scale"]).abs()) > 1e-4  # the scale did train

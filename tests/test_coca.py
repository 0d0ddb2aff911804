"""CoCa: the caption term's arithmetic, the refusal of an output no objective trains, and a CoCa run
through the real trainer (resume equals straight; the export is an open_clip CoCa that generates).

The gradient contract for CoCa (W2k2 = W4k1 on ZeRO 0-3, one step against open_clip's own CoCaLoss on the
whole batch, captions of different lengths) is in tests/test_equivalence.py (the "coca" cases); the
deepspeed-launcher run in tests/test_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ds_clip.config import parse_settings
from ds_clip.errors import UserError
from ds_clip.step.caption import chunked_token_loss_sum
from ds_clip.step.checks import UntrainedOutputError, check_outputs
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import COCA_E2E_MODEL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_token_loss_is_cross_entropy_over_non_pad_tokens(dtype):
    """The fp32 chunked sum (3 rows per chunk, so chunks straddle captions) and its gradient equal
    F.cross_entropy(reduction="sum", ignore_index=pad) on the fp32 logits; the gradient comes back in the
    logits' own dtype, and pad tokens get none."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(1, 50, (3, 7))
    labels[0, 4:] = 0
    labels[2, 2:] = 0
    got = chunked_token_loss_sum(logits, labels, 0, chunk_elements=3 * 50)
    (got * 0.7).backward()
    grad = logits.grad
    logits.grad = None
    ref = F.cross_entropy(logits.float().permute(0, 2, 1), labels, ignore_index=0, reduction="sum")
    (ref * 0.7).backward()
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert grad.dtype == dtype
    torch.testing.assert_close(
        grad.float(), logits.grad.float(), rtol=0, atol=2e-6 if dtype == torch.float32 else 8e-3
    )
    assert float(grad[labels == 0].abs().max()) == 0.0


def test_an_output_no_objective_trains_is_refused():
    """A forward output the run's objective does not consume is a UserError (exit 2) naming --model and
    the output: a SigLIP bias under the CLIP loss, a CoCa decoder's logits without the caption term."""
    clip = {"image_features", "text_features", "logit_scale"}
    check_outputs(clip, siglip=False, caption=False)
    check_outputs(clip | {"logit_bias"}, siglip=True, caption=False)
    check_outputs(clip | {"logits", "labels"}, siglip=False, caption=True)
    with pytest.raises(UntrainedOutputError, match=r"--model.*'logit_bias'.*--siglip") as exc:
        check_outputs(clip | {"logit_bias"}, siglip=False, caption=False)
    assert isinstance(exc.value, UserError) and exc.value.exit_code == 2
    with pytest.raises(UntrainedOutputError, match=r"--model.*'labels', 'logits'"):
        check_outputs(clip | {"logits", "labels"}, siglip=True, caption=False)
    with pytest.raises(UntrainedOutputError, match=r"'extra'"):
        check_outputs(clip | {"extra"}, siglip=False, caption=True)


def test_coca_weights_are_open_clips_flags_and_defaults():
    s = parse_settings([])
    assert (s.loss.coca_contrastive_loss_weight, s.loss.coca_caption_loss_weight) == (1.0, 2.0)
    s = parse_settings(["--coca-caption-loss-weight", "0.5", "--coca-contrastive-loss-weight", "0"])
    assert (s.loss.coca_contrastive_loss_weight, s.loss.coca_caption_loss_weight) == (0.0, 0.5)
    with pytest.raises(UserError, match="--coca-caption-loss-weight"):
        parse_settings(["--coca-caption-loss-weight", "-1"])


# ----------------------------------------------------------------------------- through the real trainer

TRAINER_STAGES = (1, 3)


def _coca_trainer_runs(model: str, logs: str) -> None:
    """ds_clip.training.trainer.train (what ds-clip-train runs) on every rank: a CoCa, k=2, 3 steps straight, and the
    same run interrupted after step 2 and resumed from that checkpoint; then a CoCa with --siglip."""
    from ds_clip.checkpoint import tag_for
    from ds_clip.training.trainer import train

    for zero in TRAINER_STAGES:
        common = [
            "--model", model, "--batch-size", "2", "--accum-freq", "2", "--zero-stage", str(zero),
            "--lr", "1e-3", "--eps", "1e-4", "--warmup", "1", "--workers", "1", "--train-num-samples", "64",
            "--logs", logs, "--log-every-n-steps", "3", "--save-every-n-steps", "2",
        ]  # fmt: skip
        train(parse_settings([*common, "--max-steps", "3", "--name", f"coca_z{zero}"]))
        straight_at_2 = f"{logs}/coca_z{zero}/checkpoints/{tag_for(2)}"
        train(
            parse_settings(
                [*common, "--max-steps", "3", "--name", f"cocares_z{zero}", "--resume", straight_at_2]
            )
        )


@pytest.fixture(scope="module")
def coca_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("coca_model")
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": COCA_E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{d}"


@pytest.fixture(scope="module")
def trainer_runs(coca_dir, tmp_path_factory) -> Path:
    logs = tmp_path_factory.mktemp("coca_logs")
    spawn_group(2, _coca_trainer_runs, coca_dir, str(logs))
    return logs


@pytest.mark.distributed
@pytest.mark.parametrize("zero", TRAINER_STAGES)
def test_coca_through_the_trainer_resumes_exactly_and_exports_a_coca_that_generates(
    zero, trainer_runs, coca_dir, tmp_path
):
    """2 ranks, the real trainer, a CoCa at k=2: the run resumed at step 2 ends where the straight run ends
    (fp32: to float rounding), every text_decoder tensor moved from its initialisation, and ds-clip-export
    gives a folder that open_clip loads (strictly) as a CoCa whose generate() returns tokens."""
    import open_clip
    from safetensors.torch import load_file

    from ds_clip.checkpoint import tag_for
    from ds_clip.export.openclip import export
    from ds_clip.models.model import build_model

    exported = {}
    for name in (f"coca_z{zero}", f"cocares_z{zero}"):
        out = export(str(trainer_runs / name / "checkpoints" / tag_for(3)), tmp_path / name)
        exported[name] = out
    straight = load_file(str(exported[f"coca_z{zero}"] / "open_clip_model.safetensors"))
    resumed = load_file(str(exported[f"cocares_z{zero}"] / "open_clip_model.safetensors"))
    assert set(straight) == set(resumed)
    for key, value in straight.items():
        assert float((resumed[key] - value).abs().max()) <= 1e-6, key
    init = dict(build_model(coca_dir, seed=0).model.state_dict())
    decoder = [k for k in straight if k.startswith("text_decoder.")]
    assert decoder and all(not torch.equal(straight[k], init[k].reshape(straight[k].shape)) for k in decoder)

    model = open_clip.create_model(f"local-dir:{exported[f'coca_z{zero}']}").eval()
    assert isinstance(model, open_clip.CoCa)
    image = torch.randn(2, 3, 32, 32)
    tokens = model.generate(image, generation_type="top_k", seq_len=8, min_seq_len=2)
    assert tokens.dtype == torch.long and tokens.shape[0] == 2 and tokens.shape[1] > 1

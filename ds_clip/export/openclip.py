"""Export a ds_clip checkpoint as an open_clip model (consolidated fp32 weights in open_clip's names and shapes) or
as a transformers CLIPModel or SiglipModel folder, each with a model card (README.md) ready for the hub.

    ds-clip-export logs/RUN/checkpoints/step_00001000 OUT     # or logs/RUN (its latest complete checkpoint)
    ds-clip-export logs/RUN OUT --format transformers         # CLIPModel or SiglipModel, tokenizer, processor (hf_clip)
    hf upload YOUR_ORG/YOUR_MODEL OUT . --repo-type model     # the hub's own upload, printed by the export

OUT gets ``open_clip_config.json`` ({"model_cfg", "preprocess_cfg"}) and ``open_clip_model.safetensors``:

    open_clip.create_model_and_transforms("local-dir:OUT")                     # any model, loaded strictly
    open_clip.create_model_and_transforms(NAME, pretrained="OUT/open_clip_model.safetensors")  # a named one
    ds-clip-train --model local-dir:OUT ...   or   --model NAME --pretrained OUT   (fine-tuning)

``--ema``: the weight EMA of a run trained with ``--ema-decay`` (ds_clip.step.ema; its per-rank files assembled).

A ``--siglip2`` run trains parts besides the encoders under the model's ``siglip2`` attribute (the LocCa decoder, the
self-distillation heads, the mask token; its EMA teacher is a file of its own, ``siglip2_teacher.pt``, which the
export never reads). The export holds the encoders only, as the paper publishes them: ``exported_state`` leaves
every ``siglip2.`` tensor out of the weights (and of the EMA) before either format sees them, and refuses a
checkpoint that holds them while its settings say the run had no ``--siglip2``.

ZeRO-1/2/3 checkpoints are consolidated with DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
(the fp32 master weights, not the bf16 working copy); ZeRO-0 fp32 keeps the whole model in its
model-state file. ``logit_scale``/``logit_bias`` (shape [1] inside the engine) get open_clip's 0-dim
shape back, and the result is loaded strictly into a fresh open_clip model before it is written.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_clip.checkpoint import POINTER, CheckpointError, read_meta, resolve, safe_load
from ds_clip.config import Parser, add_flags
from ds_clip.errors import UserError
from ds_clip.export import hf_clip
from ds_clip.export.model_card import hub_upload_command, write_card
from ds_clip.models.model import without_random_init_warnings
from ds_clip.models.weights import WEIGHTS_FILE, resolve_pretrained  # noqa: F401 - the import path users rely on
from ds_clip.siglip2.defaults import image_tower_width
from ds_clip.step.ema import full_state_from_files

logger = logging.getLogger(__name__)

CONFIG_FILE = "open_clip_config.json"
# What marks a folder as holding an export of either format (--overwrite replaces it).
EXPORT_FILES = (WEIGHTS_FILE, CONFIG_FILE, "model.safetensors", "config.json")
FORMATS = ("open_clip", "transformers")
# The model attribute under which a --siglip2 run keeps its training-time parts (decoder, heads, mask token).
SIGLIP2_PREFIX = "siglip2."


class ExportError(UserError):
    """Bad export input; the message names the path."""


def consolidated_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """fp32 weights and buffers of a complete checkpoint folder, in the engine's names (shapes as stored)."""
    if any(path.glob("*zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
        # ZeRO-1's consolidation returns only the optimizer's parameters: frozen ones (--lock-image) are
        # whole in the model-state file (ZeRO-2/3 save them as frozen fragments, which it does read).
        model_states = path / "mp_rank_00_model_states.pt"
        if model_states.exists():
            for k, v in (safe_load(model_states, flag="checkpoint").get("module") or {}).items():
                state.setdefault(k, v)
    else:
        files = sorted(path.glob("mp_rank_00_model_states.pt"))
        if not files:
            raise CheckpointError(f"{path}: no DeepSpeed model-state file")
        state = safe_load(files[0], flag="checkpoint")["module"]
    return {
        k.removeprefix("module."): v.detach().float() if v.is_floating_point() else v
        for k, v in state.items()
    }


@dataclass(frozen=True)
class ExportedWeights:
    """What ``exported_state`` read: the weights an export writes, and how many parameters it left out."""

    state: dict[str, torch.Tensor]
    """In the engine's names and stored shapes (``to_open_clip`` gives open_clip's)."""
    left_out: int = 0
    """Parameters of SigLIP 2's training-time parts left out (0 for any other run)."""


def exported_state(path: Path, settings: dict, *, ema: bool = False) -> ExportedWeights:
    """The weights an export writes: the checkpoint's consolidated state, with ``ema`` the weight EMA in place of
    the trained parameters. Both formats read them here and only here, so what is left out is left out once:
    SigLIP 2's training-time parts (``SIGLIP2_PREFIX``) of a run whose ``settings`` (the flat settings the
    checkpoint was saved with, settings.json's keys) say ``siglip2``, said in one line; a checkpoint holding them
    without it is refused in one line (weights and settings of different runs), never loaded half-way."""
    averaged = full_state_from_files(path) if ema else {}  # first: a checkpoint without one fails at once
    state = consolidated_state_dict(path)
    state.update(averaged)  # the EMA has the trained parameters' names: one dict, filtered once
    parts = sorted(k for k in state if k.startswith(SIGLIP2_PREFIX))
    if not parts:
        return ExportedWeights(state)
    if not settings.get("siglip2"):
        more = f" and {len(parts) - 1} more tensors" if len(parts) > 1 else ""
        raise ExportError(
            f"{path}: the checkpoint holds SigLIP 2's training-time parts ({parts[0]}{more}) but its settings have "
            "no --siglip2: its weights and its ds_clip_meta.json are of different runs"
        )
    count = sum(state[k].numel() for k in parts)
    logger.info(
        "--siglip2: left out the LocCa decoder and the self-supervised heads, training-time parts (%s parameters in "
        "%d tensors under siglip2.), as the paper does: the export holds the encoders",
        f"{count:,}", len(parts),
    )  # fmt: skip
    return ExportedWeights({k: v for k, v in state.items() if not k.startswith(SIGLIP2_PREFIX)}, count)


def build_open_clip_model(model_cfg: dict, preprocess_cfg: dict | None = None):
    """A fresh (random) open_clip model from a model config, built by open_clip's own factory."""
    import tempfile

    import open_clip

    with tempfile.TemporaryDirectory() as tmp:  # an empty local-dir: open_clip builds, loads no weights
        (Path(tmp) / CONFIG_FILE).write_text(
            json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg or {}})
        )
        # The weights are loaded right after, from the checkpoint: open_clip's warnings that this model is
        # "initialized randomly" (no weights in the folder) would tell the user of a correct export the opposite.
        with without_random_init_warnings():
            return open_clip.create_model(f"local-dir:{tmp}")


def to_open_clip(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Reshape to the open_clip model's own shapes (0-dim logit_scale/logit_bias) and load it strictly."""
    target = model.state_dict()
    out = {}
    for k, v in state.items():
        if k not in target:
            continue  # non-persistent buffers DeepSpeed saved (open_clip's attn_mask is one)
        want = target[k]
        if v.numel() != want.numel():
            raise CheckpointError(
                f"{k}: {tuple(v.shape)} in the checkpoint, open_clip expects {tuple(want.shape)}"
            )
        out[k] = v.reshape(want.shape).to(want.dtype).contiguous().clone()
    model.load_state_dict(out, strict=True)  # raises on any missing key
    return out


def export(
    checkpoint: str,
    out: str | Path,
    *,
    ema: bool = False,
    cache_dir: str | None = None,
    fmt: str = "open_clip",
    overwrite: bool = False,
) -> Path:
    """Write the export of ``checkpoint`` into OUT and return OUT: with ``fmt`` "open_clip", open_clip_config.json and
    open_clip_model.safetensors (and, for a model whose tokenizer lives on the hub, that tokenizer's files: open_clip
    reads a local-dir: model's tokenizer from its folder); with "transformers", transformers' CLIPModel folder, or
    SiglipModel for the SigLIP architecture (ds_clip.export.hf_clip, ds_clip.export.hf_siglip). Both get a model card, README.md (ds_clip.export.model_card). ``ema``: the weight EMA of the
    trained parameters (--ema-decay) in place of their live values; buffers and frozen parameters, which no optimizer
    moves, are the live ones. A model transformers cannot represent, or a missing transformers, is refused before
    anything is written; so is an OUT that already holds an export, unless ``overwrite`` (as ds-clip-shards refuses
    to write over shards)."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    held = [name for name in EXPORT_FILES if (Path(out) / name).exists()]
    if held and not overwrite:
        raise ExportError(f"{out} already holds an export ({held[0]}); pass --overwrite to replace it")
    if fmt == "transformers":
        hf_clip.require_transformers()
    path = _resolve_export_source(checkpoint)
    meta = read_meta(path)
    model_cfg = meta.get("model_cfg")
    if not model_cfg:
        raise CheckpointError(
            f"{path}: the checkpoint records no model_cfg; cannot build the open_clip model"
        )
    preprocess_cfg = meta.get("preprocess_cfg") or {}
    if fmt == "transformers":
        hf_clip.check_mappable(model_cfg, preprocess_cfg)
    model = build_open_clip_model(model_cfg, meta.get("preprocess_cfg"))
    settings = meta.get("settings") or {}
    exported = exported_state(path, settings, ema=ema)
    state = to_open_clip(exported.state, model)
    text_cfg = model_cfg.get("text_cfg") or {}
    hf_tokenizer = _hf_tokenizer(text_cfg, cache_dir) if text_cfg.get("hf_tokenizer_name") else None
    built = (
        hf_clip.build_transformers(state, model_cfg, preprocess_cfg, hf_tokenizer)
        if fmt == "transformers"
        else None
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if built is not None:
        hf_clip.save_transformers(out, built)
    else:
        (out / CONFIG_FILE).write_text(
            json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, indent=1)
        )
        metadata = {
            "format": "pt",
            "ds_clip_step": str(meta["step"]),
            "ds_clip_weights": "ema" if ema else "live",
        }
        save_file(state, str(out / WEIGHTS_FILE), metadata=metadata)
        if hf_tokenizer is not None:  # open_clip reads a local-dir: model's tokenizer from its folder
            hf_tokenizer.tokenizer.save_pretrained(str(out))
    command = ["ds-clip-export", checkpoint, str(out), *(["--ema"] if ema else [])]
    bias = state.get("logit_bias")
    write_card(
        out, meta=meta, checkpoint=path, fmt=fmt, command=shlex.join([*command, "--format", fmt]),
        weights=f"weight EMA (--ema-decay {settings.get('ema_decay')})" if ema else "trained weights",
        logit_scale=float(state["logit_scale"]) if "logit_scale" in state else None,
        logit_bias=float(bias) if bias is not None else None, hf_class=hf_clip.target(model_cfg), ema=ema,
        image_width=image_tower_width(model.visual), left_out=exported.left_out,
    )  # fmt: skip
    return out


def _resolve_export_source(checkpoint: str) -> Path:
    """The complete checkpoint ``checkpoint`` names; a run folder whose run saved none is said to be one."""
    run = Path(checkpoint).expanduser()
    if (run / "settings.json").is_file() and not (run / "checkpoints" / POINTER).exists():
        raise ExportError(
            f"{checkpoint} is a run folder whose run saved no checkpoint (no checkpoints/{POINTER}): it stopped "
            "before its first save (a run saves at its end and at --save-every-n-steps / --save-frequency)"
        )
    return resolve(None, checkpoint)


def _hf_tokenizer(text_cfg: dict, cache_dir: str | None):
    """open_clip's HFTokenizer of ``text_cfg`` (its hf_tokenizer_name, context length and tokenizer_kwargs): a
    local folder as it is, a hub tokenizer from the cache (fetched when missing and allowed)."""
    from ds_clip.sources import hub

    name = text_cfg["hf_tokenizer_name"]
    if not Path(name).expanduser().is_dir():
        need = hub.Need(
            f"the checkpoint's tokenizer {name}", "tokenizer", name, ("tokenizer_config.json",), cache_dir
        )
        command = f"python -m ds_clip.fetch --model hf-hub:{name}"
        if hub.is_offline():
            hub.refuse_uncached([need], command)
        else:
            hub.fetch([need], command)
    from open_clip.tokenizer import HFTokenizer

    with hub.offline():
        return HFTokenizer(
            str(Path(name).expanduser()) if Path(name).expanduser().is_dir() else name,
            context_length=text_cfg.get("context_length", 77),
            cache_dir=cache_dir,
            tokenizer_mode=text_cfg.get("tokenizer_mode"),
            **(text_cfg.get("tokenizer_kwargs") or {}),
        )


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="ds-clip-export",
        description="Write a ds_clip checkpoint as an open_clip model folder (open_clip_config.json + safetensors) "
        "or a transformers CLIPModel or SiglipModel folder, with a model card (README.md).",
    )
    p.add_argument(
        "checkpoint", help="checkpoint folder (checkpoints/step_N), checkpoints folder, or run folder"
    )
    p.add_argument("out", help="output folder")
    p.add_argument(
        "--ema",
        action="store_true",
        help="export the weight EMA the run kept (--ema-decay) instead of the weights",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="open_clip",
        help="open_clip (open_clip_config.json + open_clip_model.safetensors) or transformers (CLIPModel, or "
        "SiglipModel for a SigLIP-architecture model, with tokenizer and processor; needs pip install 'ds_clip[hf]')",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an export already in the output folder")
    add_flags(p, ["cache_dir"])
    args = p.parse_args(argv)
    # The export's info lines (what it left out) on stdout, beside what it wrote; only while this command runs.
    said = logging.StreamHandler(sys.stdout)
    said.setFormatter(logging.Formatter("ds-clip-export: %(message)s"))
    level = logger.level
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    try:
        out = export(
            args.checkpoint, args.out, ema=args.ema, cache_dir=args.cache_dir, fmt=args.format,
            overwrite=args.overwrite,
        )  # fmt: skip
    except (CheckpointError, UserError) as exc:
        print(f"ds-clip-export: error: {str(exc).replace('--resume ', '')}", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    if args.format == "transformers":
        print(f"wrote {out} (config.json, model.safetensors, tokenizer, processor, README.md); load with "
              f"transformers.AutoModel.from_pretrained('{out}') and AutoProcessor.from_pretrained('{out}')")  # fmt: skip
    else:
        print(f"wrote {out / CONFIG_FILE}, {out / WEIGHTS_FILE} and README.md; load with "
              f"open_clip.create_model_and_transforms('local-dir:{out}')")  # fmt: skip
    print(f"fill in the licence in {out / 'README.md'}, then share it on the hub: {hub_upload_command(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

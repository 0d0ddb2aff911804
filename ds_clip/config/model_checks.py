"""The checks of the model section: the model name and its weights, the teacher, the locking, image and
augmentation flags. open_clip is imported only for a name ds_clip does not know itself or for --aug-cfg's keys.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from ds_clip.config.checks import check_choice, check_min, need
from ds_clip.config.fields import BUILTIN_MODELS, LOCAL_DIR_PREFIX
from ds_clip.config.flags import flag_named
from ds_clip.config.sections import ModelSettings, TrainSettings
from ds_clip.errors import SettingsError
from ds_clip.sources.hub import HF_HUB_PREFIX


def check_model(m: ModelSettings, *, resuming: bool = False) -> None:
    """--model, --pretrained and what they fetch: a known name and tag; offline, every file in the cache."""
    _check_model_name(m.model, m.pretrained)
    if m.pretrained:
        check_pretrained(m.pretrained, model=m.model)
    check_published(m.model, m.pretrained, m, load_weights=not resuming)


def check_published(
    model: str,
    pretrained: str | None,
    m: ModelSettings,
    *,
    load_weights: bool = True,
    pretrained_image: bool | None = None,
    flags: tuple[str, str] = ("--model", "--pretrained"),
) -> None:
    """Offline (HF_HUB_OFFLINE=1): every published file the model needs is in the cache, else one line naming
    the tag or repo, the file, the cache folder and the command that fills it. Online this looks at nothing
    (the run fetches at start). Skipped for the built-in models without published weights (no open_clip
    import)."""
    image = m.pretrained_image if pretrained_image is None else pretrained_image
    local = pretrained is not None and not is_published(pretrained) and Path(pretrained).expanduser().exists()
    if model in BUILTIN_MODELS and (not pretrained or local) and not image:
        return
    from ds_clip.sources import hub

    if not hub.is_offline():
        return
    needs = hub.model_needs(
        model, pretrained, cache_dir=m.cache_dir, pretrained_image=image, load_weights=load_weights,
        model_flag=flags[0], pretrained_flag=flags[1],
    )  # fmt: skip
    hub.refuse_uncached(needs, hub.fetch_command(model, pretrained, m.cache_dir, image))


def is_published(pretrained: str) -> bool:
    return pretrained.startswith(HF_HUB_PREFIX) or "://" in pretrained


def _check_model_name(
    model: str, pretrained: str | None, flag: str = "--model", pretrained_flag: str = "--pretrained"
) -> None:
    """A model name (built in, open_clip's, hf-hub:ORG/REPO, or local-dir: with its config) and its weights
    flag."""
    if model in BUILTIN_MODELS:
        return
    if model.startswith(LOCAL_DIR_PREFIX):
        folder = Path(model[len(LOCAL_DIR_PREFIX) :]).expanduser()
        if not (folder / "open_clip_config.json").is_file():
            raise SettingsError(f"{flag} {model}: {folder / 'open_clip_config.json'} not found")
        if pretrained:
            # open_clip ignores pretrained= for local-dir: and loads the folder's own weights.
            raise SettingsError(
                f"{pretrained_flag} is ignored with {flag} {model}: put the weights in that folder "
                "(open_clip_model.safetensors) instead"
            )
        return
    if model.startswith(HF_HUB_PREFIX):
        need(
            _is_repo_id(model[len(HF_HUB_PREFIX) :]),
            f"{flag} {model}: name a hub repo as hf-hub:ORG/REPO (e.g. hf-hub:timm/ViT-B-16-SigLIP)",
        )
        # open_clip ignores pretrained= for hf-hub: and loads the repo's own weights.
        need(
            not pretrained,
            f"{pretrained_flag} is ignored with {flag} {model}: the repo brings its own weights; drop "
            f"{pretrained_flag}",
        )
        return
    import open_clip  # only for names we do not know ourselves (a few seconds)

    if model not in open_clip.list_models():
        raise SettingsError(
            f"{flag} {model!r} is unknown: use {', '.join(BUILTIN_MODELS)}, an open_clip model name "
            "(open_clip.list_models()), hf-hub:ORG/REPO or local-dir:PATH"
        )


def _is_repo_id(repo: str) -> bool:
    parts = repo.split("/")
    return len(parts) == 2 and all(parts)


# The weight files open_clip loads from a local-dir: folder (open_clip_model.safetensors first).
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pth")


def check_distill(s: TrainSettings) -> None:
    """--distill-model / --distill-pretrained: a teacher that exists and holds trained weights, and an
    objective open_clip defines a distillation for. (Whether it reads the student's images and tokens is
    checked where both models are built: ds_clip.models.model.check_teacher_fits.)"""
    m = s.model
    if m.distill_model is None:
        need(m.distill_pretrained is None, "--distill-pretrained needs --distill-model (the teacher)")
        return
    _check_model_name(m.distill_model, m.distill_pretrained, "--distill-model", "--distill-pretrained")
    need(
        not s.loss.siglip,
        "--distill-model with --siglip: open_clip defines distillation (DistillClipLoss) for the softmax CLIP "
        "loss only; drop one of them",
    )
    if m.distill_pretrained:
        check_pretrained(m.distill_pretrained, "--distill-pretrained", model=m.distill_model)
    elif m.distill_model.startswith(HF_HUB_PREFIX):
        pass  # the repo brings its weights (fetched and checked like the student's)
    elif m.distill_model.startswith(LOCAL_DIR_PREFIX):
        folder = Path(m.distill_model[len(LOCAL_DIR_PREFIX) :]).expanduser()
        need(
            any(any(folder.glob(g)) for g in _WEIGHT_GLOBS),
            f"--distill-model {m.distill_model}: the folder holds no weights (*.safetensors, *.bin, *.pth); "
            "a teacher with random weights teaches nothing",
        )
    else:
        raise SettingsError(
            f"--distill-model {m.distill_model} needs --distill-pretrained (its weights: a tag such as openai, "
            "hf-hub:ORG/REPO, a URL or a file): a teacher with random weights teaches nothing"
        )
    # The teacher is never resumed from a checkpoint: its weights are always loaded.
    check_published(
        m.distill_model, m.distill_pretrained, m, pretrained_image=False,
        flags=("--distill-model", "--distill-pretrained"),
    )  # fmt: skip


def check_model_flags(m: ModelSettings) -> None:
    """The locking, image and augmentation flags: ranges, and each sub-flag only with its main flag. (What
    depends on the tower, e.g. unlocked groups of a ResNet, open_clip refuses when the model is built.)"""
    for name, main in (
        ("lock_image_unlocked_groups", "lock_image"),
        ("lock_image_freeze_bn_stats", "lock_image"),
        ("lock_text_unlocked_layers", "lock_text"),
        ("lock_text_freeze_layer_norm", "lock_text"),
    ):
        value = getattr(m, name)
        if isinstance(value, int) and not isinstance(value, bool):
            check_min(name, value, 0)
        need(
            not value or getattr(m, main),
            f"{flag_named(name).option} needs {flag_named(main).option} (it only changes a locked tower)",
        )
    if m.force_patch_dropout is not None:
        need(
            0 <= m.force_patch_dropout < 1,
            f"--force-patch-dropout must be in [0, 1) (a fraction of patches), got {m.force_patch_dropout}",
        )
    if m.force_image_size is not None:
        need(
            len(m.force_image_size) in (1, 2) and all(v >= 1 for v in m.force_image_size),
            f"--force-image-size takes one side or height and width in pixels (>= 1), got {m.force_image_size}",
        )
    for name in ("image_mean", "image_std"):
        values = getattr(m, name)
        if values is not None:
            option = flag_named(name).option
            need(len(values) in (1, 3), f"{option} takes 1 or 3 values (per channel), got {len(values)}")
            need(name != "image_std" or min(values) > 0, f"{option} values must be > 0, got {values}")
    if m.image_interpolation is not None:
        check_choice("image_interpolation", m.image_interpolation)
    if m.image_resize_mode is not None:
        check_choice("image_resize_mode", m.image_resize_mode)
    check_min("force_context_length", m.force_context_length, 1, optional=True)
    if m.aug_cfg:
        aug_cfg_dict(m.aug_cfg)


def aug_cfg_dict(words: list[str]) -> dict[str, Any]:
    """--aug-cfg words -> open_clip's aug_cfg dict, read as open_clip_train's ParseKwargs reads them (each
    value a Python literal, else the plain string); unknown keys refused, as AugmentationCfg would."""
    from dataclasses import fields as dc_fields

    from open_clip.transform import AugmentationCfg  # only when --aug-cfg is given

    known = {f.name for f in dc_fields(AugmentationCfg)}
    out: dict[str, Any] = {}
    for word in words:
        key, sep, text = word.partition("=")
        need(bool(sep) and bool(key), f"--aug-cfg: {word!r} is not KEY=VALUE")
        need(key in known, f"--aug-cfg: unknown key {key!r}; open_clip's keys: {', '.join(sorted(known))}")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text  # as open_clip: a bare word (rand-m9-mstd0.5) is a string
    return out


def check_pretrained(pretrained: str, flag: str = "--pretrained", *, model: str | None = None) -> None:
    """A local file or folder, hf-hub:ORG/REPO, an http(s) URL, or an open_clip tag of ``model``."""
    path = Path(pretrained).expanduser()
    if path.is_dir():
        # An exported folder (ds-clip-export): the trainer loads its open_clip_model.safetensors.
        need(
            any(path.glob("*.safetensors")) or any(path.glob("*.bin")),
            f"{flag} {pretrained!r}: the folder holds no *.safetensors or *.bin weights",
        )
        return
    if path.exists():
        return
    if pretrained.startswith(HF_HUB_PREFIX):
        need(
            _is_repo_id(pretrained[len(HF_HUB_PREFIX) :]),
            f"{flag} {pretrained}: name a hub repo as hf-hub:ORG/REPO",
        )
        return
    if "://" in pretrained:
        need(
            pretrained.split("://", 1)[0] in ("http", "https"),
            f"{flag} {pretrained}: only http(s) URLs are fetched (open_clip's download_pretrained_from_url)",
        )
        return
    if model is None or model in BUILTIN_MODELS or model.startswith((LOCAL_DIR_PREFIX, HF_HUB_PREFIX)):
        raise SettingsError(
            f"{flag} {pretrained!r}: no such file or folder, and {model or 'this model'} has no open_clip tags "
            "(tags such as laion2b_s34b_b79k belong to open_clip model names: open_clip.list_pretrained())"
        )
    from ds_clip.sources import hub

    if not hub.tag_cfg(model, pretrained):
        raise SettingsError(str(hub.unknown_tag(model, pretrained, flag)))

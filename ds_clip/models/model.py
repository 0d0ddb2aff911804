"""open_clip models made ready for a DeepSpeed engine (their optimizer groups: ds_clip.training.optim).

Everything model-shaped comes from open_clip (architectures, tokenizers, transforms); this module only
adds what DeepSpeed 0.19.x needs to hold an open_clip model correctly:

* 0-dim parameters (``logit_scale``, SigLIP's ``logit_bias``) break DeepSpeed's start-up broadcast on
  more than one rank (``_broadcast_model`` views every parameter as bytes). We store them as shape
  ``[1]`` inside the engine and give them back as 0-dim in every ``state_dict()``, so checkpoints and
  exported weights keep open_clip's shapes and load strictly into a plain open_clip model.
* Under ZeRO-3 a parameter returned from ``forward`` (SigLIP returns ``logit_bias`` itself) is
  released to an empty shard as soon as the module's forward ends; we return a copy instead so the
  caller sees the value and gradients still flow to the parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import open_clip
import torch
from torch import nn

from ds_clip.errors import UserError

BUILTIN_CONFIG_DIR = Path(__file__).resolve().parents[1] / "model_configs"
# Registered with open_clip so the built-in names work anywhere open_clip resolves model names.
open_clip.add_model_config(BUILTIN_CONFIG_DIR)
BUILTIN_MODELS = sorted(p.stem for p in BUILTIN_CONFIG_DIR.glob("*.json"))


def _initialise_coca_decoders() -> None:
    """open_clip 3.3's ``MultimodalTransformer`` (CoCa's text decoder) never initialises its parameters: its
    ``init_parameters()`` is never called (and would fail: it reads ``self.transformer``, which this subclass
    of ``Transformer`` does not have), so ``text_projection`` (width x vocabulary) is left as ``torch.empty``,
    uninitialised memory (measured: all zeros in one process, 1e27 in another). A CoCa trained from scratch
    would start from garbage logits that differ between runs with the same --seed. Here the decoder gets, at
    construction, the initialisation that method means (open_clip's standard deviations, as for its text
    tower); a checkpoint or pretrained weights loaded afterwards replace it as before."""
    from open_clip.transformer import MultimodalTransformer

    if getattr(MultimodalTransformer, "_ds_clip_initialised", False):
        return
    construct = MultimodalTransformer.__init__

    def __init__(self, *args, **kwargs):
        construct(self, *args, **kwargs)
        proj_std = (self.width**-0.5) * ((2 * self.layers) ** -0.5)
        attn_std, fc_std = self.width**-0.5, (2 * self.width) ** -0.5
        for block in [*self.resblocks, *self.cross_attn]:
            nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
            nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        if self.text_projection is not None:
            nn.init.normal_(self.text_projection, std=self.width**-0.5)

    MultimodalTransformer.__init__ = __init__
    MultimodalTransformer._ds_clip_initialised = True


_initialise_coca_decoders()


class ModelError(UserError):
    """A model name or weight file that cannot be used (names the flag)."""


def _unsafe_weights(path: str) -> ModelError:
    return ModelError(
        f"--pretrained {path} needs arbitrary unpickling to load (torch.load weights_only=True refused it); "
        "ds_clip only loads tensors from weight files, because unpickling can run code. Save a plain state "
        "dict (torch.save(model.state_dict())) or safetensors instead."
    )


@dataclass
class ModelBundle:
    """An open_clip model with the tokenizer and transforms that belong to it."""

    model: nn.Module
    tokenizer: Any
    preprocess_train: Any
    preprocess_val: Any
    name: str
    model_cfg: dict


def load_model_cfg(name: str, cache_dir: str | None = None) -> dict:
    """The open_clip model config (``embed_dim``, ``vision_cfg``, ``text_cfg``...) for a name (an ``hf-hub:``
    model's from the cache)."""
    if name.startswith("local-dir:"):
        cfg = json.loads((Path(name[len("local-dir:") :]) / "open_clip_config.json").read_text())
        return cfg["model_cfg"]
    if name.startswith("hf-hub:"):
        from open_clip.factory import _get_hf_config

        from ds_clip.sources.hub import offline

        with offline():
            return _get_hf_config(name[len("hf-hub:") :], cache_dir=cache_dir)["model_cfg"]
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        raise ValueError(f"unknown open_clip model {name!r}")
    return cfg


@dataclass(frozen=True)
class TowerLocks:
    """open_clip's locking flags (``--lock-image`` ...), applied by open_clip's own lock methods."""

    image: bool = False
    image_unlocked_groups: int = 0
    image_freeze_bn_stats: bool = False
    text: bool = False
    text_unlocked_layers: int = 0
    text_freeze_layer_norm: bool = False


@dataclass(frozen=True)
class ImageOptions:
    """open_clip's model and transform overrides (``--force-image-size`` ...): None keeps the model's."""

    force_patch_dropout: float | None = None
    force_image_size: int | tuple[int, int] | None = None
    image_mean: tuple[float, ...] | None = None
    image_std: tuple[float, ...] | None = None
    image_interpolation: str | None = None
    image_resize_mode: str | None = None
    aug_cfg: dict[str, Any] | None = None
    force_quick_gelu: bool = False
    force_custom_text: bool = False
    force_context_length: int | None = None


def build_model(
    name: str,
    *,
    pretrained: str | None = None,
    seed: int | None = 0,
    grad_checkpointing: bool = False,
    image: ImageOptions | None = None,
    locks: TowerLocks | None = None,
    cache_dir: str | None = None,
    pretrained_image: bool = False,
    load_weights: bool = True,
) -> ModelBundle:
    """Create an open_clip model (fp32, on the CPU) plus its tokenizer and transforms.

    ``seed`` makes the initial weights identical on every rank and in every run with that seed, which
    the equivalence tests and the demo rely on (DeepSpeed also broadcasts rank 0's weights).
    ``image`` goes to open_clip.create_model_and_transforms as open_clip_train passes it, so it reaches both
    the model and the transforms; ``locks`` are applied after the weights are loaded, as open_clip_train
    does, before any engine sees the model (locked parameters: ``requires_grad`` False).

    Published weights (``pretrained`` an open_clip tag, ``hf-hub:ORG/REPO`` or a URL; ``name`` an ``hf-hub:``
    model; ``pretrained_image``: timm's weights for the image tower) and hub tokenizers are fetched into
    ``cache_dir`` by open_clip's own loaders when the cache lacks them (``ds_clip.sources.hub.fetch``; a trainer fetches
    once per host before this), then the model is built from the cache with no network call. ``load_weights``
    False (a resumed run, whose checkpoint holds the weights) fetches and loads no weights at all.
    """
    from ds_clip.sources import hub

    _ensure_cached(name, pretrained, cache_dir, pretrained_image, load_weights)
    if seed is not None:
        torch.manual_seed(seed)
    kwargs = _create_kwargs(name, pretrained, image, cache_dir, pretrained_image, load_weights)
    import pickle

    # Resumed (load_weights False): the checkpoint's weights replace these right after, and ds_clip has said so
    # ("continuing from ... (step N)"); open_clip's "initialized randomly" would say the opposite.
    quiet = contextlib.nullcontext() if load_weights else without_random_init_warnings()
    try:
        with hub.offline(), quiet:  # everything is in the cache now: no rank calls the network
            model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(name, **kwargs)
    except pickle.UnpicklingError as exc:
        raise _unsafe_weights(pretrained) from exc
    if locks is not None:
        lock_towers(model, locks)
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    context_length = image.force_context_length if image is not None else None
    tokenizer = _tokenizer(name, context_length, cache_dir)
    model_cfg = _built_cfg(load_model_cfg(name, cache_dir), image)
    return ModelBundle(model, tokenizer, preprocess_train, preprocess_val, name, model_cfg)


# open_clip's warnings that a model was built without weights (root logger): true of a fresh run from scratch,
# false of a model whose weights a checkpoint is about to replace.
_RANDOM_INIT_WARNINGS = (
    "No pretrained weights loaded for model",
    "Local config loaded, but no CLIP weights found",
)


def _no_random_init_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_RANDOM_INIT_WARNINGS)


@contextlib.contextmanager
def without_random_init_warnings():
    """open_clip's "initialized randomly" warnings left out while the block runs (and only then)."""
    root = logging.getLogger()
    root.addFilter(_no_random_init_warning)
    try:
        yield
    finally:
        root.removeFilter(_no_random_init_warning)


def _ensure_cached(
    name: str, pretrained: str | None, cache_dir: str | None, pretrained_image: bool, load_weights: bool
) -> None:
    """Every published file the model needs is in the cache: fetched by open_clip's loaders when it is not
    (nothing when it is), or, offline, refused in one line naming the file and the command that fills it."""
    from ds_clip.sources import hub

    def needs_now() -> list[hub.Need]:
        return hub.model_needs(
            name,
            pretrained,
            cache_dir=cache_dir,
            pretrained_image=pretrained_image,
            load_weights=load_weights,
        )

    command = hub.fetch_command(name, pretrained, cache_dir, pretrained_image)
    if hub.is_offline():
        hub.refuse_uncached(needs_now(), command)
    else:
        hub.fetch_all(needs_now, command)


def _create_kwargs(
    name: str,
    pretrained: str | None,
    image: ImageOptions | None,
    cache_dir: str | None,
    pretrained_image: bool,
    load_weights: bool,
) -> dict[str, Any]:
    """open_clip.create_model_and_transforms's keyword arguments, as open_clip_train passes them."""
    from ds_clip.sources import hub

    # Resumed (load_weights False): no tower weights either (timm's, a Hugging Face text tower's); the
    # checkpoint restores every parameter.
    kwargs: dict[str, Any] = {
        "output_dict": True,
        "cache_dir": cache_dir,
        "pretrained_image": pretrained_image and load_weights,
        "pretrained_text": load_weights,
    }
    tag = hub.tag_cfg(name, pretrained) if pretrained else {}
    if pretrained and load_weights:
        # (a local-dir: model loads the weights in its own folder; config refuses --pretrained with it)
        kwargs["pretrained"] = (
            _local_weights(pretrained, cache_dir) if hub.is_published(pretrained) else pretrained
        )
    if not load_weights:
        kwargs["load_weights"] = False
        # open_clip would still resolve (fetch) a tag's file to read its preprocessing: give it the tag's values.
        for key in ("mean", "std", "interpolation", "resize_mode"):
            if key in tag:
                kwargs[f"image_{key}"] = tag[key]  # the image flags below still win
    if image is not None:
        # None / False: open_clip's own default (a patch dropout of 0.0 is a value, so no truthiness test)
        kwargs.update(
            {k: v for k, v in dataclasses.asdict(image).items() if v is not None and v is not False}
        )
    return kwargs


def _built_cfg(model_cfg: dict[str, Any], image: ImageOptions | None) -> dict[str, Any]:
    """The model config with what open_clip built on top of it (the force flags): exports record it, so the
    exported folder rebuilds this model."""
    if image is None:
        return model_cfg
    if image.force_quick_gelu:
        model_cfg = {**model_cfg, "quick_gelu": True}
    if image.force_custom_text:
        model_cfg = {**model_cfg, "custom_text": True}
    if image.force_context_length is not None:
        text = {**model_cfg["text_cfg"], "context_length": image.force_context_length}
        model_cfg = {**model_cfg, "text_cfg": text}
    if image.force_image_size is not None or image.force_patch_dropout is not None:
        # The trainer renders synthetic data at this size too.
        vision = dict(model_cfg["vision_cfg"])
        if image.force_image_size is not None:
            vision["image_size"] = image.force_image_size
        if image.force_patch_dropout is not None:
            vision["patch_dropout"] = image.force_patch_dropout
        model_cfg = {**model_cfg, "vision_cfg": vision}
    return model_cfg


@functools.lru_cache(maxsize=8)
def _tokenizer(name: str, context_length: int | None, cache_dir: str | None = None) -> Any:
    # Building open_clip's tokenizer parses its 49k BPE merges (~0.3 s a build); it is read-only once built
    # (SimpleTokenizer only memoises words), so a process that builds many engines (the test harness, the
    # benchmarks, evaluation) shares one per model name and context length. A hub tokenizer (hf_tokenizer_name)
    # is read from the cache build_model filled: no network call.
    from ds_clip.sources.hub import offline

    if name in BUILTIN_MODELS:
        # open_clip picks a tokenizer by name when the config names none: "siglip" in ds-clip-tiny-siglip would
        # select its SentencePiece tokenizer, fetched from the network. The built-in models use the CLIP tokenizer.
        text_cfg = load_model_cfg(name, cache_dir).get("text_cfg", {})
        return open_clip.SimpleTokenizer(context_length=context_length or text_cfg.get("context_length", 77))
    with offline():
        return open_clip.get_tokenizer(name, context_length=context_length, cache_dir=cache_dir)


def _local_weights(pretrained: str, cache_dir: str | None) -> str:
    """The cached file of ``--pretrained hf-hub:ORG/REPO`` or a URL, through open_clip's own resolvers (from the
    cache: build_model fetched it)."""
    from open_clip.pretrained import download_pretrained_from_hf, download_pretrained_from_url

    from ds_clip.sources.hub import HF_HUB_PREFIX, offline

    with offline():
        if pretrained.startswith(HF_HUB_PREFIX):
            return download_pretrained_from_hf(pretrained[len(HF_HUB_PREFIX) :], cache_dir=cache_dir)
        return download_pretrained_from_url(pretrained, cache_dir=cache_dir)


def lock_towers(model: nn.Module, locks: TowerLocks) -> None:
    """open_clip's lock_image_tower / lock_text_tower, as open_clip_train calls them; what a tower refuses
    (open_clip asserts) becomes a ModelError naming the flag."""
    # open_clip's CoCa has no lock_*_tower methods (open_clip_train fails on it); its towers lock themselves
    # as CustomTextCLIP's methods lock them.
    lock_image = getattr(model, "lock_image_tower", None) or model.visual.lock
    lock_text = getattr(model, "lock_text_tower", None) or model.text.lock
    if locks.image:
        try:
            lock_image(
                unlocked_groups=locks.image_unlocked_groups, freeze_bn_stats=locks.image_freeze_bn_stats
            )
        except (AssertionError, RuntimeError) as exc:
            raise ModelError(
                f"--lock-image-unlocked-groups {locks.image_unlocked_groups}: this image tower "
                f"({type(model.visual).__name__}) refuses it: {exc or 'partial locking is not supported'}"
            ) from None
    if locks.text:
        try:
            lock_text(
                unlocked_layers=locks.text_unlocked_layers, freeze_layer_norm=locks.text_freeze_layer_norm
            )
        except AssertionError:
            raise ModelError(
                "--lock-text: open_clip's own text tower always freezes LayerNorm when locked and refuses to "
                "leave it trainable: add --lock-text-freeze-layer-norm"
            ) from None


def frozen_towers(model: nn.Module) -> tuple[bool, bool]:
    """(image, text): is every parameter of that tower frozen (``requires_grad`` False)? The text tower is
    every parameter outside ``visual`` but ``logit_scale``/``logit_bias``. A fully frozen tower needs no
    recompute in the cached step (its embeddings carry no gradient)."""
    image, text = [], []
    for n, p in model.named_parameters():
        if n.startswith("visual."):
            image.append(p.requires_grad)
        elif n not in ("logit_scale", "logit_bias"):
            text.append(p.requires_grad)
    return (bool(image) and not any(image)), (bool(text) and not any(text))


def check_tokenizer_fits(model: nn.Module, tokenizer: Any, model_name: str) -> None:
    """Refuse a text tower whose vocabulary is smaller than its tokenizer's: every caption would index past
    the token embedding, which fails deep in torch (eager) or in a compiled kernel (--torchcompile)."""
    text = getattr(model, "text", model)  # CustomTextCLIP keeps the text tower in .text
    embedding = getattr(model, "token_embedding", None) or getattr(text, "token_embedding", None)
    ids = getattr(tokenizer, "vocab_size", None)
    if isinstance(embedding, nn.Embedding) and isinstance(ids, int) and embedding.num_embeddings < ids:
        raise ModelError(
            f"--model {model_name}: the text tower has {embedding.num_embeddings} token embeddings but its "
            f"tokenizer ({type(tokenizer).__name__}) produces ids up to {ids - 1}: set text_cfg.vocab_size to "
            f"at least {ids}, or name a matching tokenizer (text_cfg.hf_tokenizer_name)"
        )


def prepare_for_deepspeed(model: nn.Module) -> list[str]:
    """Make an open_clip model safe for a multi-rank DeepSpeed engine; returns the reshaped names."""
    reshaped: list[str] = []
    for module_name, module in model.named_modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(
                    module, pname, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad)
                )
                reshaped.append(f"{module_name}.{pname}" if module_name else pname)
    if reshaped and not getattr(model, "_ds_clip_shape_hooks", False):
        names = set(reshaped)

        def to_open_clip_shapes(module, state_dict, prefix, local_metadata):
            for name in names:
                key = prefix + name
                if key in state_dict and state_dict[key].shape == (1,):
                    state_dict[key] = state_dict[key].reshape(())
            return state_dict

        def from_open_clip_shapes(state_dict, prefix, *args, **kwargs):
            for name in names:
                key = prefix + name
                if key in state_dict and state_dict[key].dim() == 0:
                    state_dict[key] = state_dict[key].reshape(1)

        model._register_state_dict_hook(to_open_clip_shapes)
        model._register_load_state_dict_pre_hook(from_open_clip_shapes)
        model._ds_clip_shape_hooks = True
    if not getattr(model, "_ds_clip_output_hook", False):
        model.register_forward_hook(_copy_parameter_outputs)
        model._ds_clip_output_hook = True
    return reshaped


def _copy_parameter_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    # Registered before deepspeed.initialize, so it runs before ZeRO-3's post-forward release hook.
    if isinstance(output, dict):
        return {k: (v * 1 if isinstance(v, nn.Parameter) else v) for k, v in output.items()}
    return output


def compile_engine(engine) -> None:
    """torch.compile the model held by a DeepSpeed engine (--torchcompile), through ``engine.compile()``.

    Why the engine's compile and the whole model rather than ``torch.compile`` on each tower: the cached step
    calls the engine's top-level forward (under ZeRO-3 that forward gathers the root parameters, the facts
    note), and an open_clip CLIP keeps half its text tower (embeddings, ``ln_final``, ``text_projection``) on
    the root module, so there is no text-tower module to compile. ``engine.compile()`` compiles the module's
    ``__call__`` (``nn.Module.compile``) with the accelerator's backend (inductor on CPU and CUDA); the
    engine, its ZeRO optimizer and the step are unchanged, and the weights stay the engine's parameters.

    Why ``fallback_random``: inductor's own RNG draws dropout and patch-dropout numbers from a Philox
    stream of its own (seeded from the torch generator), so the masks differ from eager mode. The cached
    step would still agree with itself (it restores the generator state before each recompute), but a
    compiled run would no longer train what the uncompiled run and the one-process oracle train
    (measured: 47% relative gradient difference on a patch-dropout ViT). With ``fallback_random`` the
    random ops run as ATen's, from the same generators in the same order: equal to eager to float rounding.

    Recompiles: dynamo guards on grad mode and train/eval, so the cache pass (no grad), the recompute (grad)
    and evaluation each compile once, and the step's one-tower calls (a locked tower) once more each;
    all within dynamo's recompile limit. Shapes are static: the loaders drop partial batches.

    ZeRO-3 is refused where the preset is resolved (ds_config, so before any process starts): 0.19.8 traces
    the module with its partitioned parameters, which are empty outside ZeRO-3's gather hooks.
    """
    from deepspeed.accelerator import get_accelerator

    backend = get_accelerator().get_compile_backend()
    # inductor options apply to the inductor backend only (an accelerator may name another backend).
    kwargs = {"options": {"fallback_random": True}} if backend == "inductor" else {}
    engine.compile(backend=backend, compile_kwargs=kwargs)
    logging.getLogger("ds_clip").info(
        "--torchcompile: model compiled with torch.compile backend %s%s; the first step pays the compile",
        backend,
        " (fallback_random: eager's random numbers)" if kwargs else "",
    )


# ------------------------------------------------------------------------------------------ distillation


class Teacher:
    """A frozen open_clip model a student distils from (``--distill-model``, open_clip's DistillClipLoss).

    Frozen (every ``requires_grad`` False) and in eval mode (no dropout draws, no BatchNorm updates), held
    beside the DeepSpeed engine, never inside it: no optimizer state, no gradient reduction, nothing in a
    checkpoint or an export. The cached step calls it once per micro-batch, in the cache pass, under
    ``torch.no_grad()``; its embeddings and its own ``logit_scale`` enter the loss as constants.
    """

    def __init__(self, model: nn.Module, name: str) -> None:
        self.model = model.eval().requires_grad_(False)
        self.name = name

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Teacher:
        """In the engine's precision on the engine's device (bf16 under --precision bf16: half the fp32
        memory, and the images the step hands it are already bf16)."""
        self.model.to(device=device, dtype=dtype)
        return self

    @torch.no_grad()
    def __call__(self, image: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(image=image, text=text)
        return {k: out[k] for k in ("image_features", "text_features", "logit_scale")}


def _preprocess_key(bundle: ModelBundle) -> dict[str, Any]:
    size = bundle.model_cfg.get("vision_cfg", {}).get("image_size", 224)
    pp = open_clip.get_model_preprocess_cfg(bundle.model)
    return {
        "image size": tuple(size) if isinstance(size, (list, tuple)) else (size, size),
        "image mean": tuple(round(float(v), 6) for v in pp.get("mean", ())),
        "image std": tuple(round(float(v), 6) for v in pp.get("std", ())),
    }


def _tokenizer_key(bundle: ModelBundle) -> dict[str, Any]:
    t = bundle.tokenizer
    inner = getattr(t, "tokenizer", None)
    return {
        "tokenizer": type(t).__name__,
        "tokenizer name": getattr(inner, "name_or_path", None),
        "context length": getattr(t, "context_length", None),
        "vocabulary": getattr(t, "vocab_size", None),
    }


def check_teacher_fits(student: ModelBundle, teacher: ModelBundle, teacher_name: str) -> None:
    """Refuse a teacher that would read the student's inputs differently than it was trained to.

    The step hands the teacher the very tensors the student gets (as open_clip_train does): images made by
    the student's transform, token ids of the student's tokenizer. A teacher with another image size cannot
    take them (or would silently see them rescaled), another mean/std would see shifted pixels, another
    tokenizer or context length other words. ds_clip refuses those rather than re-preprocessing per model:
    open_clip's DistillClipLoss objective, as its trainer computes it, is defined on shared inputs. (The
    resize interpolation and crop are the student's, as in open_clip.) Also refused: a CoCa student, which
    open_clip does not distil either (its caption term has no teacher counterpart).
    """
    if "multimodal_cfg" in student.model_cfg:
        raise ModelError(
            f"--distill-model {teacher_name} with a CoCa student (--model {student.name}): open_clip defines "
            "distillation for CLIP students only; drop --distill-model"
        )
    for key_of in (_preprocess_key, _tokenizer_key):
        mine, theirs = key_of(student), key_of(teacher)
        diff = [f"{k} {theirs[k]} (student: {mine[k]})" for k in mine if mine[k] != theirs[k]]
        if diff:
            raise ModelError(
                f"--distill-model {teacher_name}: the teacher reads its inputs differently from the student "
                f"({'; '.join(diff)}); the step feeds both the student's images and tokens, so choose a "
                "teacher with the student's image size, normalisation and tokenizer (or adjust the student's "
                "with --force-image-size / --image-mean / --image-std)"
            )
    missing = [m for m in ("encode_image", "encode_text") if not hasattr(teacher.model, m)]
    if missing:
        raise ModelError(
            f"--distill-model {teacher_name}: {type(teacher.model).__name__} is not an open_clip image-text "
            "model (no encode_image / encode_text)"
        )

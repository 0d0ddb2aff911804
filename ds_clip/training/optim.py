"""Parameter groups for DeepSpeed's config-built optimizer: per-tower peak LR and weight decay, layer-wise LR
decay per tower (EVA-CLIP's --visual-lr/--text-lr/--visual-wd/--text-wd/--visual-ld/--text-ld), which
parameters --opt muon trains with Muon (``pin_muon_tags``), and
open_clip's no-decay rule inside every tower.

Towers, by parameter name:

* image tower: ``visual.*``;
* text tower: ``transformer.*``, ``token_embedding``, ``positional_embedding``, ``ln_final``,
  ``text_projection`` (open_clip's built-in text tower) or ``text.*`` (HF / custom text towers);
* the rest: ``logit_scale``, ``logit_bias`` (and anything else), at --lr / --wd.

Layer-wise decay (EVA-CLIP's ``LayerDecayValueAssigner``): a tower of L blocks has layers 0..L+1; the
embeddings (patch/token embedding, class token, positional embedding, ln_pre) are layer 0, block i (0-based)
is layer i+1, everything after the blocks (final norm, pooling, projection/head) is layer L+1; layer l
trains at ``tower_lr * ld ** (L + 1 - l)``, so the head keeps the tower's LR and each step down multiplies
it by ld. (EVA-CLIP's layer-0 list names its own towers' parameters: open_clip's ``class_embedding`` and
``ln_pre`` would be layer L+1 there; here they are embeddings, as in open_clip's lock groups.) open_clip's
no-decay rule (gains, biases, norms, logit_scale/bias get weight decay 0) holds in every group. Groups with equal (lr, weight decay) are merged, so the defaults build exactly open_clip's two
groups (no decay, decay) in parameter order, as before these flags existed.

Each group is a dict with its own "lr" and "weight_decay": DeepSpeed passes ``model_parameters`` to the
optimizer it builds from the config (torch AdamW, or CPU Adam under offload) on every ZeRO stage, and the
LambdaLR schedule scales every group from its own "lr".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ds_clip.config import OptimSettings
from ds_clip.errors import UserError

TOWERS = ("rest", "visual", "text")
_TEXT_ROOTS = (
    "transformer",
    "token_embedding",
    "positional_embedding",
    "ln_final",
    "text_projection",
    "text",
)
# Layer 0 of a tower: what runs before its first block (open_clip's, timm's and HF's names).
_EMBEDDING = re.compile(
    r"(^|\.)(conv1|class_embedding|positional_embedding|token_embedding|ln_pre|patch_embed|pos_embed|"
    r"cls_token|reg_token|embeddings)(\.|$)"
)
# A block of the tower's transformer: open_clip "resblocks.N.", timm "blocks.N.", HF "layer.N." / "layers.N.".
_BLOCK = re.compile(r"^(.*?(?:^|\.)(?:resblocks|blocks|layer|layers))\.(\d+)\.")


class ParamGroupError(UserError):
    """Layer decay asked for a tower whose blocks cannot be counted (names the flag)."""


@dataclass(frozen=True)
class TowerOptim:
    """Peak LR, weight decay and layer decay of one tower."""

    lr: float
    wd: float
    ld: float = 1.0


@dataclass
class GroupInfo:
    """What the start-up table shows for one optimizer group."""

    label: str
    num_params: int
    lr: float
    wd: float
    members: list[str] = field(default_factory=list)
    """Parameter names, in model order."""


def no_decay(name: str, p: torch.Tensor) -> bool:
    """open_clip's rule: no weight decay on gains, biases, norms and ``logit_scale``/``logit_bias``. --siglip2: nor
    on the self-supervised heads and mask token, which get no gradient before the self-supervised start: decay
    alone would shrink them from their initialisation until then (the paper initialises them at the start)."""
    if name.startswith(("siglip2.global_head.", "siglip2.patch_head.", "siglip2.masker.")):
        return True
    return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def tower_of(name: str) -> str:
    if name.startswith("visual."):
        return "visual"
    if name.split(".", 1)[0] in _TEXT_ROOTS:
        return "text"
    return "rest"


def _tower_relative(name: str, tower: str) -> str:
    if tower == "visual" or name.startswith("text."):
        return name.split(".", 1)[1]
    return name


def layer_ids(names: list[str], tower: str, flag: str) -> dict[str, int]:
    """EVA-CLIP's layer of each parameter of one tower (0: embeddings, i+1: block i, L+1: after the
    blocks) and L; refuses a tower without one run of numbered transformer blocks (a ResNet)."""
    rel = {n: _tower_relative(n, tower) for n in names}
    containers = {m.group(1) for r in rel.values() if (m := _BLOCK.match(r))}
    if len(containers) != 1:
        raise ParamGroupError(
            f"{flag}: layer-wise LR decay needs a transformer tower with one stack of numbered blocks; this "
            f"{tower} tower has {sorted(containers) or 'none'} (leave {flag} at 1)"
        )
    blocks = {n: int(m.group(2)) for n, r in rel.items() if (m := _BLOCK.match(r))}
    num_layers = max(blocks.values()) + 1
    out = {}
    for n, r in rel.items():
        if n in blocks:
            out[n] = blocks[n] + 1
        elif _EMBEDDING.search(r):
            out[n] = 0
        else:
            out[n] = num_layers + 1
    out["__num_layers__"] = num_layers
    return out


def build_param_groups(
    model: nn.Module, *, rest: TowerOptim, visual: TowerOptim, text: TowerOptim
) -> tuple[list[dict], list[GroupInfo]]:
    """Optimizer groups for the trainable parameters of ``model`` (each exactly once) and their table.

    Order: groups without weight decay first, then groups with it; inside each, the rest, the image tower,
    the text tower, layer by layer. Groups with equal (lr, weight decay, decay or not) are merged; a merged
    group holds its parameters in model order.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    towers = {"rest": rest, "visual": visual, "text": text}
    flags = {"visual": "--visual-ld", "text": "--text-ld"}
    layers: dict[str, dict[str, int]] = {}
    for tower, cfg in towers.items():
        members = [n for n, _ in named if tower_of(n) == tower]
        if cfg.ld != 1.0 and members:
            layers[tower] = layer_ids(members, tower, flags.get(tower, "--ld"))
    # (decays?, tower index, layer) -> lr, wd for every parameter
    keyed: list[tuple[tuple[bool, int, int], float, float, str, torch.Tensor]] = []
    for n, p in named:
        tower = tower_of(n)
        cfg = towers[tower]
        lr, layer = cfg.lr, -1
        if tower in layers:
            num_layers = layers[tower]["__num_layers__"]
            layer = layers[tower][n]
            lr = cfg.lr * cfg.ld ** (num_layers + 1 - layer)
        decays = not no_decay(n, p)
        keyed.append(((decays, TOWERS.index(tower), layer), lr, cfg.wd if decays else 0.0, n, p))
    order = sorted({k for k, *_ in keyed})
    merged: dict[tuple[bool, float, float], GroupInfo] = {}
    params: dict[tuple[bool, float, float], list[torch.Tensor]] = {}
    labels: dict[tuple[bool, float, float], list[str]] = {}
    for key in order:  # group positions follow the first (decays, tower, layer) that has their values
        for k, lr, wd, _, _ in keyed:
            if k == key:
                mkey = (key[0], lr, wd)
                if mkey not in merged:
                    merged[mkey] = GroupInfo("", 0, lr, wd)
                    params[mkey], labels[mkey] = [], []
                label = TOWERS[key[1]] + (f".L{key[2]}" if key[2] >= 0 else "")
                if label not in labels[mkey]:
                    labels[mkey].append(label)
                break
    for k, lr, wd, n, p in keyed:  # model order inside a group
        mkey = (k[0], lr, wd)
        params[mkey].append(p)
        merged[mkey].members.append(n)
        merged[mkey].num_params += p.numel()
    groups, infos = [], []
    for mkey, info in merged.items():
        info.label = "+".join(labels[mkey]) + (" decay" if mkey[0] else " no-decay")
        groups.append({"params": params[mkey], "weight_decay": info.wd, "lr": info.lr})
        infos.append(info)
    return groups, infos


def param_groups_for(model: nn.Module, o: OptimSettings) -> tuple[list[dict], list[GroupInfo]]:
    """The groups the flags ask for: --lr/--wd for the rest, --visual-*/--text-* (default --lr/--wd)."""
    visual = TowerOptim(
        o.lr if o.visual_lr is None else o.visual_lr,
        o.wd if o.visual_wd is None else o.visual_wd,
        o.visual_ld,
    )
    text = TowerOptim(
        o.lr if o.text_lr is None else o.text_lr, o.wd if o.text_wd is None else o.text_wd, o.text_ld
    )
    return build_param_groups(model, rest=TowerOptim(o.lr, o.wd), visual=visual, text=text)


# The modules whose weights are hidden matrices (a conv filter as the matrix of its flattened kernel, which
# DeepSpeed's Muon reshapes), and the raw fused q/k/v projections of attention modules (torch's
# nn.MultiheadAttention, open_clip's own Attention).
_MATRIX_MODULES = (nn.Linear, nn.modules.conv._ConvNd)
_ATTENTION_MATRICES = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def is_muon_matrix(name: str, module: nn.Module, pname: str) -> bool:
    """Does --opt muon train parameter ``pname`` of ``module`` (full name ``name``) with Muon? The hidden matrices
    inside either tower's blocks, chosen by module type as the Muon authors and DeepSpeed's Muon docs advise: the
    weight of a Linear or convolution, and an attention module's fused q/k/v projection. Everything else trains
    with AdamW, whatever its shape: embeddings (an nn.Embedding inside a block too, such as T5's
    relative_attention_bias), the patch stem, the projections into the shared space, logit_scale/logit_bias,
    norms and biases."""
    tower = tower_of(name)
    if tower == "rest":
        return False
    rel = _tower_relative(name, tower)
    if not _BLOCK.match(rel) or _EMBEDDING.search(rel):
        return False
    if isinstance(module, _MATRIX_MODULES):
        return pname == "weight"
    if isinstance(module, nn.Embedding):
        return False
    return pname in _ATTENTION_MATRICES and getattr(module, pname).ndim == 2


class _PinnedMuonTag:
    """``use_muon`` of a parameter as ds_clip chose it (``pin_muon_tags``). ``deepspeed.initialize`` re-tags every
    parameter by its own rule (any 2-D or larger weight whose name lacks "embed"), which would put the patch stem
    and the projections into Muon: its writes are ignored."""

    def __get__(self, p, owner=None):
        return self if p is None else p.__dict__.get("_ds_clip_use_muon", False)

    def __set__(self, p, value) -> None:
        pass


_PINNED: dict[type, type] = {}


def pin_muon_tags(model: nn.Module) -> tuple[list[str], list[str]]:
    """Tag every trainable parameter for DeepSpeed's Muon (``is_muon_matrix``) so that the tag stands through
    ``deepspeed.initialize``; returns the names in Muon and the names in its auxiliary AdamW."""
    muon, adam = [], []
    seen: set[int] = set()  # a tied parameter once, under its first name (as named_parameters() lists it)
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            cls = type(p)
            if cls not in _PINNED.values():
                p.__class__ = _PINNED.setdefault(
                    cls, type(cls.__name__, (cls,), {"use_muon": _PinnedMuonTag()})
                )
            p.__dict__["_ds_clip_use_muon"] = is_muon_matrix(name, module, pname)
            (muon if p.use_muon else adam).append(name)
    return muon, adam


def muon_groups(
    groups: list[dict], infos: list[GroupInfo], *, lr: float, muon_lr: float | None, adam_lr: float | None
) -> tuple[list[dict], list[GroupInfo]]:
    """--opt muon's parameter groups (after ``pin_muon_tags``): each of ds_clip's groups split into its Muon and
    AdamW halves, each half at its rate. DeepSpeed lets a group's own "lr" win over the optimizer's
    ``muon_lr``/``adam_lr``, so the halves carry them: a group's lr relative to --lr (its tower's LR and layer
    decay) scales ``muon_lr`` in the Muon half and ``adam_lr`` in the AdamW half (either absent: --lr)."""
    out_groups, out_infos = [], []
    for group, info in zip(groups, infos):
        scale = group["lr"] / lr if lr else 1.0
        members = dict(zip(info.members, group["params"]))
        for use_muon, rate, label in ((True, muon_lr, "muon"), (False, adam_lr, "adamw")):
            names = [n for n, p in members.items() if bool(p.use_muon) is use_muon]
            if not names:
                continue
            half_lr = group["lr"] if rate is None else rate * scale
            params = [members[n] for n in names]
            out_groups.append({**group, "params": params, "lr": half_lr})
            out_infos.append(
                GroupInfo(f"{info.label} {label}", sum(p.numel() for p in params), half_lr, info.wd, names)
            )
    return out_groups, out_infos


def format_muon_split(muon: list[str], adam: list[str]) -> str:
    """--opt muon's split, compact: the parameters in Muon and in AdamW, by name."""
    return f"Muon ({len(muon)}): {', '.join(muon)}\nAdamW ({len(adam)}): {', '.join(adam)}"


def format_groups(infos: list[GroupInfo]) -> str:
    """The compact start-up table: group, number of parameters (elements), lr, weight decay."""
    width = max([len("group"), *(len(i.label) for i in infos)])
    lines = [f"{'group':<{width}}  {'#params':>10}  {'lr':>10}  {'wd':>7}"]
    lines += [f"{i.label:<{width}}  {i.num_params:>10}  {i.lr:>10.3e}  {i.wd:>7.3g}" for i in infos]
    return "\n".join(lines)

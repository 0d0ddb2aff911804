"""Weight EMA kept where the fp32 master weights live: sharded like them, updated without any collective.

An exponential moving average of the weights is a function of the weight trajectory alone, so under the cached
step (every update the full-batch update) it is the same for every split of N = W·k·m. ds_clip keeps it in
fp32 beside the optimizer's master copy *on each rank*: one flat tensor per master partition, same shape,
same device (the CPU under offload), updated in place after every applied optimizer step with one
``torch._foreach_lerp_``. Nothing is gathered per step; the memory is one more fp32 partition per rank
(4·P/W bytes on ZeRO 1-3, 4·P on ZeRO-0).

Where the masters are (DeepSpeed 0.19.8):

| engine | master partitions | working copy refreshed by |
|---|---|---|
| ZeRO-0 fp32 | the parameters themselves | (they are the working copy) |
| ZeRO-0 bf16 (``FP16_UnfusedOptimizer``) | ``optimizer.fp32_groups`` (one fp32 tensor per parameter) | a copy per parameter |
| ZeRO-1/2 (``single_partition_of_fp32_groups``), ``BF16_Optimizer`` (``fp32_groups_flat_partition``) | one flat partition per parameter group | ``optimizer.update_lp_params()`` (an all-gather) |
| ZeRO-3 (``fp32_partitioned_groups_flat``) | one flat partition per sub-group | gathered parameters released, DeepSpeed's own reassign of each sub-group, the persistent parameters gathered |

Decay: timm's ``ModelEmaV3.get_decay`` (``EmaSchedule.decay_at``): the first update (optimizer step 1) copies
the weights; then ``--ema-decay``, or with ``--ema-warmup`` ``1 - (1 + t/gamma)^-power`` capped by it. Updates run
at applied steps that are multiples of ``--ema-update-every`` (a skipped step does not decay the average).

Evaluation (``swapped_in``): the masters are saved, the EMA copied into them, DeepSpeed's own refresh of the
working copy run, the model evaluated, the masters restored and refreshed again: the model sees the EMA
through the same path it sees trained weights, and no gathered copy is kept (one partition-sized temporary).

Checkpoints: ``ema_rank{r}.pt`` per rank beside DeepSpeed's files, with the partition layout (which elements of
which parameter each flat holds). Same world size and layout: loaded as saved. Another world size or stage: every
rank reads all ranks' files, assembles the parameters and takes its own partition (exact: a copy of values).
``full_state_from_files`` does the same for ``ds-clip-export --ema``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds_clip import distributed
from ds_clip.checkpoint import CheckpointError, safe_load
from ds_clip.config import EmaSettings

logger = logging.getLogger("ds_clip")

FILE_PREFIX = "ema_rank"
FORMAT = 1

Fragment = tuple[str, int, int, int]
"""(parameter name, offset in the flat partition, offset in the flattened parameter, element count)."""


@dataclass(frozen=True)
class EmaSchedule:
    """When the average is updated and with which decay (timm's ModelEmaV3 rule, step = applied optimizer
    steps so far)."""

    decay: float
    update_every: int = 1
    warmup: bool = False
    warmup_gamma: float = 1.0
    warmup_power: float = 2 / 3

    @classmethod
    def from_settings(cls, e: EmaSettings) -> EmaSchedule | None:
        """The schedule of the --ema-* flags; None without --ema-decay."""
        if e.ema_decay is None:
            return None
        return cls(e.ema_decay, e.ema_update_every, e.ema_warmup, e.ema_warmup_gamma, e.ema_warmup_power)

    def decay_at(self, step: int) -> float:
        """timm ``ModelEmaV3.get_decay(step)`` with update_after_step 0 and min_decay 0: 0 at step 1 (the
        average becomes the weights), then the constant decay or the warm-up curve capped by it."""
        t = max(0, step - 1)
        if t <= 0:
            return 0.0
        if not self.warmup:
            return self.decay
        return max(min(1 - (1 + t / self.warmup_gamma) ** -self.warmup_power, self.decay), 0.0)

    def should_update(self, step: int) -> bool:
        return step > 0 and step % self.update_every == 0


# ------------------------------------------------------------------------------------- where masters live


class _Masters:
    """The optimizer's fp32 master partitions on this rank, the layout of each, and the refresh of the
    working copy from them (what the next forward sees)."""

    kind = ""
    replicated = False
    """Every rank holds every element (ZeRO-0): no reduction when assembling."""

    def __init__(self, masters: list[torch.Tensor], fragments: list[list[Fragment]]) -> None:
        self.masters, self.fragments = masters, fragments

    def refresh(self) -> None:
        raise NotImplementedError


class _Plain(_Masters):
    kind, replicated = "zero0-fp32", True

    def refresh(self) -> None:  # the parameters are the masters
        return None


class _Unfused(_Masters):
    kind, replicated = "zero0-unfused", True

    def __init__(self, opt, masters, fragments) -> None:
        super().__init__(masters, fragments)
        self.pairs = [(lp, hp) for lg, hg in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lg, hg)]

    def refresh(self) -> None:
        for lp, hp in self.pairs:
            lp.data.copy_(hp.data)


class _Flat12(_Masters):
    kind = "zero12"

    def __init__(self, opt, masters, fragments) -> None:
        super().__init__(masters, fragments)
        self.opt = opt

    def refresh(self) -> None:
        self.opt.update_lp_params()  # DeepSpeed's own: masters -> working partition, then the all-gather


class _Zero3(_Masters):
    kind = "zero3"

    def __init__(self, opt, masters, fragments) -> None:
        super().__init__(masters, fragments)
        self.opt = opt

    def refresh(self) -> None:
        # What DeepSpeed's ZeRO-3 step does after the optimizer update: each sub-group's master into its working
        # partition, then the persistent (small, always whole) parameters gathered again.
        opt = self.opt
        # First release every gathered parameter: a forward under no_grad (an evaluation) leaves them gathered,
        # and the next forward would compute with those whole copies instead of the new partitions. Releasing
        # copies nothing back (the partitions are the truth), so it is safe before or after the copy into them.
        opt.empty_partition_cache()
        for j in range(len(opt.fp32_partitioned_groups_flat)):
            opt._reassign_or_swap_out_partitioned_parameters(j)
        if opt.persistent_parameters:
            opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
        opt.invalidate_secondary_tensor()


def find_masters(engine) -> _Masters:
    """This rank's master partitions of ``engine``'s optimizer, with the layout of each."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return _zero3(opt, names)
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return _hp_mapped(opt, opt.single_partition_of_fp32_groups, opt.bit16_groups, names)
    if hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer
        return _hp_mapped(opt, opt.fp32_groups_flat_partition, opt.bf16_groups, names)
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        lps = [lp for g in opt.fp16_groups for lp in g]
        hps = [hp for g in opt.fp32_groups for hp in g]
        frags = [[(names[id(lp)], 0, 0, lp.numel())] for lp in lps]
        return _Unfused(opt, hps, frags)
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    unknown = [p for p in params if id(p) not in names]
    if unknown or any(p.dtype != torch.float32 for p in params):
        raise CheckpointError(
            f"--ema-decay: the {type(opt).__name__} optimizer keeps its master weights where ds_clip cannot find "
            "them; use one of ds_clip's presets"
        )
    return _Plain(params, [[(names[id(p)], 0, 0, p.numel())] for p in params])


def _hp_mapped(opt, masters: list[torch.Tensor], lp_groups, names) -> _Flat12:
    frags = []
    for group in lp_groups:
        out = []
        for lp in group:
            m = getattr(lp, "_hp_mapping", None)
            if m is not None:  # None: no element of this parameter in this rank's partition
                hp, lpa = m.hp_fragment_address, m.lp_fragment_address
                out.append((names[id(lp)], int(hp.start), int(lpa.start), int(hp.numel)))
        frags.append(out)
    return _Flat12(opt, list(masters), frags)


def _zero3(opt, names) -> _Zero3:
    if any(flat is None for flat in opt.fp16_partitioned_groups_flat):
        raise CheckpointError("--ema-decay: ZeRO-3 with parameters swapped to NVMe is not supported")
    frags: list[list[Fragment]] = [[] for _ in opt.fp32_partitioned_groups_flat]
    for j, group in enumerate(opt.fp16_groups):
        rank = _group_rank(opt, j)
        for p in group:
            _, offset, numel = opt.grad_position[opt.get_param_id(p)]
            start = (
                rank * numel
            )  # each rank holds elements [r*part, (r+1)*part) of the zero-padded flat parameter
            real = max(0, min(numel, p.ds_numel - start))
            if real:
                frags[j].append((names[id(p)], int(offset), int(start), int(real)))
    return _Zero3(opt, list(opt.fp32_partitioned_groups_flat), frags)


def _group_rank(opt, j: int) -> int:
    import deepspeed.comm as ds_dist

    return ds_dist.get_rank(group=opt.sub_group_process_groups[j])


# ------------------------------------------------------------------------------------------------ the EMA


class WeightEma:
    """The average of this rank's master partitions. Every rank holds one; ``update`` touches only local
    memory, ``swapped_in``, ``full_state`` and checkpoint loads are collectives (every rank calls them)."""

    def __init__(self, engine, schedule: EmaSchedule) -> None:
        self.engine, self.schedule = engine, schedule
        self.where = find_masters(engine)
        self.flats = [m.detach().clone().float() for m in self.where.masters]
        self.shapes = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}
        self.trained = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        """Names of the parameters the optimizer moves (the EMA covers these), in the module's order."""
        self.updates = 0

    @property
    def num_elements(self) -> int:
        return sum(f.numel() for f in self.flats)

    def describe(self) -> str:
        sc = self.schedule
        warmup = f", warm-up 1 - (1 + t/{sc.warmup_gamma:g})^-{sc.warmup_power:.4g}" if sc.warmup else ""
        where = "CPU" if self.flats and self.flats[0].device.type == "cpu" else str(self.flats[0].device)
        return (
            f"weight EMA: decay {sc.decay:g}{warmup}, every {sc.update_every} step(s); fp32 beside the masters "
            f"({self.where.kind}), {self.num_elements * 4 / 2**20:.1f} MiB on rank 0 ({where})"
        )

    @torch.no_grad()
    def reset_to_masters(self) -> None:
        for e, m in zip(self.flats, self.where.masters):
            e.copy_(m)

    @torch.no_grad()
    def maybe_update(self, step: int) -> bool:
        """After applied optimizer step ``step`` (1-based): update on the cadence; returns whether it did."""
        if not self.schedule.should_update(step):
            return False
        weight = 1.0 - self.schedule.decay_at(step)
        torch._foreach_lerp_(self.flats, [m.detach() for m in self.where.masters], weight)
        self.updates += 1
        return True

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model computes with the EMA weights inside the block (a collective on ZeRO 1-3)."""
        masters = self.where.masters
        with torch.no_grad():
            saved = [m.detach().clone() for m in masters]
            for m, e in zip(masters, self.flats):
                m.copy_(e)
            self.where.refresh()
        try:
            yield
        finally:
            with torch.no_grad():
                for m, s in zip(masters, saved):
                    m.copy_(s)
                del saved
                self.where.refresh()

    # -------------------------------------------------------------------------------------- whole values

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every trained parameter's EMA, whole, on the CPU, in the engine's names and shapes (a collective)."""
        held = _assemble([(self.flats, self.where.fragments)], self.shapes)
        out = {}
        for n in self.trained:  # the same names in the same order on every rank (a rank may hold none of one)
            v = held.get(n, torch.zeros(_numel(self.shapes[n]), dtype=torch.float32))
            # The fragments of the ranks are disjoint: their sum is the whole parameter.
            out[n] = (v if self.where.replicated else distributed.all_reduce_sum(v)).view(self.shapes[n])
        return out

    # -------------------------------------------------------------------------------------- checkpoints

    def save_to(self, path: Path) -> list[Path]:
        """Write this rank's ``ema_rank{r}.pt`` into checkpoint folder ``path`` (every rank); returns it."""
        state = {
            "format": FORMAT,
            "kind": self.where.kind,
            "world_size": distributed.world_size(),
            "updates": self.updates,
            "schedule": [self.schedule.decay, self.schedule.update_every, self.schedule.warmup,
                         self.schedule.warmup_gamma, self.schedule.warmup_power],
            "flats": [f.detach().cpu() for f in self.flats],
            "fragments": self.where.fragments,
            "shapes": self.shapes,
        }  # fmt: skip
        if (
            distributed.rank() == 0
        ):  # a step saved again on fewer ranks: no file of a rank this run lacks stays
            for f in rank_files(path)[distributed.world_size() :]:
                f.unlink(missing_ok=True)
        tmp = path / f".{FILE_PREFIX}{distributed.rank()}.pt.tmp"
        torch.save(state, tmp)
        final = path / f"{FILE_PREFIX}{distributed.rank()}.pt"
        tmp.replace(final)
        return [final]

    def load_from(self, path: Path, *, is_main: bool) -> bool:
        """Load the average saved in checkpoint folder ``path`` (every rank). A checkpoint without one: the
        average starts from the resumed weights, said once; returns whether one was loaded."""
        files = rank_files(path)
        if not files:
            self.reset_to_masters()
            self.updates = 0
            if is_main:
                logger.warning(
                    "--ema-decay: %s was saved without a weight EMA; the average starts from its weights at this "
                    "step", path,
                )  # fmt: skip
            return False
        own = None
        if len(files) == distributed.world_size():  # the same world size: this rank's file, if laid out alike
            own = safe_load(path / f"{FILE_PREFIX}{distributed.rank()}.pt", flag="--resume")
        same = (
            own is not None
            and own["kind"] == self.where.kind
            and own["fragments"] == _plain(self.where.fragments)
        )
        # Every rank takes the same branch (the other one assembles from all files: no collective either way, but
        # the log line must say what happened everywhere).
        same = not distributed.any_rank(not same)
        if same:
            for e, saved in zip(self.flats, own["flats"]):
                e.copy_(saved.to(e.dtype))
        else:
            full = full_state_from_files(path)
            self._fill_from(full)
        self.updates = int((own or safe_load(files[0], flag="--resume"))["updates"])
        if is_main:
            logger.info(
                "resumed the weight EMA (%d updates) from %s%s", self.updates, path,
                "" if same else " on a new world size / ZeRO stage",
            )  # fmt: skip
        return True

    @torch.no_grad()
    def _fill_from(self, full: dict[str, torch.Tensor]) -> None:
        for flat, frags in zip(self.flats, self.where.fragments):
            for name, off, poff, numel in frags:
                if name not in full:
                    raise CheckpointError(f"--resume: the checkpoint's weight EMA has no parameter {name}")
                # view(-1): on ZeRO-0 the masters are the parameters themselves, in their own (2-D) shapes
                flat.view(-1).narrow(0, off, numel).copy_(
                    full[name].reshape(-1).narrow(0, poff, numel).to(flat.dtype)
                )


def _plain(fragments: list[list[Fragment]]) -> list[list[Fragment]]:
    return [[tuple(f) for f in group] for group in fragments]  # type: ignore[misc]


def _assemble(
    sources: list[tuple[list[torch.Tensor], list[list[Any]]]], shapes: dict[str, list[int]]
) -> dict[str, torch.Tensor]:
    """Whole flattened fp32 parameters from (flats, fragments) pairs; elements no source holds stay 0."""
    out: dict[str, torch.Tensor] = {}
    for flats, fragments in sources:
        for flat, frags in zip(flats, fragments):
            for name, off, poff, numel in frags:
                if name not in out:
                    out[name] = torch.zeros(_numel(shapes[name]), dtype=torch.float32)
                out[name].narrow(0, poff, numel).copy_(
                    flat.detach().reshape(-1).narrow(0, off, numel).float().cpu()
                )
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def rank_files(path: Path) -> list[Path]:
    """The EMA files of checkpoint folder ``path``, in rank order (empty: saved without an EMA)."""
    files = list(Path(path).glob(f"{FILE_PREFIX}*.pt"))
    return sorted(files, key=lambda f: int(f.stem[len(FILE_PREFIX) :]))


def full_state_from_files(path: Path) -> dict[str, torch.Tensor]:
    """The whole EMA of every trained parameter from a checkpoint's ``ema_rank*.pt`` files (no process group),
    in the engine's names and shapes."""
    files = rank_files(path)
    if not files:
        raise CheckpointError(f"{path}: no weight EMA in this checkpoint (trained without --ema-decay)")
    states = [safe_load(f, flag="checkpoint") for f in files]
    if len(states) != states[0]["world_size"]:
        raise CheckpointError(f"{path}: {len(states)} EMA files for {states[0]['world_size']} ranks")
    shapes = states[0]["shapes"]
    # ZeRO-0 keeps the whole average on every rank: rank 0's file is all of it.
    used = states[:1] if states[0]["kind"].startswith("zero0") else states
    out = _assemble([(s["flats"], s["fragments"]) for s in used], shapes)
    return {n: v.view(shapes[n]) for n, v in out.items()}


def build_ema(engine, section: EmaSettings) -> WeightEma | None:
    """The run's weight EMA (None without --ema-decay), started from the engine's current masters."""
    schedule = EmaSchedule.from_settings(section)
    return None if schedule is None else WeightEma(engine, schedule)

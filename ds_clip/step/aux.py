"""Per-sample terms a model's forward adds to the contrastive objective (SigLIP 2's decoder, self-distillation and
masked prediction), trained exactly under accumulation the way CoCa's caption term is (``ds_clip.step.caption``).

The forward returns ``out["aux"]``: [sum_1, count_1, ..., sum_T, count_T, extra_1, ...] for its micro-batch, each
sum a differentiable sum of per-sample (or per-token, per-view, per-patch) losses and each count how many were
summed. Term t of the objective is ``weight_t x (Σ sums over the global batch) / (Σ counts over the global batch)``:
a mean over the whole N-pair batch, whatever W, k and m are. The step all-reduces the [sum, count] vector once after
its cache pass (the normalisers and the logged values), then pushes ``weight_t x W / count_t x sum_t`` of each
micro-batch in that micro-batch's own backward (W undoes DeepSpeed's average over ranks). A term whose global count
is 0 (not active this step) contributes nothing. Extras are counts that are logged, not trained.

``out["aux_center"]`` (optional): a vector summed over the global batch and handed back in ``StepResult`` (the
teacher's centers are updated from it after the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_clip.distributed import all_reduce_sum


@dataclass(frozen=True)
class AuxTerms:
    names: tuple[str, ...]
    weights: tuple[float, ...]
    extras: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        return 2 * len(self.names) + len(self.extras)

    @staticmethod
    def global_total(parts: list[torch.Tensor]) -> torch.Tensor:
        """Σ over this rank's micro-batches, then over ranks: one all-reduce on the device, no host sync. Every
        rank calls it."""
        return all_reduce_sum(torch.stack([p.detach().double() for p in parts]).sum(0))

    def _sums_counts(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.names)
        return total[0 : 2 * n : 2], total[1 : 2 * n : 2]

    def value(self, total: torch.Tensor) -> torch.Tensor:
        """Σ_t weight_t x mean_t over the global batch (fp32)."""
        sums, counts = self._sums_counts(total)
        w = torch.tensor(self.weights, dtype=torch.float64, device=total.device)
        return (w * sums / counts.clamp(min=1)).sum().float()

    def grad_coefs(self, total: torch.Tensor, world_size: int) -> torch.Tensor:
        """The factor on each term's micro-batch sum in its surrogate: weight_t x W / global count_t."""
        _, counts = self._sums_counts(total)
        w = torch.tensor(self.weights, dtype=torch.float64, device=total.device)
        return (w * world_size / counts.clamp(min=1)).float()

    def surrogate(self, aux: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
        """The aux terms' part of one micro-batch's surrogate (fp32)."""
        n = len(self.names)
        return (aux[0 : 2 * n : 2].float() * coefs).sum()

    def logged(self, total: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each term's unweighted global mean (NaN while its count is 0: not trained this step) and each extra,
        as detached device tensors (read on the host at log steps only)."""
        sums, counts = self._sums_counts(total)
        means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, float("nan")))
        out = {f"loss_{name}": means[i].float() for i, name in enumerate(self.names)}
        base = 2 * len(self.names)
        out.update({name: total[base + i].float() for i, name in enumerate(self.extras)})
        return out

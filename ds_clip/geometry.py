"""The batch geometry of a run: W ranks x k micro-batches x m pairs = N pairs per optimizer step.

    g = BatchGeometry(world_size=2, accum_freq=4, micro_batch_size=16)
    g.global_batch          # N = W*k*m = 128 pairs per optimizer step
    g.local_batch           # k*m = 64 pairs per rank per optimizer step
    g.micro_batch_ids(1)    # [4, 5, 6, 7]: global micro-batch index g = rank*k + j of rank 1's micro-batches

The trainer builds one from the world size and the flags (--accum-freq k, --batch-size m) and hands it to the
engine (the loss layout is chosen from N), the data (which pairs each micro-batch trains), the checkpoint (the
N a resume must keep) and the log lines. A low module: the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchGeometry:
    """W, k, m of one run, and what follows from them. Every value is >= 1."""

    world_size: int
    """W: ranks (data-parallel processes)."""
    accum_freq: int
    """k: micro-batches per optimizer step on each rank (--accum-freq)."""
    micro_batch_size: int
    """m: pairs per micro-batch per rank (--batch-size)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "accum_freq", "micro_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchGeometry.{name} must be an int >= 1, got {value!r}")

    @classmethod
    def for_global_batch(cls, world_size: int, micro_batch_size: int, global_batch: int) -> BatchGeometry:
        """The geometry that trains ``global_batch`` pairs per step on W ranks with micro-batch m: k = N / (W*m).
        ValueError when N is not a multiple of W*m."""
        per_pass = world_size * micro_batch_size
        if per_pass < 1 or global_batch < per_pass or global_batch % per_pass:
            raise ValueError(
                f"a global batch of {global_batch} pairs is not a whole number of passes of W*m = {world_size}*"
                f"{micro_batch_size} = {per_pass} pairs"
            )
        return cls(world_size, global_batch // per_pass, micro_batch_size)

    @property
    def global_batch(self) -> int:
        """N = W*k*m: pairs per optimizer step, all ranks together (the batch the loss sees)."""
        return self.world_size * self.accum_freq * self.micro_batch_size

    @property
    def local_batch(self) -> int:
        """k*m: pairs per optimizer step on one rank."""
        return self.accum_freq * self.micro_batch_size

    def micro_batch_ids(self, rank: int) -> list[int]:
        """Global index g = rank*k + j of each of ``rank``'s k micro-batches (it seeds the micro-batch's RNG, so
        (W=4, k=1) and (W=2, k=2) draw the same numbers for the same pairs)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of size {self.world_size}")
        return [rank * self.accum_freq + j for j in range(self.accum_freq)]

    def describe(self) -> str:
        """The start-up log line's account of the batch."""
        return (
            f"world size {self.world_size}, micro-batch m={self.micro_batch_size}, accum-freq k={self.accum_freq}: "
            f"global batch N=W*k*m={self.global_batch} pairs per optimizer step"
        )


__all__ = ["BatchGeometry"]

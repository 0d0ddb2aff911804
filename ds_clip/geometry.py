"""The batch geometry of a run: W ranks x k micro-batches x m pairs = N pairs per optimizer step.

    g = BatchGeometry(world_size=2, accum_freq=4, micro_batch_size=16)
    g.global_batch          # N = W*k*m = 128 pairs per optimizer step
    g.local_batch           # k*m = 64 pairs per rank per optimizer step
    g.micro_batch_ids(1)    # [4, 5, 6, 7]: global micro-batch index g = rank*k + j of rank 1's micro-batches

    BatchGeometry.derive(8, 16, global_batch=4096)   # k = N / (W*m) = 32: what --global-batch-size asks

The trainer builds one from the world size and the flags (--accum-freq k, --batch-size m, or
--global-batch-size N with k derived here) and hands it to the engine (the loss layout is chosen from N), the
data (which pairs each micro-batch trains), the checkpoint (the N a resume must keep) and the log lines. With N
fixed, k is a consequence of the world size: a run restarted on another W re-derives it and trains the same
optimizer steps (every step's gradient is the full-batch gradient). A low module: the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

# How many candidate world sizes / micro-batches a message lists (the smallest and the largest are kept).
_LISTED = 12


class GeometryError(ValueError):
    """A global batch that W*m does not divide, or an --accum-freq that disagrees with it. The message is one line
    naming the flags, the world sizes and the micro-batches that would divide N; callers turn it into the
    user's exit-2 error."""


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _listed(values: list[int]) -> str:
    if not values:
        return "none"
    if len(values) <= _LISTED:
        return ", ".join(map(str, values))
    head = values[: _LISTED - 2]
    return f"{', '.join(map(str, head))}, ..., {values[-2]}, {values[-1]}"


def world_sizes_for(global_batch: int, micro_batch_size: int) -> list[int]:
    """The world sizes W on which micro-batch m trains exactly N pairs per step (W*m divides N)."""
    if micro_batch_size < 1 or global_batch % micro_batch_size:
        return []
    return _divisors(global_batch // micro_batch_size)


def micro_batches_for(global_batch: int, world_size: int) -> list[int]:
    """The micro-batches m that train exactly N pairs per step on W ranks (W*m divides N)."""
    if world_size < 1 or global_batch % world_size:
        return []
    return _divisors(global_batch // world_size)


def divisibility_message(global_batch: int, world_size: int | None, micro_batch_size: int) -> str:
    """One line: why N cannot be trained with this W (None: not known yet) and m, and what would divide it."""
    on = "" if world_size is None else f" on {world_size} rank{'s' if world_size != 1 else ''}"
    per_pass = micro_batch_size * (world_size or 1)
    head = (
        f"--global-batch-size {global_batch} is not a whole number of micro-batches{on}: W*m = "
        f"{world_size}*{micro_batch_size} = {per_pass} does not divide it"
        if world_size is not None
        else f"--global-batch-size {global_batch} is not a multiple of --batch-size {micro_batch_size}"
    )
    sizes = world_sizes_for(global_batch, micro_batch_size)
    hint = (
        f"with --batch-size {micro_batch_size} it divides on world sizes {_listed(sizes)}"
        if sizes
        else f"no world size divides it with --batch-size {micro_batch_size}"
    )
    if world_size is not None:
        micro = micro_batches_for(global_batch, world_size)
        hint += (
            f"; on {world_size} ranks these --batch-size values do: {_listed(micro)}"
            if micro
            else f"; no --batch-size does on {world_size} ranks ({world_size} does not divide {global_batch})"
        )
    return f"{head} ({hint}); ds_clip never trains a different N than asked"


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
        GeometryError (naming the world sizes and micro-batches that would divide N) when W*m does not."""
        per_pass = world_size * micro_batch_size
        if per_pass < 1 or global_batch < per_pass or global_batch % per_pass:
            raise GeometryError(divisibility_message(global_batch, world_size, micro_batch_size))
        return cls(world_size, global_batch // per_pass, micro_batch_size)

    @classmethod
    def derive(
        cls,
        world_size: int,
        micro_batch_size: int,
        *,
        accum_freq: int | None = None,
        global_batch: int | None = None,
    ) -> BatchGeometry:
        """The run's geometry from the flags: --global-batch-size N derives k = N / (W*m); without it k is
        --accum-freq (1 when not given). An --accum-freq given beside N must be the k that N derives on this W,
        else GeometryError: the user asked for two different batches."""
        if global_batch is None:
            return cls(world_size, 1 if accum_freq is None else accum_freq, micro_batch_size)
        g = cls.for_global_batch(world_size, micro_batch_size, global_batch)
        if accum_freq is not None and accum_freq != g.accum_freq:
            raise GeometryError(
                f"--accum-freq {accum_freq} disagrees with --global-batch-size {global_batch}: on {world_size} "
                f"rank{'s' if world_size != 1 else ''} with --batch-size {micro_batch_size} that is k = "
                f"{g.accum_freq} (W*k*m = {world_size}*{accum_freq}*{micro_batch_size} = "
                f"{world_size * accum_freq * micro_batch_size}); drop --accum-freq, k follows from N"
            )
        return g

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


__all__ = ["BatchGeometry", "GeometryError", "divisibility_message", "micro_batches_for", "world_sizes_for"]

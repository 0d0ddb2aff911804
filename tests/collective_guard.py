"""Guard: every collective that ds_clip issues gets tensors on the accelerator's device.

Under NCCL a process group has no CPU backend: a collective handed a CPU tensor raises
``No backend type associated with device type cpu``. gloo accepts CPU tensors, so CPU-only tests never
show it. This guard makes it show on a CPU:

1. ``install()`` wraps every ``torch.distributed`` collective. A call is checked when the innermost frame
   of ds_clip or DeepSpeed on the stack is ds_clip's (DeepSpeed's own collectives are its business;
   open_clip's and ``torch.distributed.nn``'s frames are looked through, so open_clip's gathers called
   from ds_clip are checked too).
2. On a CPU accelerator, ``install()`` hands ``ds_clip.distributed.set_placement`` a simulated device:
   ``to_device`` returns a ``SimulatedDeviceTensor`` (a subclass that survives ops and becomes a plain tensor
   again on ``.cpu()``), so "on the accelerator" is observable. A tensor that never went through placement (``torch.tensor([x])``,
   features moved ``.cpu()`` before a gather) is plain: flagged, as NCCL would refuse it. On a real GPU the
   check is the tensor's device against ``get_accelerator().current_device_name()``.
3. A collective whose innermost ds_clip frame is not ``ds_clip.distributed`` is flagged too (object
   collectives and barriers carry no tensor, but belong to the one home as well).

Each rank appends one JSON line per checked call to ``REPORT_DIR/rank{r}.jsonl``; ``offences(dir)`` reads
them back and ``format_offences`` lists the offending call sites.

Run any module under it (the launcher's arguments pass through):

    deepspeed --num_gpus 2 --module tests.collective_guard --report DIR ds_clip.train --log-every-n-steps 1 ...
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

REPORT_ENV = "DS_CLIP_COLLECTIVE_GUARD_REPORT"
HOME = "ds_clip.distributed"

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)


class SimulatedDeviceTensor(torch.Tensor):
    """A CPU tensor standing for one on the accelerator (guarded CPU runs only).

    Results of ops on it are of this class too (torch's default ``__torch_function__``), as results on a
    GPU stay on the GPU; ``.cpu()``, ``.to("cpu")`` and ``.to(plain_tensor)`` return a plain tensor, as a
    copy to the host would. Tensors created without it (``torch.tensor(...)``, ``torch.zeros(...)``) are
    plain: "on the host" for the guard.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_host(args, kwargs)):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor)
        return super().__torch_function__(func, types, args, kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return not isinstance(a, SimulatedDeviceTensor)
        if isinstance(a, (str, torch.device)):
            target = a
    return target is not None and torch.device(target).type == "cpu"


class SimulatedDevice:
    """The placement ``install()`` gives ``ds_clip.distributed`` on a CPU accelerator (its ``Placement``)."""

    @staticmethod
    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, SimulatedDeviceTensor) else t.as_subclass(SimulatedDeviceTensor)

    @staticmethod
    def is_on_device(t: torch.Tensor) -> bool:
        return isinstance(t, SimulatedDeviceTensor)


def _tensors(obj: Any, path: str):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from _tensors(x, f"{path}[{i}]")


def _on_accelerator(t) -> bool:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return isinstance(t, SimulatedDeviceTensor)
    want = acc.current_device_name()
    return str(t.device) == want or (t.device.type == want and t.device.index is None)


def _site(frame) -> str:
    name = frame.f_globals.get("__name__", "?")
    return f"{name.replace('.', '/')}.py:{frame.f_lineno} {frame.f_code.co_name}"


def _ds_clip_frames(frame) -> tuple[str | None, list]:
    """('ds_clip' | 'deepspeed' | None, the ds_clip frames innermost first)."""
    owner, frames = None, []
    f = frame
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name.startswith("deepspeed") and owner is None:
            return "deepspeed", []
        if name == "ds_clip" or name.startswith("ds_clip."):
            owner = owner or "ds_clip"
            frames.append(f)
        f = f.f_back
    return owner, frames


def _report_file() -> Path | None:
    d = os.environ.get(REPORT_ENV)
    if not d:
        return None
    rank = os.environ.get("RANK", "0")
    return Path(d) / f"rank{rank}.jsonl"


def _check(op: str, args: tuple, kwargs: dict) -> None:
    owner, frames = _ds_clip_frames(sys._getframe(2))
    if owner != "ds_clip":
        return
    bad = [
        f"{path} on {t.device} (never placed on the accelerator)"
        for i, a in enumerate(args)
        for path, t in _tensors(a, f"arg{i}")
        if not _on_accelerator(t)
    ]
    bad += [
        f"{path} on {t.device} (never placed on the accelerator)"
        for k, v in kwargs.items()
        for path, t in _tensors(v, k)
        if not _on_accelerator(t)
    ]
    inner = frames[0].f_globals.get("__name__")
    if inner != HOME:
        bad.append(f"called from {inner}, not from {HOME}")
    record = {
        "op": op,
        "site": _site(frames[0]),
        "stack": [_site(f) for f in frames],
        "modules": sorted({f.f_globals.get("__name__") for f in frames}),
        "offences": bad,
    }
    path = _report_file()
    if path is not None:
        with path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def install() -> None:
    """Wrap torch.distributed's collectives (idempotent) and, on a CPU accelerator, simulate placement on the
    device (an older ds_clip without ``set_placement`` gets none: each of its tensors reads as on the host)."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    import ds_clip.distributed

    set_placement = getattr(ds_clip.distributed, "set_placement", None)
    if set_placement is not None and get_accelerator().device_name() == "cpu":
        set_placement(SimulatedDevice())
    if getattr(dist, "_ds_clip_guard", False):
        return
    for op in COLLECTIVES:
        fn = getattr(dist, op, None)
        if fn is None:
            continue

        def wrapped(*args, __fn=fn, __op=op, **kwargs):
            _check(__op, args, kwargs)
            return __fn(*args, **kwargs)

        setattr(dist, op, functools.wraps(fn)(wrapped))
    dist._ds_clip_guard = True


def records(report_dir: str | Path) -> list[dict]:
    out = []
    for f in sorted(Path(report_dir).glob("rank*.jsonl")):
        rank = int(f.stem[4:])
        for line in f.read_text().splitlines():
            out.append({"rank": rank, **json.loads(line)})
    return out


def offences(report_dir: str | Path) -> list[dict]:
    return [r for r in records(report_dir) if r["offences"]]


def format_offences(found: list[dict], chains: int = 2) -> str:
    """One entry per offending call site (ranks, counts and reasons merged), with up to ``chains`` of the
    ds_clip call chains that reached it."""
    by_site: dict[tuple[str, str], dict] = {}
    for r in found:
        e = by_site.setdefault(
            (r["stack"][0], r["op"]), {"ranks": set(), "calls": 0, "why": [], "chains": []}
        )
        e["ranks"].add(r["rank"])
        e["calls"] += 1
        e["why"] += [w for w in r["offences"] if w not in e["why"]]
        chain = " <- ".join(r["stack"][1:])
        if chain and chain not in e["chains"]:
            e["chains"].append(chain)
    lines = [f"{len(by_site)} offending collective call site(s) in {len(found)} calls:"]
    for (site, op), e in sorted(by_site.items()):
        ranks = ",".join(str(x) for x in sorted(e["ranks"]))
        lines.append(f"  dist.{op} at {site} (ranks {ranks}, {e['calls']} calls)")
        for c in e["chains"][:chains]:
            lines.append(f"      called from {c}")
        if len(e["chains"]) > chains:
            lines.append(f"      ... and {len(e['chains']) - chains} other call chain(s)")
        lines += [f"      {w}" for w in e["why"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.collective_guard --report DIR MODULE [ARGS...]``: run MODULE as __main__, guarded."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The deepspeed launcher puts --local_rank=N first: hand it on to the module.
    launcher = [a for a in argv if a.startswith("--local_rank")]
    argv = [a for a in argv if not a.startswith("--local_rank")] + launcher
    if len(argv) < 3 or argv[0] != "--report":
        sys.exit("usage: python -m tests.collective_guard --report DIR MODULE [ARGS...]")
    report, module, rest = argv[1], argv[2], argv[3:]
    Path(report).mkdir(parents=True, exist_ok=True)
    os.environ[REPORT_ENV] = str(Path(report).resolve())
    install()
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""Every collective ds_clip issues lives in ds_clip/distributed.py and runs on the accelerator's device.

Contract: under NCCL a CPU tensor handed to a collective raises "No backend type associated
with device type cpu"; gloo accepts it, so CPU tests alone never show it. These tests pin
- the rule: no module of ds_clip but ``distributed.py`` calls a ``torch.distributed`` /
  ``torch.distributed.nn`` / ``deepspeed.comm`` collective or open_clip's gathers (source scan);
- the helpers: values, a CPU tensor in -> a CPU tensor out, a device tensor stays on the device, the
  with-grad gather's backward equals ``torch.distributed.nn.all_gather``'s, on 2 gloo ranks;
- the guard (tests/collective_guard.py): it flags three bugs an earlier version had (CPU tensors handed to
  collectives), re-created verbatim from that code, and flags nothing in the helpers;
- the real trainer under the real launcher (2 ranks, logging every step, evaluation with zero-shot, a
  checkpoint and --resume) issues no collective the guard flags.
(The dry run of scripts/gpu_check.sh is tested in tests/test_gpu_check.py.)
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from ds_clip_harness.models import E2E_MODEL
from tests import collective_guard as guard

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ds_clip"
HOME = "ds_clip/distributed.py"

# Modules of ds_clip allowed to call torch.distributed collectives directly: none (the test harness beside it,
# ds_clip_harness, goes through ds_clip.distributed too).
TEMPORARY_DIRECT_COLLECTIVES_ALLOWED: frozenset[str] = frozenset()

_COLLECTIVE_MODULES = (
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.nn",
    "torch.distributed.nn.functional",
    "deepspeed.comm",
    "deepspeed.comm.comm",
)
_OPEN_CLIP_GATHERS = (
    "open_clip.loss.gather_features",
    "open_clip.loss.neighbour_exchange",
    "open_clip.loss.neighbour_exchange_with_grad",
    "open_clip.loss.neighbour_exchange_bidir",
    "open_clip.loss.neighbour_exchange_bidir_with_grad",
    "open_clip.gather_features",
)
FORBIDDEN = frozenset(
    {f"{m}.{op}" for m in _COLLECTIVE_MODULES for op in guard.COLLECTIVES}
    | {f"{m}.inference_all_reduce" for m in _COLLECTIVE_MODULES}
    | set(_OPEN_CLIP_GATHERS)
)


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every collective named in ``source`` outside ds_clip.distributed."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if full in FORBIDDEN:
                    hits.append((node.lineno, full))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            name = _dotted(node, aliases)
            if name in FORBIDDEN:
                hits.append((node.lineno, name))
    return sorted(set(hits))


def test_rule_finds_every_spelling():
    """The scan sees the spellings the old code used (and the usual aliases)."""
    src = """
import torch.distributed as dist
import torch.distributed.nn
import torch
from torch.distributed import all_gather as ag
from open_clip.loss import ClipLoss, gather_features
import deepspeed.comm as dcomm
dist.all_reduce(t, op=dist.ReduceOp.MAX)
torch.distributed.nn.all_gather(t)
torch.distributed.barrier()
dcomm.broadcast(t, 0)
dist.get_rank()
"""
    names = [n for _, n in direct_collectives(src)]
    assert names == [
        "torch.distributed.all_gather",
        "open_clip.loss.gather_features",
        "torch.distributed.all_reduce",
        "torch.distributed.nn.all_gather",
        "torch.distributed.barrier",
        "deepspeed.comm.broadcast",
    ]


def test_collectives_only_in_distributed_py():
    """No module of ds_clip (nor of the harness beside it) calls a collective directly; only
    ds_clip/distributed.py does."""
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "ds_clip_harness").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel == HOME or rel in TEMPORARY_DIRECT_COLLECTIVES_ALLOWED:
            continue
        found += [f"{rel}:{line}: {name}" for line, name in direct_collectives(path.read_text())]
    assert not found, "collectives outside ds_clip/distributed.py (use its helpers):\n" + "\n".join(found)


# ---------------------------------------------------------------------------- two gloo ranks, guarded

# Three collectives on CPU tensors that NCCL refuses, verbatim from the code before the fix (ds_clip at 78125bb), as modules
# of ds_clip so the guard treats them as ds_clip's own calls.
OLD_CODE = {
    "ds_clip._old_distributed": '''
import torch
import torch.distributed as dist

def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1

def all_reduce_mean(t):
    """Mean over ranks of a small tensor (a copy; the input is untouched)."""
    t = t.detach().clone()
    if world_size() > 1:
        dist.all_reduce(t)
        t /= world_size()
    return t

def all_reduce_max(t):
    t = t.detach().clone()
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
''',
    "ds_clip._old_trainer": """
import torch
from ds_clip._old_distributed import all_reduce_mean

def log_step(skip_counts, w):
    skipped = all_reduce_mean(torch.tensor(float(sum(skip_counts.values())))) * w
    return skipped
""",
    "ds_clip._old_evaluate": '''
import torch
import torch.distributed as dist

def _world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

def _gather_rows(t):
    """Concatenate every rank's rows (counts may differ by rank)."""
    rank, world = _world()
    if world == 1:
        return t
    n = torch.tensor([t.shape[0]], device=t.device)
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    most = int(max(c.item() for c in counts))
    padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts)])

def _max_over_ranks(x):
    if not dist.is_initialized():
        return x
    t = torch.tensor([x])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())

def evaluate(features_on_device, n_batches):
    n_forward = _max_over_ranks(n_batches)
    image_f = _gather_rows(features_on_device.float().cpu())
    return n_forward, image_f
''',
    "ds_clip._old_checkpoint": """
import torch.distributed as dist

def _barrier():
    if dist.is_initialized():
        dist.barrier()

def convert_error(message):
    error = [message]
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    _barrier()
    return error[0]
""",
}


def _load_old_code() -> dict[str, types.ModuleType]:
    mods = {}
    for name, src in OLD_CODE.items():
        mod = types.ModuleType(name)
        mod.__file__ = f"<{name}>"
        sys.modules[name] = mod
        exec(compile(src, f"{name.replace('.', '/')}.py", "exec"), mod.__dict__)
        mods[name.rsplit("._old_", 1)[1]] = mod
    return mods


def _rank_main(rank: int, world: int, port: int, report: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
    )  # fmt: skip
    torch.set_num_threads(1)
    report_dir = Path(report)
    os.environ[guard.REPORT_ENV] = str(report_dir / "new")
    (report_dir / "new").mkdir(exist_ok=True)
    guard.install()
    import torch.distributed as dist

    from ds_clip import distributed as D

    D.init_distributed()
    _check_helpers(D, rank, world)
    _check_loss_gathers(rank, world)
    D.barrier()
    # The same situations through the code before the fix, reported apart.
    os.environ[guard.REPORT_ENV] = str(report_dir / "old")
    (report_dir / "old").mkdir(exist_ok=True)
    old = _load_old_code()
    assert float(old["trainer"].log_step({"a": rank + 1}, world)) == pytest.approx(3.0)
    feats = D.to_device(torch.full((rank + 1, 2), float(rank)))
    n_forward, gathered = old["evaluate"].evaluate(feats, rank + 1)
    assert n_forward == 2 and gathered.shape == (3, 2)
    assert old["checkpoint"].convert_error("boom" if rank == 0 else None) == "boom"
    dist.barrier()
    dist.destroy_process_group()


def _check_helpers(D, rank: int, world: int) -> None:
    sim = guard.SimulatedDeviceTensor
    # Reductions: a CPU tensor in -> a plain CPU tensor out; a device tensor stays on the device.
    x = torch.tensor([float(rank + 1), -float(rank)])
    for fn, want in (
        (D.all_reduce_mean, [1.5, -0.5]),
        (D.all_reduce_sum, [3.0, -1.0]),
        (D.all_reduce_max, [2.0, 0.0]),
        (D.all_reduce_min, [1.0, -1.0]),
    ):
        out = fn(x)
        assert type(out) is torch.Tensor and out.tolist() == want, (fn.__name__, out)
        on_dev = fn(D.to_device(x))
        assert isinstance(on_dev, sim) and on_dev.tolist() == want
    assert x.tolist() == [float(rank + 1), -float(rank)]  # input untouched
    assert D.all_reduce_max(torch.tensor([rank, -rank], dtype=torch.int64)).tolist() == [1, 0]
    # Agreement: a bool, or a bool tensor on the device.
    assert D.any_rank(rank == 1) is True and D.any_rank(False) is False
    assert D.any_rank(D.to_device(torch.tensor([False, rank == 0]))) is True
    assert D.any_rank(D.to_device(torch.tensor(False))) is False
    # Objects.
    assert D.broadcast_object({"from": rank}, src=1) == {"from": 1}
    assert D.all_gather_object(("r", rank)) == [("r", 0), ("r", 1)]
    D.barrier()
    # Rows: different counts per rank; back where they came from.
    rows = torch.arange(2 * (rank + 1), dtype=torch.float32).reshape(rank + 1, 2) + 10 * rank
    got = D.all_gather_rows(rows)
    assert type(got) is torch.Tensor and got.tolist() == [[0, 1], [10, 11], [12, 13]]
    assert isinstance(D.all_gather_rows(D.to_device(rows)), sim)
    assert D.all_gather_rows(torch.zeros(0, 2) if rank == 0 else rows).tolist() == [[10, 11], [12, 13]]
    eq = torch.full((2, 3), float(rank))
    assert D.all_gather_cat(eq).tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
    # With grad: the backward equals torch.distributed.nn.all_gather's (sum over ranks of this rank's rows).
    from torch.distributed.nn import all_gather as nn_all_gather

    w = torch.arange(12, dtype=torch.float32).reshape(4, 3) * (rank + 1)
    leaf = torch.full((2, 3), float(rank), requires_grad=True)
    out = D.all_gather_cat_with_grad(leaf)
    assert out.tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
    (out * w).sum().backward()
    ref_leaf = torch.full((2, 3), float(rank), requires_grad=True)
    (torch.cat(nn_all_gather(ref_leaf)) * w).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=0, atol=0)
    assert leaf.grad.tolist() == (w[2 * rank : 2 * rank + 2] / (rank + 1) * 3).tolist()


def _check_loss_gathers(rank: int, world: int) -> None:
    """Every loss variant's gathers (forward and backward) go through the helpers: nothing flagged."""
    from ds_clip.step.loss import ContrastiveLoss, LossSpec

    specs = [
        LossSpec(),
        LossSpec(gather_with_grad=True),
        LossSpec(local_loss=True, gather_with_grad=True),
        LossSpec(siglip=True),
        LossSpec(impl="tiled", tile_size=3),
        LossSpec(local_loss=True, gather_with_grad=True, impl="tiled", tile_size=3),
        LossSpec(siglip=True, impl="tiled", tile_size=3),
    ]
    torch.manual_seed(rank)
    for spec in specs:
        image = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1).requires_grad_(True)
        text = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1).requires_grad_(True)
        scale = torch.tensor(10.0, requires_grad=True)
        bias = torch.tensor(-5.0, requires_grad=True) if spec.siglip else None
        out = ContrastiveLoss(spec, rank=rank, world_size=world)(image, text, scale, bias)
        out.backward_loss.backward()
        assert image.grad is not None and text.grad is not None and scale.grad is not None


@pytest.mark.distributed
def test_helpers_on_two_ranks_and_guard_catches_the_old_bugs(tmp_path):
    """On 2 gloo ranks with the guard on: every helper, and every loss variant's gathers (forward and
    backward), are right and flagged nowhere; the earlier code is flagged at each of its three bugs
    (trainer's log-line all-reduce of a CPU tensor through the old all_reduce_mean, evaluation's CPU gathers
    and CPU max, checkpoint's own collectives)."""
    import torch.multiprocessing as mp

    from ds_clip.distributed import _free_port

    mp.start_processes(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    new = guard.records(tmp_path / "new")
    assert {r["op"] for r in new} >= {
        "all_reduce",
        "all_gather",
        "broadcast_object_list",
        "all_gather_object",
        "barrier",
    }
    assert not guard.offences(tmp_path / "new"), guard.format_offences(guard.offences(tmp_path / "new"))
    assert "ds_clip.step.loss" in {m for r in new for m in r["modules"]}
    found = guard.offences(tmp_path / "old")
    text = guard.format_offences(found)
    print(text)
    sites = {(r["op"], r["site"].split(":")[0], r["stack"][-1].split(" ")[-1]) for r in found}
    assert ("all_reduce", "ds_clip/_old_distributed.py", "log_step") in sites, text  # bug 1: trainer log line
    assert ("all_gather", "ds_clip/_old_evaluate.py", "evaluate") in sites, text  # bug 2: _gather_rows
    assert ("all_reduce", "ds_clip/_old_evaluate.py", "evaluate") in sites, text  # bug 2: _max_over_ranks
    assert ("broadcast_object_list", "ds_clip/_old_checkpoint.py", "convert_error") in sites, text  # bug 3
    assert ("barrier", "ds_clip/_old_checkpoint.py", "convert_error") in sites, text
    assert all(
        any("never placed" in o or "not from ds_clip.distributed" in o for o in r["offences"]) for r in found
    )
    assert any("arg0 on cpu (never placed on the accelerator)" in r["offences"] for r in found)
    assert any("arg1 on cpu (never placed on the accelerator)" in r["offences"] for r in found)


# --------------------------------------------------------------------- the real trainer, guarded, e2e


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.update(extra)
    return env


def guarded_train_commands(model: str, logs: Path, report: Path) -> list[list[str]]:
    """Train 4 steps (log every step, evaluate at step 2 and 4, zero-shot at the end, save at step 2), then
    --resume latest for 2 more, both under `deepspeed --num_gpus 2` with the guard on every rank."""
    classes = logs / "classes.txt"
    classes.write_text("circle\nsquare\ntriangle\n")
    common = [
        "--model", model, "--batch-size", "4", "--accum-freq", "2", "--log-every-n-steps", "1",
        "--logs", str(logs), "--name", "guarded", "--workers", "0", "--report-to", "csv", "--warmup", "1",
        "--val-data", "synthetic", "--val-num-samples", "24", "--val-every-n-steps", "2",
        "--zeroshot-classes", str(classes), "--save-every-n-steps", "2",
    ]  # fmt: skip
    from ds_clip.distributed import _free_port

    launch = [
        "deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "--module",
        "tests.collective_guard", "--report", str(report),
    ]  # fmt: skip
    return [
        [*launch, "ds_clip.train", *common, "--max-steps", "4"],
        [*launch, "ds_clip.train", *common, "--max-steps", "6", "--resume", "latest"],
    ]


def run_guarded_trainer(model_dir: Path, tmp: Path, package_root: Path = ROOT) -> tuple[list[dict], str]:
    """Both guarded runs; ``package_root`` holds the ds_clip to test (another copy: an older version)."""
    (model_dir / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    report = tmp / "report"
    out = ""
    for cmd in guarded_train_commands(f"local-dir:{model_dir}", tmp, report):
        proc = subprocess.run(
            cmd,
            cwd=package_root,  # `python -m` puts the working folder first on sys.path
            env=_env(PYTHONPATH=f"{package_root}{os.pathsep}{ROOT}"),
            capture_output=True,
            text=True,
            timeout=900,
        )
        out += proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-5000:]
    return guard.records(report), out


@pytest.mark.e2e
@pytest.mark.slow
def test_trainer_evaluation_checkpoint_resume_issue_no_flagged_collective(tmp_path):
    """The real trainer on 2 ranks (logging every step, evaluation with zero-shot, a checkpoint, --resume):
    every collective ds_clip issues goes through ds_clip.distributed with its tensors placed on the
    accelerator; the run covers the loss's gather, the log line, evaluation and checkpoint agreement."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    recs, out = run_guarded_trainer(model_dir, tmp_path)
    assert "resumed from" in out and "val step 4" in out and "val step 6" in out
    bad = [r for r in recs if r["offences"]]
    assert not bad, guard.format_offences(bad)
    # By module or package: ds_clip.evaluate.runner counts as ds_clip.evaluate.
    callers = {m for r in recs for m in r["modules"] if m}
    for where in ("ds_clip.evaluate", "ds_clip.checkpoint", "ds_clip.step.loss", "ds_clip.training.trainer"):
        assert any(c == where or c.startswith(where + ".") for c in callers), (where, callers)
    assert {r["rank"] for r in recs} == {0, 1}

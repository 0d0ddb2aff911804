"""One wiring: the trainer, the equivalence harness, the benchmarks that time a step and the GPU check build
their model, engine and step with ds_clip.training.wiring, and none of them calls ``cached_step`` or builds an engine of its
own, so that what the tests prove and the benchmarks time is the step ``ds-clip-train`` trains (with its seeds
and the logit-scale clamp). Unit tests of the step itself (tests/) and the example of the step in a user's own
loop with the user's own engine (examples/own_loop.py) are the callers that stand apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("ds_clip", "ds_clip_harness", "benchmarks", "scripts")
# (file, function) -> why it may call it: the one wiring itself, or a baseline that is not ds_clip's step.
ALLOWED = {
    ("ds_clip/training/wiring.py", "cached_step"): "the step",
    ("ds_clip/training/wiring.py", "build_engine"): "the engine of the step",
    ("benchmarks/bench_exactness_cost.py", "build_engine"): "the baseline: DeepSpeed's own accumulation",
}


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in ("cached_step", "build_engine"):
                names.add(name)
    return names


def test_only_the_run_builder_calls_the_step_and_builds_an_engine():
    found = {
        (str(p.relative_to(ROOT)), name)
        for top in SCANNED
        for p in sorted((ROOT / top).rglob("*.py"))
        for name in _calls(p)
    }
    assert found == set(ALLOWED), sorted(found ^ set(ALLOWED))

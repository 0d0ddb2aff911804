"""Largest errors of the equivalence matrix, as a table (the figures quoted in docs/equivalence.md).

    source .venv/bin/activate && python scripts/equivalence_report.py [--out docs/equivalence.md]

Runs the same cases as tests/test_equivalence.py (ds_clip_harness.cases.CASES: 2 ranks x k=2, 4 ranks x k=1,
3 AdamW steps, each engine built by ds_clip.training.engine from the shipped presets, as ds-clip-train builds it) and
reports per case: the largest per-parameter relative error of DeepSpeed's reduced gradient against
the single-process open_clip oracle (floor 1e-3 of the total gradient norm, as in the test), the
logit_scale / logit_bias errors, and the largest |parameter difference| between the two splits.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: ds_clip_harness (not installed) must import
    sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the table as markdown to this file")
    a = p.parse_args(argv)

    import torch

    from ds_clip_harness.cases import CASES
    from ds_clip_harness.cases import spec_for as _spec
    from ds_clip_harness.groups import spawn_group
    from ds_clip_harness.models import write_model_dirs
    from ds_clip_harness.oracle import oracle_errors, oracle_first_step
    from ds_clip_harness.runs import run_many

    with tempfile.TemporaryDirectory() as tmp:
        models = write_model_dirs(Path(tmp))
        w2 = {r.spec.name: r for r in spawn_group(2, run_many, [_spec(c, models, k=2) for c in CASES])}
        w4 = {r.spec.name: r for r in spawn_group(4, run_many, [_spec(c, models, k=1) for c in CASES])}
        rows = []
        for c in CASES:
            grads, _ = oracle_first_step(_spec(c, models, k=2), world_size=2)
            errs = oracle_errors(w2[c.name], grads, floor=1e-3)
            worst = max(errs, key=errs.get)
            diff = max(float((p - w4[c.name].params[n]).abs().max()) for n, p in w2[c.name].params.items())
            bias = f"{errs['logit_bias']:.1e}" if "logit_bias" in errs else "-"
            ema_a, ema_b = w2[c.name].ema, w4[c.name].ema
            ema = f"{max(float((v - ema_b[n]).abs().max()) for n, v in ema_a.items()):.1e}" if ema_a else "-"
            rows.append(
                f"| {c.name} | {errs[worst]:.1e} ({worst}) | {errs['logit_scale']:.1e} | {bias} | {diff:.1e} "
                f"| {ema} |"
            )
    cpu = platform.processor() or platform.machine()
    text = "\n".join(
        [
            f"Measured {date.today()} on {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}.",
            "",
            "| case | largest gradient error vs oracle (parameter) | logit_scale | logit_bias "
            "| max abs param diff, 2x2 vs 4x1 after 3 AdamW steps (lr 1e-3) | the same for the weight EMA |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(text)
    if a.out:
        Path(a.out).write_text(
            "# Equivalence: measured errors per configuration\n\n"
            + __doc__.split("\n\n")[1]
            + "\n\n"
            + text
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time lost per elastic restart: two torchrun hosts (2 ranks each), one SIGKILLed mid-run, the other finishes.

    python benchmarks/elastic_restart.py                         # tiny model, N=8, ~3 min on 2 CPU cores
    python benchmarks/elastic_restart.py --out benchmarks/results/raw/elastic_restart_cpu.json

The scenario of tests/test_elastic.py (ds_clip_harness.elastic): host A (the rendezvous store) and host B train
--global-batch-size N on W=4; once a rank logs step --kill-at-step, B's agent and ranks are SIGKILLed. The
timeline is read from the survivor's log lines, in seconds after the kill: its ranks' "lost contact" error, the
"resumed from" line (rendezvous of the smaller world, process start, model and engine build, checkpoint
conversion and load), the first step trained after the restart, and the step the run had reached at the kill
trained again (what the restart cost in all: the steps since the last checkpoint are trained twice). Wall time;
a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: ds_clip_harness (not installed) must import
    sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    from ds_clip_harness.elastic import two_hosts_one_dies
    from ds_clip_harness.models import E2E_MODEL

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--save-every-n-steps", type=int, default=3)
    p.add_argument("--kill-at-step", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    a = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ds_clip_elastic_") as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        (model / "open_clip_config.json").write_text(
            json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
        )
        train = [
            "--model", f"local-dir:{model}", "--batch-size", str(a.batch_size),
            "--global-batch-size", str(a.global_batch_size), "--max-steps", str(a.max_steps),
            "--save-every-n-steps", str(a.save_every_n_steps), "--log-every-n-steps", "1",
            "--log-dir", str(Path(tmp) / "logs"), "--name", "elastic", "--workers", "0", "--warmup", "2",
            "--dist-timeout", "120", "--resume", "latest",
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        run = two_hosts_one_dies(
            train, kill_at_step=a.kill_at_step, env=env, cwd=REPO_ROOT, timeout_s=a.timeout
        )
    if run.survivor.returncode != 0:
        print(run.survivor.text[-4000:], file=sys.stderr)
        return 1
    result = {
        "what": "seconds after SIGKILL of one of two torchrun hosts (2 ranks each) until each restart milestone",
        "cmd": "python benchmarks/elastic_restart.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end",
        "settings": vars(a) | {"out": str(a.out) if a.out else None},
        "timeline": run.restart_timeline(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

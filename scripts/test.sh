#!/usr/bin/env bash
# The test command (README, CI):  bash scripts/test.sh [pytest args]
# Installs what it needs (scripts/setup.sh), lints, then runs the whole suite: unit tests, the
# multi-process equivalence tests on the real DeepSpeed engine, and the launcher end-to-end runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# DeepSpeed JIT-builds a comm op into the torch extensions cache; one cache per venv, or two checkouts
# rebuild it back and forth.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
ruff check ds_clip ds_clip_harness tests benchmarks scripts examples
ruff format --check ds_clip ds_clip_harness tests benchmarks scripts examples
# Import layers and no cycles (pyproject.toml [tool.importlinter]).
lint-imports
# Two pytest-xdist workers, a module per work unit (tests/conftest.py): a launched run leaves one core idle for
# much of its life, and the second worker fills it. DS_CLIP_TEST_WORKERS=0 runs everything in this process.
# At the end: the 25 slowest test phases and each module's total (docs/start.md, "How long the suite may take").
workers=${DS_CLIP_TEST_WORKERS:-2}
set +e
python -m pytest -ra --durations=25 -n "$workers" --dist loadscope --no-loadscope-reorder "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: that is a broken suite, not a pass.
if [ "$rc" = 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"

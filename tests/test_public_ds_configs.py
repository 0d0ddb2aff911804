"""The DeepSpeed JSON files users bring (tests/data/ds_configs: Hugging Face's, DeepSpeedExamples', DeepSpeed's own,
EVA-CLIP's, unchanged; SOURCES.md) passed as `--ds-config FILE` next to only a model and data: each trains two
optimizer steps on two CPU ranks, or is refused in one line (exit 2) for a reason in the file itself.

Every file goes through `ds_clip.train.main`, what `ds-clip-train` runs, on the ranks of one gloo process group
(several files per group: one DeepSpeed start per rank), on real webdataset shards. docs/deepspeed-json.md holds the
table this test checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ds_clip_harness.cases import fp16_supported
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "tests" / "data" / "ds_configs"
DOC = ROOT / "docs" / "deepspeed-json.md"

FP16 = "fp16 (runs where the CPU has AVX512-FP16)"
# file -> None: trains two steps; FP16: trains where this machine's accelerator has fp16, else the one-line fp16
# refusal; a string: the start of its one-line refusal (after "ds-clip-train: error: ").
OUTCOMES: dict[str, str | None] = {
    "hf-transformers_ds_config_zero2.json": None,
    "hf-transformers_ds_config_zero2_bf16.json": None,
    "hf-transformers_ds_config_zero3.json": "zero_optimization.reduce_bucket_size=0 in {path}: DeepSpeed 0.19.8 "
    "refuses it",
    "hf-accelerate_ds_config_zero2.json": None,
    "hf-accelerate_ds_config_zero3.json": None,
    "hf-accelerate_ds_config_zero2_model_only.json": None,
    "dse_cifar_ds_config.json": FP16,
    "dse_cifar_ds_config_lamb.json": 'optimizer.type="Lamb" in {path}: DeepSpeed 0.19.8 builds FusedLamb, a CUDA kernel',
    "dse_cifar_ds_config_onebitlamb.json": 'optimizer.type="OneBitLamb" in {path}: DeepSpeed\'s 1-bit optimizers need '
    "CUDA GPUs",
    "dse_imagenet_ds_config.json": "--ds-config {path}: not valid JSON",
    "dse_alpaca-lora-zero3_ds_config.json": FP16,
    "dse_QANet_ds_bsz512_1cycle.json": None,
    "dse_QANet_ds_bsz512_warmup.json": None,
    "dse_megatron_ds_zero_stage_infinity_config.json": 'zero_optimization.offload_optimizer.device="nvme" in {path}',
    "dse_autotuning_ds_config_z2.json": None,
    "deepspeed_autotuning_template_zero2.json": None,
    "deepspeed_autotuning_template_zero3.json": None,
    "deepspeed_pipeline_parallelism_ds_config.json": None,
    "deepspeed_gan_deepspeed_config.json": None,
    "eva_clip_deepspeed_config.json": FP16,
    "deepspeed_docs_config-json_muon_zero3.json": None,
    "dse_bf16_master_weight_bf16_full.json": None,
    "eva_EVA-CLIP_rei_deepspeed_config.json": 'optimizer.type="LAMB" with zero_optimization.offload_optimizer in {path}',
}
# What DeepSpeed needs of a file to run it as written, in the JSON the engine got.
ENGINE_KEYS: dict[str, dict] = {
    # Muon on ZeRO-3: DeepSpeed's default reduce_scatter true raises on every rank.
    "deepspeed_docs_config-json_muon_zero3.json": {
        "zero_optimization": {
            "stage": 3,
            "save_muon_momentum_buffer_in_memory": True,
            "reduce_scatter": False,
        }
    },
    # bf16 weights (and bf16 master copies) under torch.autocast, both as the file enables them.
    "dse_bf16_master_weight_bf16_full.json": {
        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    },
}
START_WARNINGS = {
    "dse_QANet_ds_bsz512_warmup.json": "scheduler WarmupLR in {path} warms up over warmup_num_steps=1000 steps, "
    "not fewer than the run's 2 optimizer steps",
}
FP16_REFUSAL = (
    "the enabled fp16 section of {path} (DeepSpeed fp16): this machine's cpu accelerator has no fp16"
)
STEPS = 2


def test_every_public_file_is_listed_with_its_source_and_in_the_docs_table():
    files = sorted(p.name for p in FILES.glob("*.json"))
    assert files == sorted(OUTCOMES) and len(files) >= 12
    sources = (FILES / "SOURCES.md").read_text()
    doc = DOC.read_text()
    for name, outcome in OUTCOMES.items():
        assert f"| {name} |" in sources, name
        row = next((ln for ln in doc.splitlines() if ln.startswith(f"| {name} |")), None)
        assert row is not None, f"{name} has no row in {DOC.name}"
        expected = "trains" if outcome is None else "trains (fp16)" if outcome is FP16 else "refused"
        assert f"| {expected} |" in row, row


def _main_on_each(argvs: list[list[str]]) -> list[tuple[int, list[str], list[str]]]:
    """Every rank runs ds-clip-train's main on each command line in turn; rank 0's exit codes, error lines and the
    warnings ds_clip logged."""
    import logging

    from ds_clip.train import main

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ds_clip").addHandler(handler)
    results = []
    for argv in argvs:
        err = io.StringIO()
        warnings.clear()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        errors = [ln for ln in err.getvalue().splitlines() if "error" in ln or "Traceback" in ln]
        results.append((code, errors, list(warnings)))
    return results


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("public_json")
    (root / "model").mkdir()
    (root / "model" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    # Two steps of the largest file's N (train_batch_size 512) on W = 2: 1024 pairs.
    made = subprocess.run(
        [sys.executable, "-m", "ds_clip.shards", "--synthetic", "1024", "--image-size", "32",
         "--samples-per-shard", "128", "--output", str(root / "shards")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return f"local-dir:{root / 'model'}", str(root / "shards" / "{00000..00007}.tar")


@pytest.mark.e2e
@pytest.mark.slow
def test_each_public_file_trains_two_steps_on_two_ranks_or_is_refused_in_one_line(data, tmp_path):
    model, shards = data
    names = list(OUTCOMES)
    argvs = [
        ["--ds-config", str(FILES / name), "--model", model, "--train-data", shards, "--max-steps", str(STEPS),
         "--logs", str(tmp_path), "--name", Path(name).stem, "--workers", "0", "--log-every-n-steps", "1"]
        for name in names
    ]  # fmt: skip
    results = spawn_group(2, _main_on_each, argvs)
    fp16 = fp16_supported()
    for name, (code, lines, warnings) in zip(names, results):
        path = str(FILES / name)
        outcome = OUTCOMES[name]
        if outcome is FP16:
            outcome = None if fp16 else FP16_REFUSAL
        if outcome is None:
            assert code == 0, (name, lines)
            run = tmp_path / Path(name).stem
            assert (run / "checkpoints" / "latest_complete").read_text() == f"step_{STEPS:08d}", name
            ds = json.loads((run / "ds_config.json").read_text())
            assert ds["gradient_accumulation_steps"] == 1, name
            assert not re.search(r'"auto"', (run / "ds_config.json").read_text()), name
            # A JSON schedule the run outlasts (or never finishes warming up) is warned of at start.
            said = START_WARNINGS.get(name)
            if said is not None:
                assert [w for w in warnings if w.startswith(said.format(path=path))], (name, warnings)
            for section, keys in ENGINE_KEYS.get(name, {}).items():
                assert {k: ds[section].get(k) for k in keys} == keys, (name, section, ds[section])
        else:
            assert code == 2, (name, code, lines)
            assert len(lines) == 1 and lines[0].startswith("ds-clip-train: error: "), (name, lines)
            assert lines[0][len("ds-clip-train: error: ") :].startswith(outcome.format(path=path)), (
                name,
                lines,
            )

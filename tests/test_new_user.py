"""What a new user meets in the first hour, following README.md and docs/ on 2 CPU ranks with a tiny model, a
table of JPEGs and a class-folder tree.

Contract: --epochs and --max-steps are two limits and the run stops at whichever comes first, as --help,
--dry-run and the start line say; --dry-run reads the training table as the start does; a mistyped flag is one
line with the closest flag and a pointer to --help; a spreadsheet's "CSV UTF-8" (a byte-order mark) is read by
training, evaluation and ds-clip-shards alike, and ds-clip-shards refuses the rows they refuse; bad input
found by the ranks reads once per job (every rank raises the same agreed error, rank 0 prints it); a run's
step lines and last line name skipped samples and skipped steps apart; --zeroshot-classes follows
--zeroshot-frequency; a warmup as long as the run is warned of; ds-clip-export says when a run saved no
checkpoint and does not replace an export silently; the default run name is the documented pattern.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_clip.train import main as train_main
from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL
from tests import launch
from tests.data.test_csv import write_table

ROOT = Path(__file__).resolve().parents[1]


def _error_lines(text: str, prog: str = "ds-clip-train") -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"{prog}: error:")]


def _dry_run(capsys, *argv: str) -> tuple[int, str, str]:
    code = train_main(["--dry-run", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _model_dir(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{folder}"


# ------------------------------------------------------------------------------ flags, the dry run, the help


def test_epochs_and_max_steps_stop_at_whichever_comes_first_and_the_dry_run_says_so(capsys):
    """64 synthetic pairs at N = 8: 8 steps an epoch. --epochs 1 --max-steps 40 trains one epoch (8 steps, not
    40); --max-steps alone trains its steps (5 epochs); --epochs 2 --max-steps 10 stops at step 10. A warmup
    not shorter than the run is warned of."""
    base = ["--train-num-samples", "64", "--batch-size", "8"]
    for extra, want in [
        (
            ["--epochs", "1", "--max-steps", "40"],
            "8 steps = 1 epoch of 8 steps (--epochs 1, before --max-steps 40",
        ),
        (["--max-steps", "40"], "40 steps = 5 epochs of 8 steps (--max-steps 40)"),
        (["--epochs", "2", "--max-steps", "10"], "10 steps = 1.25 epochs of 8 steps (--max-steps 10, before"),
        ([], "8 steps = 1 epoch of 8 steps (--epochs 1)"),
        (["--epochs", "3"], "24 steps = 3 epochs of 8 steps (--epochs 3)"),
    ]:
        code, out, err = _dry_run(capsys, *base, *extra)
        assert code == 0, err
        assert f"# length: {want}" in out, (extra, out)
        assert "# warning:" not in out
    code, out, _ = _dry_run(capsys, *base, "--max-steps", "10", "--warmup", "100")
    assert code == 0
    warned = [ln for ln in out.splitlines() if ln.startswith("# warning:")]
    assert len(warned) == 1 and "--warmup 100" in warned[0] and "10 steps" in warned[0], out
    assert "ends at 10% of --lr" in warned[0]
    from ds_clip.config import flag_named

    assert "whichever limit comes first" in flag_named("epochs").doc
    assert "--epochs" in flag_named("max_steps").doc
    docs = (ROOT / "docs" / "configuration.md").read_text()
    assert "whichever limit comes first" in docs


def test_dry_run_reads_the_training_table_as_the_start_does(tmp_path, capsys, monkeypatch):
    """A table with the wrong separator, image paths that resolve to nothing from here, or fewer rows than one
    global batch: --dry-run says so in one line (exit 2), as the start would; a good table passes."""
    good = write_table(tmp_path / "ok", 16)
    commas = write_table(tmp_path / "commas", 16, sep=",")
    relative = tmp_path / "ok" / "relative.tsv"
    relative.write_text("filepath\ttitle\n" + "".join(f"{i}.png\tc{i}\n" for i in range(16)))
    monkeypatch.chdir(tmp_path)
    for table, extra, needle in [
        (commas, [], "--csv-separator"),
        (relative, [], "working directory"),
        (good, ["--batch-size", "32"], "fewer than one global batch"),
    ]:
        code, out, err = _dry_run(capsys, "--train-data", str(table), *extra)
        assert code == 2 and "the flags are good" not in out, (table, out)
        assert len(err.strip().splitlines()) == 1 and needle in err, err
    code, out, err = _dry_run(capsys, "--train-data", str(good), "--batch-size", "4")
    assert code == 0 and "# length: 4 steps = 1 epoch of 4 steps" in out and "the flags are good" in out, err


def _exit_status(main, argv: list[str]) -> int:
    """What the console script exits with: main's return value, or the status it exits with."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_a_mistyped_flag_under_a_launcher_waits_out_the_grace_on_a_quiet_rank(monkeypatch, capsys):
    """A mistyped flag goes through the refusal every rank meets: rank 1 (quiet) prints nothing and returns 2
    after the grace that lets rank 0 write the one line (argparse's exit used to end it at once, and the
    launcher then killed rank 0 before it printed); rank 0 prints the line and returns 2."""
    monkeypatch.setenv("RANK", "1")
    assert train_main(["--batch-szie", "8"]) == 2
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    assert train_main(["--batch-szie", "8"]) == 2
    assert capsys.readouterr().err.startswith("ds-clip-train: error: unrecognized arguments: --batch-szie")


def test_a_mistyped_flag_is_one_line_with_the_closest_flag_and_a_pointer_to_help(capsys):
    from ds_clip.evaluate import main as eval_main
    from ds_clip.export.openclip import main as export_main

    for main, argv, prog, want in [
        (train_main, ["--batch-szie", "8"], "ds-clip-train", "did you mean --batch-size?"),
        (
            train_main,
            ["--lrr", "1e-3", "--warmpu", "5"],
            "ds-clip-train",
            "--lr for --lrr, --warmup for --warmpu",
        ),
        (eval_main, ["m", "--val-dta", "x"], "ds-clip-eval", "did you mean --val-data?"),
        (export_main, ["a", "b", "--overwirte"], "ds-clip-export", "did you mean --overwrite?"),
    ]:
        assert _exit_status(main, argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "usage:" not in err, err
        assert err.startswith(f"{prog}: error: unrecognized arguments:") and want in err, err
        assert f"`{prog} --help`" in err
    from ds_clip.shards import main as shards_main

    assert shards_main(["--synthetic", "3", "--output", "o", "--overwirte"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("--overwirte (did you mean --overwrite?)\n"), err


def test_the_default_run_name_is_the_documented_pattern(tmp_path):
    """k, or N under --global-batch-size (k then follows from the world size), as --help and the docs say; a
    local-dir: model named by the last two folders of its path, not "model_model"."""
    from datetime import datetime

    from ds_clip.config import default_run_name, flag_named, parse_settings

    model = _model_dir(tmp_path / "exports" / "model")
    now = datetime(2026, 1, 2, 3, 4, 5)
    s = parse_settings(["--model", model, "--batch-size", "4", "--accum-freq", "2"])
    assert default_run_name(s, now) == "2026_01_02-03_04_05-model_local-exports-model-m_4-k_2"
    s = parse_settings(["--batch-size", "8", "--global-batch-size", "64"])
    assert default_run_name(s, now) == "2026_01_02-03_04_05-model_ds-clip-tiny-m_8-N_64"
    doc = flag_named("name").doc
    assert '"YYYY_mm_dd-HH_MM_SS-model_<model>-m_<m>-k_<k>"' in doc and '"-N_<N>" in place of "-k_<k>"' in doc
    assert "last two folder names" in doc


class _ForwardOnly:
    """What the Evaluator calls on DeepSpeed's engine (train/eval, its module, its dtype, forward), around a
    model that embeds an image by its mean colour and a text by its length: the cadence is what is tested."""

    device = "cpu"

    def __init__(self) -> None:
        self.module = torch.nn.Linear(1, 1)

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()

    def bfloat16_enabled(self) -> bool:
        return False

    def fp16_enabled(self) -> bool:
        return False

    def __call__(self, image=None, text=None):
        out = {"logit_scale": torch.tensor(10.0)}
        if image is not None:
            out["image_features"] = torch.nn.functional.normalize(image.float().mean((2, 3)), dim=-1)
        if text is not None:
            out["text_features"] = torch.nn.functional.normalize(text.float()[:, :3] + 1, dim=-1)
        return out


def test_zeroshot_classes_follow_the_zeroshot_frequency_like_every_zero_shot_source(tmp_path):
    """--val-every-n-steps 1 with --zeroshot-classes and --zeroshot-frequency's default (the end only): the
    --val-data metrics at every step, the zero-shot ones at the end only; --zeroshot-frequency 1 (an epoch is 2
    steps) adds them at step 2, without the --val-data metrics that step is not on the cadence of."""
    import torchvision.transforms as T

    from ds_clip import evaluate as ev

    classes = tmp_path / "classes.txt"
    classes.write_text("circle\nsquare\ntriangle\ndiamond\n")
    settings = ev.EvalSettings(
        val_data="synthetic", val_num_samples=8, batch_size=4, zeroshot_classes=str(classes)
    )
    preprocess = T.Compose([T.Resize(8), T.ToTensor()])

    def tokenizer(texts):
        return torch.tensor([[len(t), t.count("a"), t.count("e"), 0] for t in texts])

    def history(every_n_steps: int, zeroshot_epochs: int | None, name: str) -> dict[int, set[str]]:
        run = tmp_path / name
        run.mkdir()
        evaluator = ev.Evaluator(
            _ForwardOnly(), settings, preprocess=preprocess, tokenizer=tokenizer, run_dir=run,
            every_n_steps=every_n_steps, is_main=True, zeroshot_every_n_epochs=zeroshot_epochs, steps_per_epoch=2,
        )  # fmt: skip
        for step in range(1, 4):
            evaluator.maybe_run(step, 4)
        evaluator.run(4)
        return {h["step"]: set(h) for h in json.loads((run / "eval_results.json").read_text())}

    got = history(1, None, "end_only")
    assert sorted(got) == [1, 2, 3, 4]
    assert [("zeroshot_top1" in got[s], "val_loss" in got[s]) for s in range(1, 5)] == [
        (False, True), (False, True), (False, True), (True, True)
    ]  # fmt: skip
    got = history(3, 1, "each_epoch")
    assert sorted(got) == [2, 3, 4]
    assert ("zeroshot_top1" in got[2], "val_loss" in got[2]) == (True, False)
    assert ("zeroshot_top1" in got[3], "val_loss" in got[3]) == (False, True)


def test_step_lines_and_the_last_line_name_the_two_kinds_of_skip():
    from ds_clip.training.metrics import format_line

    row = {
        "step": 3, "total_steps": 4, "epoch": 0, "samples_seen": 48, "loss": 2.0, "logit_scale": 14.0, "lr": 1e-4,
        "samples_per_s": 1.0, "samples_per_s_per_rank": 0.5, "data_time_s": 0.1, "step_time_s": 0.2,
        "peak_mem_mib": 1.0, "skipped_samples": 3, "skipped_steps": 1,
    }  # fmt: skip
    line = format_line(row)
    assert (
        "| skipped_samples 3 |" in line and line.endswith("| skipped_steps 1") and "| skipped 3" not in line
    )


def test_ds_clip_export_says_a_run_saved_no_checkpoint_and_keeps_an_existing_export(tmp_path, capsys):
    """The run folder of a run that stopped before its first save (settings.json, no checkpoints/latest_complete):
    named as such, not as a partial checkpoint. An OUT that holds an export: refused before anything is read
    or written, unless --overwrite."""
    from ds_clip.export.openclip import main as export_main

    run = tmp_path / "logs" / "run"
    run.mkdir(parents=True)
    (run / "settings.json").write_text("{}")
    (run / "ds_config.json").write_text("{}")
    assert export_main([str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "is a run folder whose run saved no checkpoint" in err
        and "partial" not in err
    )
    held = tmp_path / "held"
    held.mkdir()
    (held / "open_clip_model.safetensors").write_bytes(b"an earlier export")
    assert export_main([str(run), str(held)]) == 2
    err = capsys.readouterr().err
    assert "already holds an export (open_clip_model.safetensors); pass --overwrite" in err, err
    assert (held / "open_clip_model.safetensors").read_bytes() == b"an earlier export"
    assert (
        export_main([str(run), str(held), "--overwrite"]) == 2
    )  # past the refusal, to the missing checkpoint
    assert "saved no checkpoint" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ tables and shards


def _bom_table(folder: Path, rows: int, name: str = "train.csv", extra_row: str = "") -> Path:
    """A spreadsheet's "CSV UTF-8": comma-separated, with a byte-order mark before the header."""
    plain = write_table(folder, rows, sep=",")
    table = folder / name
    table.write_text(plain.read_text() + extra_row, encoding="utf-8-sig")
    assert table.read_bytes().startswith(b"\xef\xbb\xbffilepath,title")
    return table


def test_a_csv_with_a_byte_order_mark_is_read_by_training_evaluation_and_shards(tmp_path, capsys):
    from ds_clip import evaluate as ev
    from ds_clip.shards import main as shards_main
    from tests.data.test_csv import build

    table = _bom_table(tmp_path / "t", 8)
    data = build(table, csv_separator=",", m=2, k=2)  # the builder ds-clip-train calls
    assert len(data.dataset) == 8 and data.steps_per_epoch == 2
    ev.check_val_data(ev.EvalSettings(val_data=str(table), table=True, csv_separator=","))
    out = tmp_path / "shards"
    assert shards_main(["--from-csv", str(table), "--csv-separator", ",", "--output", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "wrote 8 samples in 1 shard to" in summary, summary  # one shard, not "1 shards"


def test_ds_clip_shards_refuses_the_rows_training_refuses(tmp_path, capsys):
    """A row with one field more than the header: training and evaluation refuse it (one reader), and so does
    ds-clip-shards, with the same words, before writing anything."""
    from ds_clip.data.base import DataError
    from ds_clip.shards import main as shards_main
    from tests.data.test_csv import build

    table = _bom_table(tmp_path / "t", 8, extra_row="x.png,a caption,an extra field\n")
    with pytest.raises(DataError) as refused:
        build(table, csv_separator=",")
    out = tmp_path / "shards"
    assert shards_main(["--from-csv", str(table), "--csv-separator", ",", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 10: not as many fields as the header's 2 columns" in err, err
    assert "line 10: not as many fields" in str(refused.value)
    assert not list(out.glob("*.tar"))


# ------------------------------------------------------------------------------- once per job, on 2 ranks


def _trainer_errors(cases: list[list[list[str]]]) -> list:
    """Every rank: for each case (one argv per rank), the error Trainer(...) raised here; rank 0 returns them
    all, rank by rank."""
    from ds_clip import distributed
    from ds_clip.config import parse_settings
    from ds_clip.errors import UserError
    from ds_clip.training.trainer import Trainer

    mine = []
    for per_rank in cases:
        try:
            Trainer(parse_settings(per_rank[distributed.rank()]))
            mine.append(None)
        except UserError as exc:
            mine.append((str(exc), exc.same_on_every_rank, exc.exit_code))
    return distributed.all_gather_object(mine)


@pytest.mark.distributed
@pytest.mark.slow
def test_bad_input_found_by_the_ranks_is_one_agreed_error_per_job(tmp_path):
    """2 ranks over gloo, each building the run as ds-clip-train does: an unwritable --logs, a one-class
    --zeroshot-folder, a table with the wrong separator, relative paths that do not resolve, fewer rows than
    one global batch, fewer shards than ranks x workers, and a --logs unwritable on rank 1 alone. Every rank
    raises the same UserError marked same_on_every_rank (the entry point prints those on rank 0 only: once
    per job), naming the rank when not every rank found it."""
    from ds_clip.shards import main as shards_main

    model = _model_dir(tmp_path / "model")
    (tmp_path / "a_file").write_text("")
    one_class = tmp_path / "one_class"
    write_table(one_class / "cats", 2)
    commas = write_table(tmp_path / "commas", 32, sep=",")
    relative = tmp_path / "relative.tsv"
    relative.write_text("filepath\ttitle\n" + "".join(f"{i}.png\tc{i}\n" for i in range(32)))
    few = write_table(tmp_path / "few", 6)
    assert (
        shards_main(["--synthetic", "32", "--samples-per-shard", "32", "--output", str(tmp_path / "one")])
        == 0
    )
    base = [
        "--model",
        model,
        "--batch-size",
        "4",
        "--max-steps",
        "1",
        "--workers",
        "1",
        "--logs",
        str(tmp_path),
    ]
    same = [
        (["--logs", str(tmp_path / "a_file" / "logs")], "is not a writable folder"),
        (["--zeroshot-folder", str(one_class)], "at least two classes"),
        (["--train-data", str(commas)], "','-separated"),
        (["--train-data", str(relative)], "working directory"),
        (["--train-data", str(few)], "fewer than one global batch N = W*k*m = 8"),
        (["--train-data", str(tmp_path / "one" / "00000.tar")], "fewer than ranks x workers = 2 x 1 = 2"),
    ]
    cases = [[[*base, *extra, "--name", f"c{i}"]] * 2 for i, (extra, _) in enumerate(same)]
    cases.append([[*base, "--name", "r0"], [*base, "--logs", str(tmp_path / "a_file" / "x"), "--name", "r1"]])
    found = spawn_group(2, _trainer_errors, cases)
    for i, (_, needle) in enumerate(same):
        on_0, on_1 = found[0][i], found[1][i]
        assert on_0 is not None and on_0 == on_1, (needle, found)
        message, once, code = on_0
        assert needle in message and once and code == 2, on_0
        assert not message.startswith("rank "), message  # every rank found it: no rank to name
    message, once, _ = found[0][-1]
    assert found[1][-1] == found[0][-1] and once
    assert message.startswith("rank 1: --logs") and "is not a writable folder" in message, message


def _launch(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return launch.run(launch.deepspeed(*argv))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_as_a_new_user_starts_it_under_the_deepspeed_launcher(tmp_path):
    """Two launches of `deepspeed --num_gpus 2 --module ds_clip.train` with a spreadsheet's CSV (a byte-order
    mark), one bad image among its rows, --global-batch-size and no --name.

    A table with fewer rows than one global batch: one error line for the job (exit 2); ds-clip-export of the
    run folder it left says its run saved no checkpoint. A good table (48 rows, N = 16: 3 steps an epoch),
    --max-steps 4, --warmup 10, --val-every-n-steps 1 with --zeroshot-classes: the start line gives the steps
    and epochs, warns of the warmup; step lines say skipped_samples, the last line skipped steps and skipped
    samples apart; the zero-shot metrics come at the end only (--zeroshot-frequency's default), the val ones
    every step; no rank warns of a requires_grad tensor made a scalar; the run folder is named by the
    documented pattern; ds-clip-export refuses to replace its export without --overwrite."""
    from ds_clip.export.openclip import main as export_main

    model = _model_dir(tmp_path / "exports" / "model")
    classes = tmp_path / "classes.json"
    classes.write_text(json.dumps({"classnames": ["circle", "square", "triangle", "diamond"]}))
    common = [
        "--model", model, "--batch-size", "4", "--global-batch-size", "16", "--csv-separator", ",",
        "--workers", "1", "--log-every-n-steps", "1",
    ]  # fmt: skip

    few = _bom_table(tmp_path / "few", 8)
    proc = _launch(tmp_path, *common, "--train-data", str(few), "--logs", str(tmp_path / "few_logs"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    errors = _error_lines(out)
    assert len(errors) == 1 and "fewer than one global batch N = W*k*m = 16" in errors[0], out[-3000:]
    (left,) = (tmp_path / "few_logs").iterdir()
    export = launch.run([sys.executable, "-m", "ds_clip.export", str(left), str(tmp_path / "nothing")])
    assert export.returncode == 2 and len(_error_lines(export.stderr, "ds-clip-export")) == 1, export.stderr
    assert "is a run folder whose run saved no checkpoint" in export.stderr and "partial" not in export.stderr

    table = _bom_table(tmp_path / "data", 48)
    bad = tmp_path / "data" / "5.png"
    bad.write_bytes(b"not a png")
    logs = tmp_path / "logs"
    proc = _launch(
        tmp_path, *common, "--train-data", str(table), "--logs", str(logs), "--max-steps", "4", "--warmup", "10",
        "--val-data", "synthetic", "--val-num-samples", "8", "--val-every-n-steps", "1",
        "--zeroshot-classes", str(classes),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "4 steps = 1.33 epochs of 3 steps (--max-steps 4)" in out, out[-4000:]
    warned = [ln for ln in out.splitlines() if "--warmup 10 is not shorter than the run (4 steps)" in ln]
    assert len(warned) == 1 and "ends at 40% of --lr" in warned[0], out[-4000:]
    steps = [ln for ln in proc.stdout.splitlines() if re.match(r"step \d+/4 \|", ln)]
    assert len(steps) == 4 and "| skipped " not in "".join(steps), steps
    bad_rows = int(re.findall(r"\| skipped_samples (\d+)", steps[-1])[0])  # the bad row, once or twice
    (done,) = [ln for ln in out.splitlines() if "done: 4 steps" in ln]
    assert f"0 skipped steps (non-finite updates), {bad_rows} skipped samples (bad data)" in done, done
    assert "requires_grad=True to a scalar" not in out
    (run_dir,) = logs.iterdir()
    assert re.fullmatch(r"\d{4}_\d\d_\d\d-\d\d_\d\d_\d\d-model_local-exports-model-m_4-N_16", run_dir.name)
    history = json.loads((run_dir / "eval_results.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [("zeroshot_top1" in h) for h in history] == [False, False, False, True], history
    assert all("val_loss" in h for h in history)

    export = tmp_path / "export"
    assert export_main([str(run_dir), str(export)]) == 0
    weights = (export / "open_clip_model.safetensors").stat().st_mtime_ns
    again = launch.run([sys.executable, "-m", "ds_clip.export", str(run_dir), str(export)])
    assert again.returncode == 2 and len(_error_lines(again.stderr, "ds-clip-export")) == 1, again.stderr
    assert "already holds an export" in again.stderr and "--overwrite" in again.stderr
    assert (export / "open_clip_model.safetensors").stat().st_mtime_ns == weights
    assert export_main([str(run_dir), str(export), "--overwrite"]) == 0

"""Checkpoints you can trust after a copy, on remote storage, and W&B (docs/remote.md).

    python -m pytest -q tests/test_remote.py              # ~4 min on 2 loaded CPU cores

- checksums: every file of a checkpoint's manifest carries its xxh3-128; a file changed after its save is
  refused on resume in one line naming it and the newest intact older checkpoint (no engine needed);
- RemoteSync on a real fsspec file system (a local folder through fsspec): only complete checkpoints go up,
  marker last; a changed file never reaches the remote as complete; a pull checks every file;
- end to end: an S3 server on 127.0.0.1 (moto's server mode) with s3fs as the client, under
  `deepspeed --num_gpus 2 --module ds_clip.train`: sync during training, kill the run, delete the local
  run folder, resume from the remote, compare with an uninterrupted run (<= 1e-6); then 64 bytes flipped
  in the middle of mp_rank_00_model_states.pt: the resume is refused naming the file;
- a save that fails on a full disk (a small tmpfs): one line, partial folder gone, last complete kept, exit
  1; with --on-save-failure continue the run goes on and the next save, once space is back, succeeds; on
  2 ranks under the launcher every rank agrees;
- W&B in offline mode: open_clip's metric names, project and notes, a resume logs into the same run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds_clip import checkpoint as ck
from ds_clip.checkpoint.find import verify_resume
from ds_clip.checkpoint.manifest import _listing, _manifest, first_mismatch
from ds_clip.training import remote as rm
from ds_clip_harness.models import E2E_MODEL
from tests import launch
from tests.launch import ROOT, VENV_BIN

M, K, W = 4, 2, 2
TIMEOUT_S = 240
ERROR = "ds-clip-train: error:"


# ------------------------------------------------------------------------------------ shared pieces


def _fake_checkpoint(ckpt_root: Path, step: int, payload: bytes) -> Path:
    """A checkpoint folder as ``checkpoint.save`` leaves it (files, manifest with checksums, marker,
    pointer), without an engine: what resume and sync read is the folder, not how it was written."""
    path = ckpt_root / ck.tag_for(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(payload)
    (path / "rank0.json").write_text(json.dumps({"data": {}, "rng": {}}))
    (path / ck.META).write_text(json.dumps({"step": step}))
    (path / ck.MANIFEST).write_text(json.dumps(_manifest(path, {})))
    (path / ck.MARKER).write_text(str(step))
    (ckpt_root / ck.POINTER).write_text(path.name)
    return path


def _flip_middle(path: Path, n: int = 64) -> None:
    """Flip n bytes in the middle of a file: same size, so only a checksum can tell."""
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        chunk = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(ERROR)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("remote_model")
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{d}"


def _args(model: str, logs: Path, name: str, *extra: str, steps: int) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--accum-freq", str(K), "--max-steps", str(steps),
        "--log-every-n-steps", "1", "--logs", str(logs), "--name", name, "--workers", "1",
        "--report-to", "csv", "--warmup", "1", *extra,
    ]  # fmt: skip


def _single(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return launch.run(
        [sys.executable, "-m", "ds_clip.train", *args], env=launch.environment(**env), timeout=TIMEOUT_S
    )


def _deepspeed(args: list[str], **env: str) -> subprocess.Popen:
    """The real launcher in its own session (so a kill takes the launcher and its ranks together)."""
    return launch.start(launch.deepspeed(*args, ranks=W), env=launch.environment(**env), merge_stderr=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    done = launch.finish(proc, TIMEOUT_S)
    return done.returncode, done.stdout


# ------------------------------------------------------------------------------------- checksums


def test_a_flipped_file_is_refused_naming_it_and_the_newest_intact_checkpoint(tmp_path):
    """64 bytes flipped in the middle of a saved model-state file (same size: the size check passes) are
    refused by the checksum, naming the file; --resume latest names the newest older intact checkpoint.
    A manifest from before checksums (name -> size) still resolves, with sizes checked only."""
    root = tmp_path / "run" / "checkpoints"
    _fake_checkpoint(root, 2, os.urandom(1 << 20))
    _fake_checkpoint(root, 4, os.urandom(1 << 20))
    newest = _fake_checkpoint(root, 6, os.urandom(1 << 20))
    verify_resume(tmp_path / "run", "latest")  # intact: nothing raised
    manifest = json.loads((newest / ck.MANIFEST).read_text())
    assert manifest["checksum"] == ck.CHECKSUM
    assert set(manifest["files"]) == {"mp_rank_00_model_states.pt", "rank0.json", ck.META}
    victim = newest / "mp_rank_00_model_states.pt"
    _flip_middle(victim)
    _flip_middle(root / ck.tag_for(4) / "rank0.json", 4)  # step 4 is damaged too: step 2 is the intact one
    with pytest.raises(ck.CorruptCheckpointError) as err:
        verify_resume(tmp_path / "run", "latest")
    line = str(err.value)
    assert "\n" not in line and str(victim) in line and "does not match its checksum" in line
    assert f"the newest intact checkpoint is {root / ck.tag_for(2)}" in line
    assert err.value.exit_code == 2
    # A checkpoint folder named directly is checked the same way.
    with pytest.raises(ck.CorruptCheckpointError, match="rank0.json"):
        verify_resume(tmp_path / "run", str(root / ck.tag_for(4)))
    # An older manifest without checksums: sizes only, nothing to verify.
    old = root / ck.tag_for(2)
    (old / ck.MANIFEST).write_text(json.dumps({n: (old / n).stat().st_size for n in _listing(old)}))
    assert ck.resolve(None, str(old)) == old and first_mismatch(old) is None


# ------------------------------------------------------------------------------ sync on a real fsspec


def test_sync_sends_only_complete_intact_checkpoints_and_a_pull_checks_every_file(tmp_path, caplog):
    """Through fsspec to a local folder (the code path s3fs and gcsfs take): complete checkpoints go up with
    the marker last and the pointer after; a partial one does not; one whose file changed after its save is
    never complete on the remote; --keep-checkpoints prunes the remote too. A pull into an empty run folder
    brings the newest complete checkpoint and the run's files; a damaged remote file is refused by name."""
    run = tmp_path / "logs" / "r"
    root = run / "checkpoints"
    (run / "metrics.csv").parent.mkdir(parents=True)
    (run / "metrics.csv").write_text("step,loss\n1,2.0\n")
    _fake_checkpoint(root, 2, os.urandom(300_000))
    _fake_checkpoint(root, 4, os.urandom(300_000))
    partial = root / ck.tag_for(6)
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"half")
    remote = rm.open_remote(f"file://{tmp_path / 'bucket'}", "r")
    rm.check_writable(remote)
    sync = rm.RemoteSync(remote, run, every_s=3600, keep=None)
    assert sync.sync_once()
    rroot = tmp_path / "bucket" / "r"
    assert rm.remote_complete(remote) == [ck.tag_for(2), ck.tag_for(4)]
    assert (rroot / "checkpoints" / ck.POINTER).read_text() == ck.tag_for(4)
    assert not (rroot / "checkpoints" / ck.tag_for(6)).exists()
    assert (rroot / "metrics.csv").read_text() == "step,loss\n1,2.0\n"
    # The marker went up after every other file of its folder (its mtime is the newest).
    up = rroot / "checkpoints" / ck.tag_for(4)
    assert max(f.stat().st_mtime_ns for f in up.iterdir()) == (up / ck.MARKER).stat().st_mtime_ns
    # A file changed after its save (a disk error): the checkpoint is not complete on the remote.
    changed = _fake_checkpoint(root, 8, os.urandom(300_000))
    _flip_middle(changed / "mp_rank_00_model_states.pt")
    with caplog.at_level("WARNING", logger="ds_clip"):
        assert not sync.sync_once()
    assert "no longer matches the checksum" in caplog.text and "training goes on" in caplog.text
    assert rm.remote_complete(remote) == [ck.tag_for(2), ck.tag_for(4)]
    assert (rroot / "checkpoints" / ck.POINTER).read_text() == ck.tag_for(4)
    shutil.rmtree(changed)
    (root / ck.POINTER).write_text(ck.tag_for(4))
    # --keep-checkpoints 1: the remote keeps the newest complete one.
    _fake_checkpoint(root, 10, os.urandom(300_000))
    rm.RemoteSync(remote, run, every_s=3600, keep=1).close()  # close() runs one last sync
    assert rm.remote_complete(remote) == [ck.tag_for(10)]
    # A fresh node: an empty run folder pulls the newest complete checkpoint and the run's files.
    fresh = tmp_path / "fresh" / "r"
    fresh.mkdir(parents=True)
    pulled = rm.pull_latest(remote, fresh)
    assert pulled == fresh / "checkpoints" / ck.tag_for(10)
    assert ck.resolve(fresh, "latest") == pulled and first_mismatch(pulled) is None
    assert (fresh / "metrics.csv").exists() and not list((fresh / "checkpoints").glob(".pull-*"))
    assert rm.pull_latest(remote, fresh) is None  # as new here as there: nothing to pull
    # A damaged remote copy is refused naming the remote file; nothing half-pulled stays.
    _flip_middle(rroot / "checkpoints" / ck.tag_for(10) / "mp_rank_00_model_states.pt")
    other = tmp_path / "other" / "r"
    other.mkdir(parents=True)
    with pytest.raises(rm.RemoteError, match=r"step_00000010/mp_rank_00_model_states.pt does not match"):
        rm.pull_latest(remote, other)
    assert not (other / "checkpoints" / ck.tag_for(10)).exists()


def test_unwritable_remote_is_one_line_exit_2(tmp_path, model_dir):
    """--remote-sync to a folder that cannot be created (under a regular file): one line, exit 2, before
    the engine; a URL that does not fit the protocol, too."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    p = _single(_args(model_dir, tmp_path, "u", "--remote-sync", f"file://{blocker}/sub",
                      "--remote-sync-protocol", "fsspec", steps=1))  # fmt: skip
    assert p.returncode == 2, p.stderr[-3000:]
    lines = _error_lines(p.stderr)
    assert len(lines) == 1 and "--remote-sync" in lines[0] and "cannot write there" in lines[0]
    assert "Traceback" not in p.stderr
    p = _single(_args(model_dir, tmp_path, "u", "--remote-sync", "gs://b/x", steps=1))
    assert p.returncode == 2 and "--remote-sync-protocol s3 needs an s3:// URL" in p.stderr


def test_a_final_sync_that_could_outlast_dist_timeout_is_refused_naming_both_flags(tmp_path, capsys):
    """The other ranks wait for rank 0's last sync in a collective: a --remote-sync-final-timeout that does not
    end (with a minute to spare) within --dist-timeout is one line at start naming both flags, exit 2 (it used
    to let them fail with "lost contact" and the launcher kill rank 0 mid-upload); one that fits is accepted.
    Its default (600 s), which the user did not choose, is fitted to a shorter --dist-timeout instead."""
    from ds_clip.config import parse_settings
    from ds_clip.train import main

    sync = ["--remote-sync", f"file://{tmp_path}/r", "--remote-sync-protocol", "fsspec", "--name", "n"]
    passed = [*sync, "--remote-sync-final-timeout", "600", "--dist-timeout", "300"]
    assert main([*passed, "--logs", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(ERROR), err
    assert "--remote-sync-final-timeout 600 s" in err and "--dist-timeout 300 s" in err, err
    assert "at most 240" in err and "at least 660" in err, err
    parse_settings([*sync, "--dist-timeout", "300", "--remote-sync-final-timeout", "240"])
    assert parse_settings([*sync, "--dist-timeout", "300"]).checkpoint.remote_sync_final_timeout == 240
    assert parse_settings(sync).checkpoint.remote_sync_final_timeout == 600
    parse_settings(["--dist-timeout", "300"])  # no remote: nothing to fit


# --------------------------------------------------------------------------------- S3, end to end


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 and the environment that points s3fs at it; a bucket "ckpt"."""
    port = launch.free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
    }  # fmt: skip
    deadline = time.monotonic() + 60
    while True:  # the server is up once it accepts a connection
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # botocore reads credentials from the environment at each request
    _restart_fork_server()
    _forget_s3_clients()
    try:
        _s3fs(env).mkdir("ckpt")
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait(timeout=30)
        _restart_fork_server()
        _forget_s3_clients()


def test_a_resumed_run_that_rewrites_steps_makes_the_remote_copy_the_local_one(tmp_path, s3):
    """S3 (moto on 127.0.0.1, s3fs): a run synced steps 2-8, then was resumed from step 2 (another schedule, as
    --resume PATH allows) and saved steps 4 and 6 again. Each rewritten step goes up again, in the running
    sync (which knew it complete) and in a new one (a restart, which reads the remote manifests): the remote
    files, manifest and marker are the local ones, and the remote latest_complete names step 6 as the local one
    does, not the abandoned step 8. A fresh node's --resume latest pulls the new step 6. (A step already
    complete on the remote used to be skipped, and a pull took the highest step.)"""
    run = tmp_path / "logs" / "r"
    root = run / "checkpoints"
    for step in (2, 4, 6, 8):
        _fake_checkpoint(root, step, os.urandom(100_000))
    remote = rm.open_remote("s3://ckpt/runs", "r")
    sync = rm.RemoteSync(remote, run, every_s=3600, keep=None)
    assert sync.sync_once()
    fs = _s3fs(s3)

    def rewrite(step: int) -> Path:  # the new history's save of a step saved before
        shutil.rmtree(root / ck.tag_for(step))
        return _fake_checkpoint(root, step, os.urandom(100_000))

    def same_on_remote(folder: Path) -> bool:
        there = f"ckpt/runs/r/checkpoints/{folder.name}"
        names = ["mp_rank_00_model_states.pt", "rank0.json", ck.META, ck.MANIFEST, ck.MARKER]
        return all(fs.cat(f"{there}/{n}") == (folder / n).read_bytes() for n in names)

    new4 = rewrite(4)
    assert sync.sync_once()
    assert same_on_remote(new4)
    assert fs.cat("ckpt/runs/r/checkpoints/latest_complete") == ck.tag_for(4).encode()
    new6 = rewrite(6)
    restarted = rm.RemoteSync(remote, run, every_s=3600, keep=None)
    assert restarted.close() is None
    assert same_on_remote(new4) and same_on_remote(new6)
    assert fs.cat("ckpt/runs/r/checkpoints/latest_complete") == ck.tag_for(6).encode()
    assert "step_00000006" in restarted.describe_remote().split("not on the remote")[0]

    fresh = tmp_path / "fresh" / "r"
    fresh.mkdir(parents=True)
    pulled = rm.pull_latest(remote, fresh)
    assert pulled == fresh / "checkpoints" / ck.tag_for(6) and ck.resolve(fresh, "latest") == pulled
    name = "mp_rank_00_model_states.pt"
    assert (pulled / name).read_bytes() == (new6 / name).read_bytes()

    # --keep-checkpoints 1 keeps the run's own newest step on the remote (by step number alone, the abandoned
    # step 8 was kept and step 6, which latest_complete names, removed).
    assert rm.RemoteSync(remote, run, every_s=3600, keep=1).sync_once()
    there = "ckpt/runs/r/checkpoints"
    assert fs.exists(f"{there}/{ck.tag_for(6)}/{ck.MARKER}") and same_on_remote(new6)
    assert not fs.exists(f"{there}/{ck.tag_for(4)}") and not fs.exists(f"{there}/{ck.tag_for(2)}")


def _forget_s3_clients() -> None:
    """Drop the S3 clients fsspec keeps per process: an s3:// file system is cached by its arguments, so one made
    under another test's environment (its server, since stopped) would answer here instead of this server."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def _restart_fork_server() -> None:
    """Stop this process's multiprocessing fork server, if one runs: the next loader whose workers start from it
    starts a new one with the environment as it is now. (A pytest-xdist worker runs threads, so in-process
    loaders there take ds_clip.stop_signals' fork server, started by whichever test came first, with that
    test's environment: workers reading s3:// would lack the credentials set here.)"""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # the standard library's own hook for tests


def _s3fs(env: dict[str, str]):
    """An s3fs client of the test's server, configured by the environment the runs get (set by ``s3``)."""
    import s3fs

    assert all(os.environ.get(k) == v for k, v in env.items())
    return s3fs.S3FileSystem(skip_instance_cache=True)


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from ds_clip.export.openclip import consolidated_state_dict

    return consolidated_state_dict(run_dir / "checkpoints" / ck.tag_for(step))


@pytest.mark.e2e
@pytest.mark.slow
def test_s3_sync_kill_delete_resume_from_remote_matches_uninterrupted(model_dir, tmp_path, s3):
    """Under `deepspeed --num_gpus 2`: a run syncing to S3 every second is SIGKILLed (launcher and ranks)
    once its step-4 checkpoint is complete on the remote; its local run folder is deleted; the same command
    with --resume latest pulls step 4 from S3, checks it and finishes at step 8 with the weights of a run
    that was never interrupted (<= 1e-6). Then 64 bytes flipped in the middle of the final
    mp_rank_00_model_states.pt make --resume latest exit 2 naming the file and the intact step 6."""
    url = "s3://ckpt/runs"
    sync = ("--save-every-n-steps", "2", "--remote-sync", url, "--remote-sync-frequency", "1")
    reference = _deepspeed(_args(model_dir, tmp_path / "ref", "r", "--save-every-n-steps", "2", steps=8))
    code, out = _finish(reference)
    assert code == 0, out[-4000:]
    # From batch 4 (0-based) on, rank 0 feeds NaN: every later update is skipped on every rank, so the run
    # stays alive after its step-4 checkpoint until it is killed.
    first = _deepspeed(
        _args(model_dir, tmp_path / "logs", "r", *sync, "--max-skipped-steps", "100000", steps=8),
        DS_CLIP_INJECT_FAULT="nan@4-:0", **s3,
    )  # fmt: skip
    fs, pointer = _s3fs(s3), "ckpt/runs/r/checkpoints/latest_complete"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not (fs.exists(pointer) and fs.cat(pointer).decode() == ck.tag_for(4)):
            assert first.poll() is None, first.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "step 4 never reached the remote"
            fs.invalidate_cache()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        first.communicate(timeout=60)
    assert fs.exists("ckpt/runs/r/checkpoints/step_00000004/COMPLETE")
    shutil.rmtree(tmp_path / "logs" / "r")  # a fresh node: nothing local
    code, out = _finish(_deepspeed(_args(model_dir, tmp_path / "logs", "r", *sync, "--resume", "latest",
                                         steps=8), **s3))  # fmt: skip
    assert code == 0, out[-4000:]
    assert "pulled step_00000004 from s3://ckpt/runs/r" in out and "at step 4" in out, out[-4000:]
    got, want = _weights(tmp_path / "logs" / "r", 8), _weights(tmp_path / "ref" / "r", 8)
    assert got.keys() == want.keys()
    assert max(float((got[n] - want[n]).abs().max()) for n in got) <= 1e-6
    assert fs.exists("ckpt/runs/r/checkpoints/step_00000008/COMPLETE")  # the final sync at the end
    # The corrupted final checkpoint: refused before any engine starts, naming the file.
    victim = tmp_path / "logs" / "r" / "checkpoints" / ck.tag_for(8) / "mp_rank_00_model_states.pt"
    _flip_middle(victim)
    code, out = _finish(_deepspeed(_args(model_dir, tmp_path / "logs", "r", "--resume", "latest", steps=10)))
    assert code != 0 and "Traceback" not in out, out[-4000:]
    lines = [ln for ln in out.splitlines() if ERROR in ln]
    assert lines and all(str(victim) in ln and ck.tag_for(6) in ln for ln in lines), out[-4000:]
    assert re.search(r"exits with return code = 2|exit(ed)? (code|status) 2", out) or code == 2, out[-2000:]


class _StallingStore:
    """A TCP relay in front of the S3 server that stops answering once a request names ``trigger``: that
    connection and every later one are held open and never answered, as an object store that hangs does."""

    def __init__(self, upstream_port: int, trigger: bytes) -> None:
        import threading

        self.upstream, self.trigger, self.stalled = upstream_port, trigger, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(client)
            if not self.stalled.is_set():
                up = socket.create_connection(("127.0.0.1", self.upstream))
                self.held.append(up)
                threading.Thread(target=self._pipe, args=(client, up, True), daemon=True).start()
                threading.Thread(target=self._pipe, args=(up, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, is_request: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if is_request and self.trigger in data:
                    self.stalled.set()
                if self.stalled.is_set():
                    return  # hold the connection: never answered, never closed
                dst.sendall(data)

    def close(self) -> None:
        self.listener.close()
        for sock in self.held:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_store_that_stops_answering_cannot_keep_a_finished_run_alive(model_dir, tmp_path, s3):
    """Under `deepspeed --num_gpus 2`: the object store stops answering when the final checkpoint (step 4) starts
    to go up. The finished run waits --remote-sync-final-timeout seconds for its last sync, then ends with one
    line naming what is complete on the remote (step 2) and what is not (step 4), exit 1; the local run folder
    keeps the complete step 4, and the same command with --resume latest says the run already finished."""
    store = _StallingStore(int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), trigger=ck.tag_for(4).encode())
    try:
        sync = (
            "--save-every-n-steps",
            "2",
            "--remote-sync",
            "s3://ckpt/stall",
            "--remote-sync-frequency",
            "3600",
        )
        args = _args(model_dir, tmp_path / "logs", "r", *sync, "--remote-sync-final-timeout", "20", steps=4)
        code, out = _finish(_deepspeed(args, **{**s3, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{store.port}"}))
        assert store.stalled.is_set(), out[-4000:]
        assert code != 0, out[-4000:]
        lines = _error_lines(out)
        assert len(lines) == 1, out[-4000:]
        assert "--remote-sync-final-timeout 20 s" in lines[0], lines
        assert "complete on the remote: step_00000002; not on the remote: step_00000004" in lines[0], lines
        assert "done: 4 steps" in out
        run = tmp_path / "logs" / "r"
        assert (run / "checkpoints" / ck.tag_for(4) / ck.MARKER).exists()
        assert (run / "checkpoints" / ck.POINTER).read_text() == ck.tag_for(4)
    finally:
        store.close()
    code, out = _finish(
        _deepspeed([*_args(model_dir, tmp_path / "logs", "r", steps=4), "--resume", "latest"])
    )
    assert code == 0 and "already finished at step 4" in out, out[-4000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_remote_sync_with_loader_workers_and_validation_read_once_per_shard(model_dir, tmp_path, s3):
    """Under `deepspeed --num_gpus 2` with --workers 2, a remote sync every second (a thread beside the training
    loop in rank 0) and validation every 2 steps on 2 webdataset shards: the loader workers start from a fork
    server (a fork while another thread holds an interpreter lock can hang the worker: CPython gh-112275), the
    run finishes with every checkpoint on the remote, and each validation reads each shard once in all (each
    rank its own shard), not once per rank: every read of a shard is logged by its pipe: command."""
    from ds_clip.shards import main as shards_main

    assert shards_main(["--synthetic", "16", "--output", str(tmp_path / "val"), "--image-size", "32",
                        "--samples-per-shard", "8"]) == 0  # fmt: skip
    reads = tmp_path / "reads.log"
    val = "::".join(f"pipe:echo {i} >> {reads}; cat {tmp_path / 'val' / f'{i:05d}.tar'}" for i in range(2))
    args = _args(model_dir, tmp_path / "logs", "w", "--workers", "2", "--save-every-n-steps", "2",
                 "--remote-sync", "s3://ckpt/workers", "--remote-sync-frequency", "1", "--val-data", val,
                 "--val-every-n-steps", "2", steps=4)  # fmt: skip
    code, out = _finish(_deepspeed(args, **s3))
    assert code == 0, out[-4000:]
    history = json.loads((tmp_path / "logs" / "w" / "eval_results.json").read_text())
    assert [h["step"] for h in history] == [2, 4] and all(h["val_samples"] == 16 for h in history)
    # 2 evaluations x 2 shards, each shard read once per evaluation
    assert sorted(reads.read_text().split()) == ["0", "0", "1", "1"], reads.read_text()
    assert "loader workers start from a fork server" in out and "ds_clip-remote-sync" in out, out[-4000:]
    fs = _s3fs(s3)
    assert fs.exists(f"ckpt/workers/w/checkpoints/{ck.tag_for(4)}/{ck.MARKER}")


# ------------------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size in MiB (mount needs root; skipped with the reason where it is refused)."""
    mounted: list[Path] = []

    def make(mib: int) -> Path:
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mnt)],
                           capture_output=True, text=True)  # fmt: skip
        if p.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root): {p.stderr.strip()[:200]}")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _checkpoint_mib(model: str) -> float:
    """One ZeRO-0 fp32 checkpoint of this model: weights + two Adam moments (12 bytes a parameter)."""
    from ds_clip.config import ModelSettings
    from ds_clip.training.engine import build_model_bundle

    bundle = build_model_bundle(ModelSettings(model=model), seed=0)
    return sum(p.numel() for p in bundle.model.parameters()) * 12 / 2**20


@pytest.mark.e2e
@pytest.mark.slow
def test_full_disk_save_is_one_line_keeps_the_last_complete_and_continue_retries(model_dir, small_disk):
    """A disk with room for one checkpoint: the second save fails. --on-save-failure stop (the default):
    one line naming the checkpoint, its path and "no space left", exit 1, the partial folder removed and
    latest_complete still the first. --on-save-failure continue: the same line as a warning, training goes
    on, and once space is back (a file deleted) the next save succeeds and the run exits 0."""
    size = _checkpoint_mib(model_dir)
    disk = small_disk(int(size * 2.6) + 4)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * int(size * 1.1 * 2**20))
    args = ("--save-every-n-steps", "2")
    p = _single(_args(model_dir, disk / "logs", "stop", *args, steps=4))
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "inline_container" not in p.stderr, p.stderr[-3000:]
    (line,) = _error_lines(p.stderr)
    ckpts = disk / "logs" / "stop" / "checkpoints"
    assert f"checkpoint {ck.tag_for(4)} could not be saved to {ckpts / ck.tag_for(4)}" in line, line
    assert "no space left on the device" in line and f"{ck.tag_for(2)} is kept" in line, line
    assert not (ckpts / ck.tag_for(4)).exists() and (ckpts / ck.POINTER).read_text() == ck.tag_for(2)
    shutil.rmtree(disk / "logs" / "stop")
    # continue: the failed save is a warning; the test frees space when it sees it, the next save succeeds.
    proc = subprocess.Popen(
        [sys.executable, "-m", "ds_clip.train", *_args(model_dir, disk / "logs", "go", *args,
                                                          "--on-save-failure", "continue", steps=6)],
        cwd=ROOT, env=launch.environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = []
    for ln in proc.stdout:  # waits on the run's own lines, bounded by the run's length
        seen.append(ln)
        if "training goes on (--on-save-failure continue)" in ln:
            filler.unlink()
    proc.wait(timeout=TIMEOUT_S)
    out = "".join(seen)
    assert proc.returncode == 0, out[-4000:]
    warned = [ln for ln in seen if "training goes on" in ln]
    assert len(warned) == 1 and ck.tag_for(4) in warned[0] and "no space left" in warned[0], out[-3000:]
    ckpts = disk / "logs" / "go" / "checkpoints"
    assert (ckpts / ck.POINTER).read_text() == ck.tag_for(6) and not (ckpts / ck.tag_for(4)).exists()
    verify_resume(disk / "logs" / "go", "latest")


@pytest.mark.e2e
@pytest.mark.slow
def test_full_disk_on_two_ranks_every_rank_agrees_and_the_run_stops(model_dir, small_disk):
    """Under `deepspeed --num_gpus 2` (ZeRO-1: each rank writes its optimizer partition): the second save
    does not fit. Every rank reports the same line (the failing rank's file and reason), none hangs in
    DeepSpeed's save barriers, the launcher exits 1, latest_complete still names the first checkpoint."""
    disk = small_disk(int(_checkpoint_mib(model_dir) * 2.4))
    # ZeRO-1 named: fp32 on 2 ranks defaults to ZeRO-0, whose checkpoints (12 bytes a parameter) would both fit.
    args = _args(model_dir, disk / "logs", "two", "--save-every-n-steps", "2", "--zero-stage", "1", steps=4)
    code, out = _finish(_deepspeed(args))
    assert code == 1 and "Traceback" not in out, out[-4000:]
    lines = [ln for ln in out.splitlines() if ln.startswith(ERROR)]
    assert len(lines) == W and len(set(lines)) == 1, out[-4000:]
    assert f"checkpoint {ck.tag_for(4)} could not be saved" in lines[0] and "no space left" in lines[0]
    ckpts = disk / "logs" / "two" / "checkpoints"
    assert (ckpts / ck.POINTER).read_text() == ck.tag_for(2) and not (ckpts / ck.tag_for(4)).exists()


# ------------------------------------------------------------------------------------------ W&B


def _wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (a LevelDB-style log: 32 KiB blocks, 7-byte chunk headers,
    after a 7-byte file header), as wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def _wandb_run(folder: Path) -> tuple[object, list[dict[str, str]]]:
    (f,) = folder.glob("run-*.wandb")
    records = _wandb_records(f)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    history = [
        {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    return run, history


@pytest.mark.e2e
@pytest.mark.slow
def test_wandb_offline_open_clip_names_project_notes_and_resume_into_the_same_run(model_dir, tmp_path):
    """--report-to wandb (WANDB_MODE=offline): the run is named and identified by --name, in
    --wandb-project-name with --wandb-notes; the train metrics carry open_clip's names (train/loss,
    train/scale, train/lr, train/samples_per_second, ...) and the val ones too (val/clip_val_loss,
    val/image_to_text_R@1); a --resume latest run logs into the same run id, from the next step on."""
    wb = ("--report-to", "wandb", "--wandb-project-name", "proj", "--wandb-notes", "some notes",
          "--val-data", "synthetic", "--val-num-samples", "16", "--save-every-n-steps", "2", "--lr", "1e-3")  # fmt: skip
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    args = [a for a in _args(model_dir, tmp_path, "wb", steps=2) if a not in ("--report-to", "csv")]
    p = _single([*args, *wb], **env)
    assert p.returncode == 0, p.stderr[-3000:]
    args = [a for a in _args(model_dir, tmp_path, "wb", steps=3) if a not in ("--report-to", "csv")]
    p = _single([*args, *wb, "--resume", "latest"], **env)
    assert p.returncode == 0, p.stderr[-3000:]
    first, second = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    run, history = _wandb_run(first)
    assert (run.run_id, run.display_name, run.project, run.notes) == ("wb", "wb", "proj", "some notes")
    train = next(h for h in history if h.get("step") == "1")
    for name in ("train/loss", "train/scale", "train/lr", "train/samples_per_second",
                 "train/samples_per_second_per_gpu", "train/data_time", "train/batch_time"):  # fmt: skip
        assert name in train, sorted(train)
    # train/lr is the LR each step trained at (--warmup 1, cosine over the run's steps), not the next step's.
    assert [float(h["train/lr"]) for h in history if "train/lr" in h] == pytest.approx([1e-3, 1e-3])
    assert any("val/clip_val_loss" in h and "val/image_to_text_R@1" in h for h in history), history
    run2, history2 = _wandb_run(second)
    assert run2.run_id == "wb" and run2.project == "proj"
    assert [h["step"] for h in history2 if "train/loss" in h] == ["3"]
    # Resumed into a 3-step run: step 3 trains at the cosine's value at step 2 of 3 (half the peak).
    assert [float(h["train/lr"]) for h in history2 if "train/lr" in h] == pytest.approx([5e-4])

"""A one-node SLURM on this machine for tests: munged, slurmctld and slurmd started from a folder of their own,
and stopped again (with every job cancelled) on exit.

    with slurm_cluster(tmp_path) as slurm:           # or the `slurm` fixture in tests/test_slurm.py
        subprocess.run(["sbatch", "--wait", "scripts/launch_slurm.sbatch", ...], env=slurm.env(os.environ))

What it builds, all under `workdir` (nothing in /etc, no system service): a munge key and munged on its own
socket; a slurm.conf (one node: this host, `CPUs=` at least 2 so two CPU tasks fit; one partition; no
cgroups: proctrack/linuxproc, task/none; no accounting) that the daemons read with `-f` and the client
commands through SLURM_CONF; state and spool folders; the daemons' logs. Debian's slurm-wlm and munge
(scripts/setup.sh installs them as root). The daemons run as root (SlurmUser=root), as the tests do.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "salloc", "scontrol", "squeue")
START_TIMEOUT_S = 60.0


class SlurmUnavailable(RuntimeError):
    """Why a SLURM cannot be started here (not root, packages missing)."""


def missing() -> str | None:
    """Why no SLURM can start on this machine, else None."""
    if os.geteuid() != 0:
        return "the SLURM tests start munged, slurmctld and slurmd as root"
    gone = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if gone:
        return f"{', '.join(gone)} not installed (scripts/setup.sh installs slurm-wlm and munge as root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Slurm:
    workdir: Path
    conf: Path
    node: str

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with SLURM_CONF pointing the client commands at this cluster (and no job's SLURM_* left)."""
        env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), env=self.env(dict(os.environ)), capture_output=True, text=True, timeout=timeout
        )

    def jobs(self) -> list[str]:
        """Ids of the jobs SLURM still knows as pending, running, completing or requeued."""
        out = self.run("squeue", "-h", "-o", "%i").stdout
        return [j for j in out.split() if j.strip()]

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job).stdout
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "GONE"


def _wait_for(what: str, ok, timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise SlurmUnavailable(f"{what} within {timeout_s:.0f} s; {tail}")
        time.sleep(0.2)  # polls a condition under a deadline


def _write_conf(work: Path, node: str, cpus: int) -> Path:
    conf = work / "slurm.conf"
    lines = {
        "ClusterName": "dsclip",
        "SlurmctldHost": node,
        "SlurmUser": "root",
        "SlurmctldPort": str(_free_port()),
        "SlurmdPort": str(_free_port()),
        "AuthType": "auth/munge",
        # cred_expire (120 s by default) is also how long a requeued job waits before it starts again: the
        # requeue test waited 137 s for it. 30 s still covers a step's start on a loaded 2-core machine.
        "AuthInfo": f"socket={work / 'munge.sock'},cred_expire=30",
        "CredType": "cred/munge",
        "StateSaveLocation": str(work / "state"),
        "SlurmdSpoolDir": str(work / "spool"),
        "SlurmctldPidFile": str(work / "slurmctld.pid"),
        "SlurmdPidFile": str(work / "slurmd.pid"),
        "SlurmctldLogFile": str(work / "slurmctld.log"),
        "SlurmdLogFile": str(work / "slurmd.log"),
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "SchedulerType": "sched/builtin",
        "AccountingStorageType": "accounting_storage/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "JobCompType": "jobcomp/none",
        "MpiDefault": "none",
        "ReturnToService": "2",
        "SlurmdParameters": "config_overrides",  # CPUs= may exceed this machine's cores
        "KillWait": "5",
        "MinJobAge": "300",
        "SlurmctldTimeout": "30",
        "SlurmdTimeout": "30",
        "InactiveLimit": "0",
        "Waittime": "0",
        "JobRequeue": "0",  # a job is requeued only when asked (sbatch --requeue)
    }
    text = "".join(f"{k}={v}\n" for k, v in lines.items())
    text += f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN\n"
    text += f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n"
    conf.write_text(text)
    return conf


@contextmanager
def slurm_cluster(workdir: Path, cpus: int | None = None) -> Iterator[Slurm]:
    """Start munged, slurmctld and slurmd in ``workdir``; cancel every job and stop them on exit."""
    why = missing()
    if why:
        raise SlurmUnavailable(why)
    work = workdir
    for d in ("state", "spool"):
        (work / d).mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)
    node = socket.gethostname()
    conf = _write_conf(work, node, max(2, cpus or os.cpu_count() or 2))
    key = work / "munge.key"
    subprocess.run(
        ["mungekey", "--create", "--keyfile", str(key), "--force"], check=True, capture_output=True
    )
    os.chmod(key, 0o600)
    procs: list[subprocess.Popen] = []
    slurm = Slurm(work, conf, node)
    try:
        procs.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={work / 'munge.sock'}",
                    f"--key-file={key}",
                    f"--log-file={work / 'munged.log'}",
                    f"--pid-file={work / 'munged.pid'}",
                    f"--seed-file={work / 'munged.seed'}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
        _wait_for("munged did not open its socket", (work / "munge.sock").exists, START_TIMEOUT_S)
        env = slurm.env(dict(os.environ))
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))  # fmt: skip
        procs.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))  # fmt: skip

        def idle() -> bool:
            if any(p.poll() is not None for p in procs):
                raise SlurmUnavailable(
                    "a SLURM daemon exited at start: "
                    + " | ".join((work / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log")
                                 if (work / f).exists())
                )  # fmt: skip
            out = slurm.run("sinfo", "-h", "-o", "%t").stdout.split()
            return out == ["idle"]

        _wait_for("the SLURM node did not come up idle", idle, START_TIMEOUT_S, work / "slurmd.log")
        yield slurm
    finally:
        try:
            if procs and procs[-1].poll() is None:
                slurm.run("scancel", "--full", "--user", "root")
                _wait_for("jobs did not end after scancel", lambda: not slurm.jobs(), 120)
        except (SlurmUnavailable, subprocess.SubprocessError, OSError):
            pass
        for p in reversed(procs):  # slurmd, slurmctld, munged: each by the id we started it with
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=30)

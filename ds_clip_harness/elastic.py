"""Two torchrun elastic agents on this machine as two hosts; one host dies mid-run, the other finishes alone.

    run = two_hosts_one_dies(train_args, kill_at_step=5, env=env, cwd=root, timeout_s=600)
    run.survivor.returncode, run.survivor.text            # the surviving agent: 0, its ranks' log lines
    run.restart_timeline()                                 # seconds from the kill to each restart milestone

Each agent is `torchrun --nnodes 1:2 --nproc_per_node 2 --max-restarts 3 --rdzv-backend c10d` on one
127.0.0.1 endpoint. Host A hosts the rendezvous store (``is_host=true``), host B joins it; B is the one that
dies, because torchrun's c10d store lives in the agent that hosts it (a lost store host ends the job: docs/
global-batch.md). The kill is SIGKILL to B's agent and every process under it, taken from the process tree
before the first signal: torchrun starts each rank in its own session, so a process-group kill would leave
B's ranks running. The moment of the kill is read from the ranks' own log lines ("step S/T"), by threads that
read each agent's output as it comes; nothing sleeps or polls a clock.

The tests assert on what the survivor trains; the benchmark (benchmarks/elastic_restart.py) reports the
timeline. Both run exactly this.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

STEP_LINE = re.compile(r"^step (\d+)/\d+ \|")
RESUMED_LINE = re.compile(r"resumed from .* at step (\d+)")


@dataclass
class Agent:
    """One torchrun agent (a "host"): its process and its output lines, each with the monotonic time it came."""

    name: str
    proc: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)
    returncode: int | None = None

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


@dataclass
class ElasticRun:
    survivor: Agent
    killed: Agent
    kill_time: float
    """time.monotonic() when B's processes were SIGKILLed."""
    step_at_kill: int
    """The newest step a rank had logged when the kill was sent."""

    def restart_timeline(self) -> dict[str, float | int | None]:
        """Seconds from the kill to: the survivors' 'lost contact' error, their agent reporting the failed workers,
        the restarted workers' first log line (after the new rendezvous and the process start), the resume line
        (model, engine, checkpoint conversion and load), the first step trained after the restart, the step the
        run had reached at the kill trained again; and the step resumed from."""
        after = [(t - self.kill_time, line) for t, line in self.survivor.lines if t >= self.kill_time]

        def first(pattern: re.Pattern | str, cond=lambda m: True) -> tuple[float | None, re.Match | None]:
            for dt, line in after:
                m = re.search(pattern, line)
                if m and cond(m):
                    return dt, m
            return None, None

        lost, _ = first("lost contact with another rank")
        agent, _ = first(r"failed \(exitcode")  # torchrun's agent saw its workers fail
        workers, _ = first(
            r"INFO ds_clip: --precision", lambda m: agent is not None
        )  # the new workers' first line
        resumed, m = first(RESUMED_LINE)
        resumed_step = int(m.group(1)) if m else None
        tail = [(dt, line) for dt, line in after if resumed is not None and dt >= resumed]
        first_step = next((dt for dt, line in tail if STEP_LINE.search(line)), None)
        caught_up = next(
            (
                dt
                for dt, line in tail
                if (s := STEP_LINE.search(line)) and int(s.group(1)) >= self.step_at_kill
            ),
            None,
        )
        return {
            "lost_contact_s": lost,
            "agent_saw_failure_s": agent,
            "new_workers_up_s": workers,
            "resumed_s": resumed,
            "first_step_s": first_step,
            "caught_up_s": caught_up,
            "resumed_from_step": resumed_step,
            "step_at_kill": self.step_at_kill,
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(
    train_args: list[str], *, port: int, is_host: bool, nproc: int = 2, max_restarts: int = 3
) -> list[str]:
    """torchrun as one elastic host of a 1-2 host job on 127.0.0.1:port. "--" ends torchrun's own options: its
    parser would read trainer flags as abbreviations of its own (--logs as --logs-specs)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1:2", "--nproc_per_node", str(nproc), "--max-restarts", str(max_restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ds_clip_elastic",
        "--rdzv-conf", f"is_host={'true' if is_host else 'false'}",
        "--no-python", "--", sys.executable, "-m", "ds_clip.train", *train_args,
    ]  # fmt: skip


def _read(
    agent: Agent, seen_step: list[int], trigger: threading.Event, kill_at_step: int, log: Path | None
) -> None:
    assert agent.proc.stdout is not None
    sink = log.open("w") if log is not None else None
    for raw in agent.proc.stdout:
        line = raw.rstrip("\n")
        agent.lines.append((time.monotonic(), line))
        if sink is not None:  # as it comes: a run that hangs can be read while it hangs
            sink.write(f"{time.monotonic():.3f} {line}\n")
            sink.flush()
        m = STEP_LINE.search(line)
        if m:
            seen_step[0] = max(seen_step[0], int(m.group(1)))
            if seen_step[0] >= kill_at_step:
                trigger.set()


def _tree(pid: int) -> list[int]:
    """pid and every process under it (psutil: a DeepSpeed dependency)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    """SIGKILL a host: the agent and all its descendants, listed before the first signal."""
    for p in _tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def two_hosts_one_dies(
    train_args: list[str],
    *,
    kill_at_step: int,
    env: dict[str, str],
    cwd: Path,
    timeout_s: float,
    log_dir: Path | None = None,
) -> ElasticRun:
    """Start host A (store host) and host B, SIGKILL B once a rank has logged step ``kill_at_step``, wait for
    A. Both agents are always ended (killed on a timeout) before this returns. ``log_dir``: each agent's
    output also goes to <log_dir>/host_<A|B>.log, line by line with its monotonic time."""
    port = free_port()
    agents: list[Agent] = []
    seen_step, trigger, threads = [0], threading.Event(), []
    try:
        for name, is_host in (("A", True), ("B", False)):
            proc = subprocess.Popen(
                agent_command(train_args, port=port, is_host=is_host),
                cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            )  # fmt: skip
            agent = Agent(name, proc)
            agents.append(agent)
            log = None if log_dir is None else log_dir / f"host_{name}.log"
            t = threading.Thread(
                target=_read, args=(agent, seen_step, trigger, kill_at_step, log), daemon=True
            )
            t.start()
            threads.append(t)
        a, b = agents
        if not trigger.wait(timeout_s):
            raise TimeoutError(
                f"no rank logged step {kill_at_step} within {timeout_s:.0f} s:\n{a.text[-3000:]}"
            )
        step_at_kill = seen_step[0]
        kill_time = time.monotonic()
        kill_tree(b.proc.pid)
        b.returncode = b.proc.wait(timeout=60)
        a.returncode = a.proc.wait(timeout=timeout_s)
        for t in threads:
            t.join(timeout=30)
        return ElasticRun(survivor=a, killed=b, kill_time=kill_time, step_at_kill=step_at_kill)
    finally:
        for agent in agents:
            if agent.proc.poll() is None:
                kill_tree(agent.proc.pid)
                agent.proc.wait()


def one_host_then_two(
    train_args: list[str],
    *,
    join_at_step: int,
    env: dict[str, str],
    cwd: Path,
    timeout_s: float,
    log_dir: Path | None = None,
) -> tuple[Agent, Agent]:
    """Start host A alone; once a rank has logged step ``join_at_step``, start host B, which joins the running
    job: both agents restart their workers into the larger world. Returns (A, B) after both have ended (killed
    on a timeout). The agents run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch 2.14's agent, sharing its
    store with the workers, does not publish the store's address to a new round and the larger world never
    forms (docs/global-batch.md)."""
    port = free_port()
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents: list[Agent] = []
    threads = []

    def start(name: str, is_host: bool, seen: list[int], trigger: threading.Event, at: int) -> Agent:
        proc = subprocess.Popen(
            agent_command(train_args, port=port, is_host=is_host),
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        agent = Agent(name, proc)
        agents.append(agent)
        log = None if log_dir is None else log_dir / f"host_{name}.log"
        t = threading.Thread(target=_read, args=(agent, seen, trigger, at, log), daemon=True)
        t.start()
        threads.append(t)
        return agent

    try:
        trigger = threading.Event()
        a = start("A", True, [0], trigger, join_at_step)
        if not trigger.wait(timeout_s):
            raise TimeoutError(
                f"no rank logged step {join_at_step} within {timeout_s:.0f} s:\n{a.text[-3000:]}"
            )
        b = start("B", False, [0], threading.Event(), 1 << 62)
        a.returncode = a.proc.wait(timeout=timeout_s)
        b.returncode = b.proc.wait(timeout=timeout_s)
        for t in threads:
            t.join(timeout=30)
        return a, b
    finally:
        for agent in agents:
            if agent.proc.poll() is None:
                kill_tree(agent.proc.pid)
                agent.proc.wait()


__all__ = [
    "Agent",
    "ElasticRun",
    "agent_command",
    "free_port",
    "kill_tree",
    "one_host_then_two",
    "two_hosts_one_dies",
]

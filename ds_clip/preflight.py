"""Pre-flight check before the process group starts: can every rank reach the master address?

    deepspeed --hostfile hostfile --module ds_clip.preflight       # check a cluster, train nothing
    mpirun -np 16 --hostfile hostfile ... python -m ds_clip.preflight
    # the trainer runs the same check inside init_distributed (ds_clip.distributed)

Why: torch's rendezvous retries a master it cannot reach for the whole process-group timeout (30 min in
ds_clip), and the ranks that did start wait just as long for the ones that did not: a wrong
`--master_addr`, a firewall, or a hostfile host that was never started looks like a hang. Here every
rank other than 0 connects to MASTER_ADDR:MASTER_PORT, where rank 0 listens for a bounded time
(`DS_CLIP_PREFLIGHT_TIMEOUT_S`, default 300 s), and says hello with its rank and hostname. Either all
ranks check in and rank 0 answers OK (then closes the port, which torch's store takes next), or every
rank that can tell fails with a message naming the host: the rank that cannot reach the master names its
own host and the address it tried; rank 0 names the ranks that never arrived and the hosts that did.

Skipped (returns None) for a world of one, under torchrun (its agent already holds MASTER_PORT and has
done the rendezvous) and with DS_CLIP_PREFLIGHT=0. Under mpirun, rank/size/master come from MPI first
(DeepSpeed's discovery, but a MASTER_ADDR/MASTER_PORT passed with `-x` is kept instead of rank 0's
first `hostname -I` address). Standard library only, apart from that MPI path.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from ds_clip.errors import RunError

MAGIC = "DSCLIP-PREFLIGHT"
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "DS_CLIP_PREFLIGHT_TIMEOUT_S"
ENABLE_ENV = "DS_CLIP_PREFLIGHT"
# DeepSpeed's default port (TORCH_DISTRIBUTED_DEFAULT_PORT), used by its MPI discovery.
MPI_DEFAULT_PORT = 29500
RETRY_PAUSE_S = 0.25
# After OK, how long rank 0 waits for workers to hang up (the workers close first, so the TIME_WAIT
# state stays on their side and rank 0 can bind MASTER_PORT again for torch's store at once).
HANGUP_WAIT_S = 10.0


class PreflightError(RunError):
    """A rank cannot reach the master, or the master did not hear from every rank in time."""


@dataclass(frozen=True)
class Rendezvous:
    """Where this rank stands and whom it must meet (from the launcher's environment)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    hostname: str = field(default_factory=socket.gethostname)

    @property
    def master(self) -> str:
        addr = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{addr}:{self.master_port}"


@dataclass(frozen=True)
class PreflightReport:
    master: str
    ranks_by_host: dict[str, list[int]]

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.ranks_by_host.values())

    def describe(self) -> str:
        """'4 ranks on 2 hosts reached the master 10.0.0.1:29500: node1 (ranks 0, 1), node2 (ranks 2, 3)'"""
        hosts = ", ".join(f"{h} ({_ranks(r)})" for h, r in self.ranks_by_host.items())
        return f"{self.world_size} ranks on {len(self.ranks_by_host)} host(s) reached the master {self.master}: {hosts}"


def _ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0, 1'"""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(ranks))


def timeout_from_env(env: MutableMapping[str, str] = os.environ) -> float:
    raw = env.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise PreflightError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise PreflightError(f"{TIMEOUT_ENV}={raw!r} must be positive")
    return value


def rendezvous_from_env(env: MutableMapping[str, str] = os.environ) -> Rendezvous | None:
    """This rank's rendezvous, or None where there is nothing to check. Fills RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR and MASTER_PORT from MPI when started by mpirun without them."""
    if env.get(ENABLE_ENV, "1") == "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    if env is os.environ and "RANK" not in env and ("OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env):
        _mpi_to_env()
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in env for k in needed) or int(env["WORLD_SIZE"]) <= 1:
        return None
    return Rendezvous(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]))


def _mpi_to_env() -> None:
    # DeepSpeed's discovery overwrites MASTER_ADDR with rank 0's first `hostname -I` address, which on a
    # host with several interfaces (docker0, a management net) can be one the others cannot reach. Keep
    # what the user passed with `mpirun -x MASTER_ADDR=... -x MASTER_PORT=...`.
    from deepspeed.comm.comm import mpi_discovery

    user = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    mpi_discovery(distributed_port=int(user.get("MASTER_PORT", MPI_DEFAULT_PORT)), verbose=False)
    os.environ.update(user)


def check_rendezvous(
    rdv: Rendezvous | None = None, timeout_s: float | None = None, env: MutableMapping[str, str] = os.environ
) -> PreflightReport | None:
    """Meet every rank at the master address within `timeout_s`, or raise PreflightError naming the host.

    Call it on every rank before `deepspeed.init_distributed` / `init_process_group`. Rank 0 returns the
    full report; the other ranks return it too (rank 0 sends it with the OK)."""
    rdv = rdv if rdv is not None else rendezvous_from_env(env)
    if rdv is None:
        return None
    timeout_s = timeout_s if timeout_s is not None else timeout_from_env(env)
    deadline = time.monotonic() + timeout_s
    if rdv.rank == 0:
        return _serve(rdv, deadline, timeout_s)
    return _join(rdv, deadline, timeout_s)


def _serve(rdv: Rendezvous, deadline: float, timeout_s: float) -> PreflightReport:
    # Bind every interface, as torch's TCPStore does: the question is whether the others can reach
    # MASTER_ADDR, and rank 0 is where they are told to go.
    try:
        listener = _listen(rdv.master_port, rdv.world_size)
    except OSError as err:
        raise PreflightError(
            f"rank 0 on host {rdv.hostname} cannot listen on port {rdv.master_port} "
            f"({os.strerror(err.errno) if err.errno else err}): "
            "another job may hold it; pick a free one with --master_port / MASTER_PORT"
        ) from None
    peers: dict[int, tuple[socket.socket, str]] = {}
    by_host: dict[str, list[int]] = {rdv.hostname: [0]}
    try:
        while len(peers) < rdv.world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            listener.settimeout(left)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                break
            # A stray client that never speaks must not hold up the others for long.
            hello = _read_line(conn, min(deadline, time.monotonic() + 10.0))
            parts = hello.split() if hello else []
            if len(parts) != 4 or parts[0] != MAGIC or not (parts[1].isdigit() and parts[2].isdigit()):
                conn.close()  # not one of ours (a port scan, a stray torch client): ignore it
                continue
            rank, world, host = int(parts[1]), int(parts[2]), parts[3]
            if world != rdv.world_size or not 0 < rank < rdv.world_size or rank in peers:
                why = (
                    f"world size {world} differs from rank 0's {rdv.world_size}"
                    if world != rdv.world_size
                    else f"rank {rank} is out of range or came twice"
                )
                _send(conn, f"FAIL rank 0 on host {rdv.hostname} refused rank {rank} from host {host}: {why}")
                conn.close()
                raise PreflightError(f"rank 0 on host {rdv.hostname}: rank {rank} from host {host}: {why}")
            peers[rank] = (conn, host)
            by_host.setdefault(host, []).append(rank)
        if len(peers) < rdv.world_size - 1:
            missing = [r for r in range(1, rdv.world_size) if r not in peers]
            seen = ", ".join(f"{h} ({_ranks(r)})" for h, r in by_host.items())
            msg = (
                f"rank 0 on host {rdv.hostname}: {len(missing)} of {rdv.world_size} ranks did not reach the "
                f"master {rdv.master} within {timeout_s:.0f} s: {_ranks(missing)}. Checked in: {seen}. "
                "Their host was not started (unreachable by ssh?) or cannot reach this address and port "
                "(wrong --master_addr, firewall); their own error names the host"
            )
            for conn, _ in peers.values():
                _send(conn, f"FAIL {msg}")
            raise PreflightError(msg)
        report = PreflightReport(rdv.master, {h: sorted(r) for h, r in by_host.items()})
        encoded = ";".join(f"{h}={','.join(map(str, r))}" for h, r in report.ranks_by_host.items())
        for conn, _ in peers.values():
            _send(conn, f"OK {encoded}")
        hangup = time.monotonic() + HANGUP_WAIT_S
        for conn, _ in peers.values():
            _read_line(conn, hangup)  # returns at EOF: the worker hung up first
        return report
    finally:
        for conn, _ in peers.values():
            conn.close()
        listener.close()


def _listen(port: int, world_size: int) -> socket.socket:
    # IPv4 and IPv6 on one socket where the host allows it (MASTER_ADDR may be either); SO_REUSEADDR is
    # set by create_server, as torch sets it on its store, so the port is free again right after.
    backlog = min(world_size, 4096)
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(
                ("", port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=True
            )
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise
    return socket.create_server(("", port), family=socket.AF_INET, backlog=backlog)


def _join(rdv: Rendezvous, deadline: float, timeout_s: float) -> PreflightReport:
    last_err = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PreflightError(
                f"rank {rdv.rank} on host {rdv.hostname} cannot reach the master {rdv.master} within "
                f"{timeout_s:.0f} s (last error: {last_err}). MASTER_ADDR must be an address of the first "
                "host (where rank 0 runs) that every host can reach: set --master_addr (deepspeed), "
                "-x MASTER_ADDR=... (mpirun), and open the port in the firewall"
            )
        try:
            conn = socket.create_connection((rdv.master_addr, rdv.master_port), timeout=min(left, 5.0))
        except socket.gaierror as err:
            raise PreflightError(
                f"rank {rdv.rank} on host {rdv.hostname} cannot resolve the master address "
                f"{rdv.master_addr!r} ({err.strerror}): use an IP address or a name every host resolves"
            ) from None
        except OSError as err:
            # Refused (rank 0 not listening yet, or the wrong host), unreachable, timed out: retry.
            last_err = err.strerror or type(err).__name__
            time.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
            continue
        with conn:
            _send(conn, f"{MAGIC} {rdv.rank} {rdv.world_size} {rdv.hostname}")
            # Rank 0 is up and answers by its own deadline, which can lie after ours (it may have started
            # later): wait one full timeout from now, plus a little, for its verdict.
            reply = _read_line(conn, time.monotonic() + timeout_s + 5.0)
        if reply is None:
            raise PreflightError(
                f"rank {rdv.rank} on host {rdv.hostname}: the master {rdv.master} accepted the connection "
                f"but gave no answer within {timeout_s:.0f} s (is something else listening on that port?)"
            )
        if reply.startswith("OK "):
            return _decode_report(rdv.master, reply[3:])
        raise PreflightError(reply.removeprefix("FAIL "))


def _decode_report(master: str, encoded: str) -> PreflightReport:
    by_host: dict[str, list[int]] = {}
    for item in encoded.split(";"):
        host, ranks = item.rsplit("=", 1)
        by_host[host] = [int(r) for r in ranks.split(",")]
    return PreflightReport(master, by_host)


def _send(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall((line.replace("\n", " ") + "\n").encode())
    except OSError:
        pass  # the peer is gone; its own error (or the missing-rank report) says why


def _read_line(conn: socket.socket, deadline: float, limit: int = 65536) -> str | None:
    """One line from `conn` by `deadline`; None on EOF before a newline, a timeout or an error."""
    buf = b""
    while b"\n" not in buf and len(buf) < limit:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    line, _, _ = buf.partition(b"\n")
    return line.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ds_clip.preflight",
        description="Check that every rank reaches the master address (run under deepspeed/mpirun/srun).",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help=f"seconds (default: ${TIMEOUT_ENV} or 300)"
    )
    args, _ = parser.parse_known_args(argv)  # the deepspeed launcher appends --local_rank=N
    try:
        report = check_rendezvous(timeout_s=args.timeout)
    except PreflightError as err:
        print(f"ds_clip.preflight: error: {err}", file=sys.stderr, flush=True)
        return 1
    if report is None:
        print("ds_clip.preflight: nothing to check (a world of one, torchrun, or DS_CLIP_PREFLIGHT=0)")
    elif os.environ.get("RANK") == "0":
        print(f"ds_clip.preflight: {report.describe()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

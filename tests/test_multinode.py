"""Multi-node for real: two hosts (network namespaces with their own sshd, tests/netns_hosts.py), a
hostfile naming both, and the real launchers across them; plus the pre-flight check that turns an
unreachable host or master address into an error naming the host instead of a hang.

The two-host tests need root and network namespaces (skipped with the reason where the machine forbids
them), openssh-server, pdsh and, for the mpirun test, Open MPI: scripts/setup.sh installs them (as root).
All their traffic stays on the namespaces' own addresses (10.213.7.0/24 and each namespace's loopback).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds_clip import preflight
from ds_clip.preflight import (
    PreflightError,
    PreflightReport,
    Rendezvous,
    check_rendezvous,
    rendezvous_from_env,
    timeout_from_env,
)
from ds_clip_harness.models import E2E_MODEL
from tests.netns_hosts import (
    SUBNET,
    NamespacesForbidden,
    TwoHosts,
    missing_tools,
    probe_namespaces,
    two_hosts,
)

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

M, K, STEPS, SLOTS = 4, 2, 3, 2
W = 2 * SLOTS
# Short enough that a failure test ends in seconds, long enough for 4 ranks to start on 2 busy cores.
FAIL_TIMEOUT_S = 4
RUN_TIMEOUT_S = 240


# --------------------------------------------------------------------------- pre-flight, in one process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _meet(ranks: list[Rendezvous], timeout_s: float) -> dict[int, PreflightReport | PreflightError]:
    """Run check_rendezvous for each rank in its own thread; collect each one's report or error."""
    out: dict[int, PreflightReport | PreflightError] = {}

    def one(r: Rendezvous) -> None:
        try:
            out[r.rank] = check_rendezvous(r, timeout_s=timeout_s)
        except PreflightError as err:
            out[r.rank] = err

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 30)
    return out


def test_preflight_all_ranks_meet_and_learn_the_hosts():
    """Every rank checks in at the master; all of them get the same rank-per-host report."""
    port = _free_port()
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    out = _meet([Rendezvous(r, 4, "127.0.0.1", port, hostname=h) for r, h in enumerate(hosts)], 20)
    assert all(isinstance(v, PreflightReport) for v in out.values()), out
    assert {r: v.ranks_by_host for r, v in out.items()} == {
        r: {"node-a": [0, 1], "node-b": [2, 3]} for r in range(4)
    }
    assert out[0].describe() == (
        f"4 ranks on 2 host(s) reached the master 127.0.0.1:{port}: node-a (ranks 0, 1), node-b (ranks 2, 3)"
    )
    # Rank 0 let go of the port: torch's store binds it next.
    with socket.socket() as s:
        s.bind(("", port))


def test_preflight_rank_that_cannot_reach_master_names_its_host():
    """Nobody listens at the master address: the rank fails within its timeout, naming its host and
    the address it tried, instead of retrying for the process group's 30 minutes."""
    port = _free_port()
    err = _meet([Rendezvous(2, 4, "127.0.0.1", port, hostname="node-b")], 0.5)[2]
    assert isinstance(err, PreflightError)
    assert f"rank 2 on host node-b cannot reach the master 127.0.0.1:{port}" in str(err)
    assert "--master_addr" in str(err)


def test_preflight_master_names_missing_ranks_and_tells_the_others():
    """Rank 3 never comes: rank 0 names it and the hosts that did check in; rank 1 hears the same."""
    port = _free_port()
    ranks = [Rendezvous(r, 4, "127.0.0.1", port, hostname=h) for r, h in ((0, "n1"), (1, "n1"), (2, "n2"))]
    out = _meet(ranks, 1.5)
    assert all(isinstance(v, PreflightError) for v in out.values()), out
    msg = str(out[0])
    assert "rank 0 on host n1" in msg and ": rank 3. Checked in: n1 (ranks 0, 1), n2 (rank 2)." in msg
    assert str(out[1]) == msg


def test_preflight_refuses_a_different_world_size():
    port = _free_port()
    out = _meet(
        [Rendezvous(0, 2, "127.0.0.1", port, hostname="n1"), Rendezvous(1, 3, "127.0.0.1", port, "n2")], 10
    )
    assert "world size 3 differs from rank 0's 2" in str(out[0])
    assert "from host n2" in str(out[1])


def test_preflight_taken_port_and_stray_clients(monkeypatch):
    """MASTER_PORT held by another program: rank 0 says so. A client that is not a rank (a port scan)
    is dropped, and the real ranks still meet."""
    port = _free_port()
    with socket.create_server(("127.0.0.1", port)):
        err = _meet([Rendezvous(0, 2, "127.0.0.1", port, hostname="n1")], 5)[0]
    assert f"rank 0 on host n1 cannot listen on port {port} (Address already in use)" in str(err)
    assert "--master_port" in str(err)

    listening = threading.Event()
    real_listen = preflight._listen

    def listen_and_tell(*args):
        sock = real_listen(*args)
        listening.set()
        return sock

    monkeypatch.setattr(preflight, "_listen", listen_and_tell)
    out: dict = {}
    master = threading.Thread(
        target=lambda: out.update(_meet([Rendezvous(0, 2, "127.0.0.1", port, "n1")], 20))
    )
    master.start()
    assert listening.wait(20)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as stray:
        stray.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert stray.recv(100) == b""  # rank 0 read it, saw it is no rank, and hung up
    out.update(_meet([Rendezvous(1, 2, "127.0.0.1", port, hostname="n2")], 20))
    master.join()
    assert out[0].ranks_by_host == out[1].ranks_by_host == {"n1": [0], "n2": [1]}, out


def test_preflight_unresolvable_master_is_named():
    err = _meet([Rendezvous(1, 2, "no-such-host.invalid", 29500, hostname="n2")], 5)[1]
    assert "cannot resolve the master address 'no-such-host.invalid'" in str(err)


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1", "DS_CLIP_PREFLIGHT": "0"},
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "a",
            "MASTER_PORT": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        },
        {},
    ],
    ids=["world-of-one", "disabled", "torchrun", "no-launcher"],
)
def test_preflight_skips_where_there_is_nothing_to_check(env):
    assert rendezvous_from_env(env) is None
    assert check_rendezvous(env=env) is None


def test_preflight_timeout_from_env():
    assert timeout_from_env({}) == 300.0
    assert timeout_from_env({"DS_CLIP_PREFLIGHT_TIMEOUT_S": "12.5"}) == 12.5
    for bad in ("soon", "0", "-1"):
        with pytest.raises(PreflightError, match="DS_CLIP_PREFLIGHT_TIMEOUT_S"):
            timeout_from_env({"DS_CLIP_PREFLIGHT_TIMEOUT_S": bad})


def test_check_hosts_refuses_a_missing_or_empty_hostfile(tmp_path):
    proc = subprocess.run(
        ["bash", "scripts/check_hosts.sh", str(tmp_path / "nope")], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and f"no hostfile at {tmp_path / 'nope'}" in proc.stderr
    (tmp_path / "hf").write_text("# only a comment\n\n")
    proc = subprocess.run(
        ["bash", "scripts/check_hosts.sh", str(tmp_path / "hf")], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "names no host" in proc.stderr


# --------------------------------------------------------------------------- two hosts


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Iterator[TwoHosts]:
    try:
        probe_namespaces()
    except NamespacesForbidden as err:
        pytest.skip(f"two-host tests need network namespaces: {err}")
    missing = missing_tools()
    if missing:
        pytest.fail(
            f"two-host tests need {', '.join(missing)}: run scripts/setup.sh as root (apt installs them)"
        )
    with two_hosts(tmp_path_factory.mktemp("hosts")) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("mn_model")
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{d}"


def _env(net: TwoHosts, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{net.bin_dir}{os.pathsep}{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=net.ifname)
    # An absolute DS_ENV_FILE replaces ~/.deepspeed_env and ./.deepspeed_env: the user's files stay out.
    env_file = tmp_path / "deepspeed_env"
    env_file.write_text("".join(f"{k}={env[k]}\n" for k in ("PATH", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")))
    env["DS_ENV_FILE"] = str(env_file)
    env.update(extra)
    return env


def _on_first_host(net: TwoHosts, cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    # The launch happens on the first host, as on a cluster; ranks reach both hosts by ssh from there.
    return subprocess.run(
        net.on(net.hosts[0], cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def _train_args(model: str, logs: Path, name: str) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--accum-freq", str(K), "--max-steps", str(STEPS),
        "--log-every-n-steps", "1", "--logs", str(logs), "--name", name, "--workers", "0",
        "--report-to", "csv", "--warmup", "1",
    ]  # fmt: skip


def _check_training(proc: subprocess.CompletedProcess, run_dir: Path, line_prefix: str) -> None:
    out = proc.stdout + proc.stderr
    pattern = rf"^{line_prefix}step \d+/\d+ \| epoch \d+ \| samples (\d+)"
    seen = [int(x) for x in re.findall(pattern, proc.stdout, re.M)]
    assert seen == [s * K * M * W for s in range(1, STEPS + 1)], out[-4000:]
    assert f"INFO ds_clip: world size {W}, micro-batch m={M}, accum-freq k={K}" in out, out[-4000:]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == M * W and ds["gradient_accumulation_steps"] == 1
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert int(rows[-1]["samples_seen"]) == STEPS * K * M * W


def test_namespaces_reach_only_their_own_addresses(net):
    """Each host holds only its loopback and the veth end, and routes only the test subnet."""
    for h in net.hosts:
        links = subprocess.run(["ip", "-n", h.netns, "-o", "link"], capture_output=True, text=True).stdout
        assert sorted(re.findall(r"^\d+: ([^:@]+)", links, re.M)) == sorted(["lo", net.ifname])
        routes = subprocess.run(
            ["ip", "-n", h.netns, "route"], capture_output=True, text=True
        ).stdout.splitlines()
        assert [r.split()[0] for r in routes] == [f"{SUBNET}.0/24"], routes


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_hostfile_trains_on_two_hosts(net, model_dir, tmp_path):
    """scripts/launch_multi_node.sh = `deepspeed --hostfile FILE --module ds_clip.train --accum-freq 2`
    (pdsh over ssh) with 2 ranks on each of 2 hosts: world size 4, ranks 2 and 3 started on the second
    host, k*m*W samples per step; PATH, GLOO_SOCKET_IFNAME and OMP_NUM_THREADS reach the remote ranks
    through the merged env file."""
    hostfile = net.hostfile(tmp_path / "hostfile", SLOTS)
    env = _env(net, tmp_path, HOSTFILE=str(hostfile), MASTER_PORT="29511")
    proc = _on_first_host(
        net, ["bash", "scripts/launch_multi_node.sh", *_train_args(model_dir, tmp_path, "ds")], env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "check_hosts.sh: all 2 hosts" in out
    assert "4 ranks on 2 host(s) reached the master" in out  # the trainer's own pre-flight
    # pdsh prefixes each line with the host that printed it: one launcher per host, 2 ranks each.
    assert re.search(r"^dsnode1: .*node_rank=0$", out, re.M) and re.search(
        r"^dsnode2: .*node_rank=1$", out, re.M
    )
    assert "'dsnode1': [0, 1], 'dsnode2': [2, 3]" in out
    assert re.search(r"^dsnode2: .*dist_world_size=4$", out, re.M)
    # The runner's pdsh command line carries the merged env file to every host.
    pdsh_cmd = next(line for line in out.splitlines() if "cmd = pdsh" in line)
    for export in (
        f"export GLOO_SOCKET_IFNAME={net.ifname};",
        "export OMP_NUM_THREADS=1;",
        f"export PATH={net.bin_dir}",
    ):
        assert export in pdsh_cmd, pdsh_cmd
    _check_training(proc, tmp_path / "ds", line_prefix="dsnode1: ")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="Open MPI is not installed (scripts/setup.sh installs it)"
)
def test_mpirun_trains_on_two_hosts(net, model_dir, tmp_path):
    """scripts/launch_mpirun.sh with HOSTFILE: `mpirun --hostfile FILE` starts 2 ranks on each host over
    ssh (Open MPI's map shows them), ds_clip reads ranks from MPI and trains with world size 4."""
    hostfile = net.hostfile(tmp_path / "hostfile", SLOTS)
    mpi_args = (
        "--allow-run-as-root --oversubscribe --display-map --mca plm_rsh_no_tree_spawn 1 "
        f"--mca oob_tcp_if_include {SUBNET}.0/24 --mca btl_tcp_if_include {SUBNET}.0/24"
    )
    env = _env(net, tmp_path, HOSTFILE=str(hostfile), MPI_ARGS=mpi_args, MASTER_PORT="29512")
    proc = _on_first_host(
        net, ["bash", "scripts/launch_mpirun.sh", *_train_args(model_dir, tmp_path, "mpi")], env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "check_hosts.sh: all 2 hosts" in out
    assert "4 ranks on 2 host(s) reached the master" in out  # the trainer's own pre-flight
    for host, ranks in (("dsnode1", (0, 1)), ("dsnode2", (2, 3))):
        block = re.search(rf"Data for node: {host}\s.*?Num procs: 2(.*?)(?:Data for node|====)", out, re.S)
        assert block and re.findall(r"Process rank: (\d+)", block.group(1)) == [str(r) for r in ranks], out[
            :3000
        ]
    _check_training(proc, tmp_path / "mpi", line_prefix="")


def _preflight_on_hosts(net: TwoHosts, tmp_path: Path, hostfile: Path, master_addr: str, port: int):
    env = _env(net, tmp_path)
    with open(env["DS_ENV_FILE"], "a") as f:
        f.write(f"DS_CLIP_PREFLIGHT_TIMEOUT_S={FAIL_TIMEOUT_S}\n")
    cmd = ["deepspeed", "--hostfile", str(hostfile), "--master_addr", master_addr, "--master_port", str(port),
           "--module", "ds_clip.preflight"]  # fmt: skip
    return _on_first_host(net, cmd, env)


@pytest.mark.e2e
@pytest.mark.distributed
def test_preflight_under_deepspeed_names_both_hosts(net, tmp_path):
    """`deepspeed --hostfile FILE --module ds_clip.preflight` checks a cluster without training."""
    proc = _preflight_on_hosts(net, tmp_path, net.hostfile(tmp_path / "hostfile", SLOTS), "dsnode1", 29513)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (
        "4 ranks on 2 host(s) reached the master dsnode1:29513: dsnode1 (ranks 0, 1), dsnode2 (ranks 2, 3)"
        in out
    )


@pytest.mark.e2e
@pytest.mark.distributed
def test_unreachable_host_is_named_before_launch(net, tmp_path):
    """A hostfile host nobody answers for: the launch script stops before starting anything and names
    it (scripts/check_hosts.sh, ssh with a timeout); the reachable host passes."""
    bad = net.unreachable[0]
    hostfile = net.hostfile(tmp_path / "hostfile", SLOTS, [net.hosts[0].name, bad])
    env = _env(net, tmp_path, HOSTFILE=str(hostfile), SSH_TIMEOUT="3")
    proc = _on_first_host(net, ["bash", "scripts/launch_multi_node.sh", "--max-steps", "1"], env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(rf"host {bad} \(from {re.escape(str(hostfile))}\) cannot be reached", proc.stderr), (
        proc.stderr
    )
    assert "dsnode1" not in proc.stderr
    assert "deepspeed" not in proc.stdout.lower()


@pytest.mark.e2e
@pytest.mark.distributed
def test_unreachable_host_under_plain_deepspeed_fails_instead_of_hanging(net, tmp_path):
    """Straight `deepspeed --hostfile` (DeepSpeed's runner only tests the first host): pdsh names the host
    it cannot reach, and rank 0 stops waiting after the pre-flight timeout, naming the missing ranks."""
    bad = net.unreachable[0]
    hostfile = net.hostfile(tmp_path / "hostfile", SLOTS, [net.hosts[0].name, bad])
    proc = _preflight_on_hosts(net, tmp_path, hostfile, "dsnode1", 29514)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert re.search(rf"{bad}: ssh: connect to host {bad} port 22", out), out[-4000:]
    assert "rank 0 on host dsnode1: 2 of 4 ranks did not reach the master dsnode1:29514" in out
    assert "ranks 2, 3. Checked in: dsnode1 (ranks 0, 1)" in out


@pytest.mark.e2e
@pytest.mark.distributed
def test_rank_that_cannot_reach_master_names_its_host(net, tmp_path):
    """--master_addr 127.0.0.1 on two hosts: the second host's ranks try their own loopback; each names
    its host and the address, within the pre-flight timeout, and rank 0 names them as missing."""
    proc = _preflight_on_hosts(net, tmp_path, net.hostfile(tmp_path / "hostfile", SLOTS), "127.0.0.1", 29515)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    for rank in (2, 3):
        assert (
            f"rank {rank} on host dsnode2 cannot reach the master 127.0.0.1:29515 within {FAIL_TIMEOUT_S} s"
            in out
        )
    assert "rank 0 on host dsnode1: 2 of 4 ranks did not reach the master 127.0.0.1:29515" in out


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.distributed
def test_a_node_local_logs_folder_is_refused_before_step_1(net, model_dir, tmp_path):
    """One rank per host, started on each (RANK/WORLD_SIZE/MASTER_ADDR, as a scheduler sets them), the same
    --logs path on both; on the second host that path is a folder of its own (a bind mount in the rank's mount
    namespace: a node-local disk). Rank 0 writes a token into the run folder, the second node's first rank does
    not find it: every rank stops with exit 2 before the model is built, one line naming the node and the fix."""
    logs, own_disk = tmp_path / "logs", tmp_path / "dsnode2-disk"
    logs.mkdir()
    own_disk.mkdir()
    args = [sys.executable, "-m", "ds_clip.train", *_train_args(model_dir, logs, "local")]
    port = str(_free_port())
    procs = []
    for rank, host in enumerate(net.hosts):
        env = _env(net, tmp_path, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=net.hosts[0].addr,
                   MASTER_PORT=port)  # fmt: skip
        cmd = args
        if rank == 1:  # this node's --logs: its own folder at the same path
            bind = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, "sh", str(own_disk),
                   str(logs), *args]  # fmt: skip
        procs.append(
            subprocess.Popen(
                net.on(host, cmd),
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        )
    outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2, out[-3000:] + err[-3000:]
        assert "step 1/" not in out
    err0 = outs[0][1].strip().splitlines()
    line = next(x for x in err0 if x.startswith("ds-clip-train: error:"))
    assert (
        f"--logs {logs}: rank 1 on {net.hosts[1].name} does not see the run folder {logs / 'local'}" in line
    )
    assert "a file system all nodes share" in line and "--remote-sync" in line
    assert not (logs / "local" / "checkpoints").exists() and not list(own_disk.iterdir())

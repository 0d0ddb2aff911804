"""Two "hosts" on one machine for multi-node tests: network namespaces joined by a veth pair, each with
its own hostname, /etc/hosts and an sshd that accepts a key made for the test.

    with two_hosts(tmp_path) as net:        # or the `two_hosts` fixture in tests/test_multinode.py
        subprocess.run(net.on(net.hosts[0], ["deepspeed", "--hostfile", str(hf), ...]), env=net.env(...))

What it builds (all of it removed again on exit, also when the body raises):
  - namespaces  dsc<pid>a, dsc<pid>b       (`ip netns add`)
  - one veth pair, named `dsc0` on both ends (a cluster's "eth0": one GLOO_SOCKET_IFNAME fits every host),
    addresses 10.213.7.1/24 and 10.213.7.2/24; the loopback of each namespace is up;
  - /etc/netns/<ns>/{hosts,resolv.conf}: `ip netns exec` binds them over /etc/hosts and /etc/resolv.conf
    inside the namespace, so the names resolve without DNS and no lookup leaves the namespace;
  - an sshd per namespace (Debian's openssh-server, run in the foreground from our own config, listening
    only on that host's address), started in a UTS namespace whose hostname is the host's name, so every
    process started through it (pdsh, Open MPI's orted, the ranks) reports that hostname;
  - in `workdir`: the client key, the host key, authorized_keys, known_hosts, an ssh_config, and
    bin/ssh, a wrapper that adds `-F ssh_config`: put bin/ first on PATH and every ssh that DeepSpeed's
    runner, pdsh and mpirun start uses the test key without touching ~/.ssh.
Traffic: the namespaces hold only `lo` and the veth ends, so nothing started inside them can reach any
address but 127.0.0.1 and the two 10.213.7.x addresses. The name `UNREACHABLE` (10.213.7.3) is in the
hosts files with no machine behind it, for the failure tests.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.7"
IFNAME = "dsc0"
UNREACHABLE = ("dsnode3", f"{SUBNET}.3")
SSHD_START_TIMEOUT_S = 20.0
# Debian's sshd refuses to start without its privilege-separation directory.
PRIVSEP_DIR = Path("/run/sshd")


class NamespacesForbidden(RuntimeError):
    """This machine (or this user) may not create network namespaces: the test is skipped."""


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    addr: str


@dataclass
class TwoHosts:
    hosts: tuple[Host, Host]
    workdir: Path
    ifname: str = IFNAME
    unreachable: tuple[str, str] = UNREACHABLE
    _sshd: list[subprocess.Popen] = field(default_factory=list)
    _drains: list[threading.Thread] = field(default_factory=list)

    @property
    def bin_dir(self) -> Path:
        return self.workdir / "bin"

    def on(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` as run on `host`: inside its network namespace (and its /etc/hosts), with its hostname."""
        return on_host(host, argv)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with the ssh wrapper first on PATH (DeepSpeed's runner, pdsh and mpirun call `ssh`)."""
        env = dict(base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def hostfile(self, path: Path, slots: int, names: list[str] | None = None) -> Path:
        names = names if names is not None else [h.name for h in self.hosts]
        path.write_text("".join(f"{n} slots={slots}\n" for n in names))
        return path


def on_host(host: Host, argv: list[str]) -> list[str]:
    # `ip netns exec` gives a fresh mount namespace with /etc/netns/<ns>/* bound over /etc; a UTS
    # namespace of its own gives the hostname. Python does the sethostname + exec (no `hostname` binary).
    set_name = "import os,socket,sys; socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])"
    return [
        "ip",
        "netns",
        "exec",
        host.netns,
        "unshare",
        "--uts",
        sys.executable,
        "-c",
        set_name,
        host.name,
        *argv,
    ]


def _sh(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


def _must(*argv: str) -> None:
    proc = _sh(*argv)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")


def probe_namespaces() -> None:
    """Raise NamespacesForbidden (with the reason) unless we may create a netns, a veth and a UTS ns."""
    if os.geteuid() != 0:
        raise NamespacesForbidden(
            f"network namespaces need root (ip netns add); running as uid {os.geteuid()}"
        )
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise NamespacesForbidden("`ip` (iproute2) or `unshare` (util-linux) is missing")
    probe = f"dscprobe{os.getpid()}"
    proc = _sh("ip", "netns", "add", probe)
    if proc.returncode != 0:
        raise NamespacesForbidden(f"`ip netns add` is not permitted here: {proc.stderr.strip()}")
    try:
        proc = _sh("ip", "netns", "exec", probe, "unshare", "--uts", "true")
        if proc.returncode != 0:
            raise NamespacesForbidden(f"`unshare --uts` is not permitted here: {proc.stderr.strip()}")
        proc = _sh("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        if proc.returncode != 0:
            raise NamespacesForbidden(f"veth pairs are not permitted here: {proc.stderr.strip()}")
    finally:
        _sh("ip", "netns", "del", probe)


def missing_tools() -> list[str]:
    """Binaries the two-host tests need; scripts/setup.sh installs them from apt."""
    need = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "pdsh": "pdsh"}
    paths = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [f"{b} ({pkg})" for b, pkg in need.items() if shutil.which(b, path=paths) is None]


def _write_keys(work: Path, hosts: tuple[Host, Host]) -> None:
    _must("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ds_clip-test", "-f", str(work / "id_ed25519"))
    _must(
        "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ds_clip-test-host", "-f", str(work / "host_key")
    )
    (work / "authorized_keys").write_text((work / "id_ed25519.pub").read_text())
    host_pub = " ".join((work / "host_key.pub").read_text().split()[:2])
    (work / "known_hosts").write_text("".join(f"{h.name},{h.addr} {host_pub}\n" for h in hosts))
    (work / "ssh_config").write_text(
        "Host *\n"
        "  User root\n"
        f"  IdentityFile {work / 'id_ed25519'}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {work / 'known_hosts'}\n"
        "  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking yes\n"
        "  BatchMode yes\n"
        "  ConnectTimeout 5\n"
        "  LogLevel ERROR\n"
    )
    bin_dir = work / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {work / "ssh_config"} "$@"\n')
    wrapper.chmod(0o755)


def _sshd_config(work: Path, host: Host) -> Path:
    cfg = work / f"sshd_config.{host.name}"
    cfg.write_text(
        f"ListenAddress {host.addr}\n"
        "Port 22\n"
        f"HostKey {work / 'host_key'}\n"
        f"AuthorizedKeysFile {work / 'authorized_keys'}\n"
        f"PidFile {work / f'sshd.{host.name}.pid'}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        # tmp_path is under /tmp (world-writable parents): sshd's ownership checks would refuse the key.
        "StrictModes no\n"
        "PrintMotd no\n"
        "PrintLastLog no\n"
    )
    return cfg


def _wait_listening(proc: subprocess.Popen, host: Host) -> None:
    # sshd -D -e logs "Server listening on <addr> port 22." once bound: wait for that line, not a delay.
    # Raw reads on the descriptor: a buffered readline could hold the line while select() sees nothing.
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    seen = b""
    deadline = time.monotonic() + SSHD_START_TIMEOUT_S
    while b"Server listening on" not in seen:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            text = seen.decode(errors="replace").strip().replace("\n", " | ")
            raise RuntimeError(f"sshd on {host.name} ({host.addr}) did not start: {text[-1500:]}")
        seen += chunk


def _drain(proc: subprocess.Popen, log: Path) -> None:
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    with log.open("ab") as f:
        while chunk := os.read(fd, 65536):
            f.write(chunk)


@contextmanager
def two_hosts(workdir: Path) -> Iterator[TwoHosts]:
    """Build the two hosts, yield them, and remove everything built, whatever happens in between."""
    probe_namespaces()
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"dsc{os.getpid()}"
    hosts = (Host("dsnode1", f"{tag}a", f"{SUBNET}.1"), Host("dsnode2", f"{tag}b", f"{SUBNET}.2"))
    net = TwoHosts(hosts=hosts, workdir=workdir)
    made_privsep = False
    made_etc_netns = not Path("/etc/netns").exists()
    etc_dirs: list[Path] = []
    try:
        for h in hosts:
            _must("ip", "netns", "add", h.netns)
        _must("ip", "link", "add", IFNAME, "netns", hosts[0].netns, "type", "veth",
              "peer", "name", IFNAME, "netns", hosts[1].netns)  # fmt: skip
        names = [*((h.name, h.addr) for h in hosts), UNREACHABLE]
        for h in hosts:
            _must("ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", IFNAME)
            _must("ip", "-n", h.netns, "link", "set", IFNAME, "up")
            _must("ip", "-n", h.netns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True)
            etc_dirs.append(etc)
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n{h.addr} {h.name}\n"
                + "".join(f"{a} {n}\n" for n, a in names if n != h.name)
            )
            # No nameserver line: the resolver falls back to 127.0.0.1 inside the namespace (refused at once).
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
        _write_keys(workdir, hosts)
        if not PRIVSEP_DIR.exists():
            PRIVSEP_DIR.mkdir(mode=0o755)
            made_privsep = True
        sshd = shutil.which("sshd", path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin")
        if sshd is None:
            raise RuntimeError("sshd not found: install openssh-server (scripts/setup.sh does, as root)")
        for h in hosts:
            proc = subprocess.Popen(
                on_host(h, [sshd, "-D", "-e", "-f", str(_sshd_config(workdir, h))]),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            net._sshd.append(proc)
            _wait_listening(proc, h)
            # sshd keeps logging each login: drain the pipe into a file so it can never fill and block sshd.
            drain = threading.Thread(target=_drain, args=(proc, workdir / f"sshd.{h.name}.log"), daemon=True)
            drain.start()
            net._drains.append(drain)
        yield net
    finally:
        _teardown(net, etc_dirs, made_privsep, made_etc_netns)


def _teardown(net: TwoHosts, etc_dirs: list[Path], made_privsep: bool, made_etc_netns: bool) -> None:
    for proc in net._sshd:
        proc.terminate()
    for proc in net._sshd:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for h in net.hosts:
        # Anything still running in our namespaces was started by the test (ranks, orted, sshd sessions).
        pids = _sh("ip", "netns", "pids", h.netns).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        _sh("ip", "netns", "del", h.netns)  # also deletes the veth end inside it
    for drain in net._drains:
        drain.join(timeout=10)  # ends at EOF, once sshd and every session holding its stderr are gone
    for proc in net._sshd:
        if proc.stderr is not None:
            proc.stderr.close()
    for etc in etc_dirs:
        shutil.rmtree(etc, ignore_errors=True)
    for made, d in ((made_privsep, PRIVSEP_DIR), (made_etc_netns, Path("/etc/netns"))):
        if made:
            try:
                d.rmdir()
            except OSError:  # something else put files there meanwhile: leave it
                pass
    for secret in ("id_ed25519", "host_key"):
        for suffix in ("", ".pub"):
            (net.workdir / f"{secret}{suffix}").unlink(missing_ok=True)

"""A Docker engine of the test's own, started by hand (no systemd here) and stopped by its PID, and the host's
networking put back as it was.

dockerd changes host networking and leaves it changed when it stops: ip_forward on, the iptables FORWARD policy at
DROP, DOCKER* chains and a MASQUERADE rule, its bridges. With bridge-nf-call-iptables on, a FORWARD policy of DROP
breaks the lab's bridges and every namespace test after it. So the engine keeps a socket, data root and PID file of
its own (a user's own dockerd, if any, is left alone), and HostNetworking.restore puts back the iptables tables,
ip_forward and links of before it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SOCKET = Path("/run/swarm-node-test-docker.sock")
PID_FILE = Path("/run/swarm-node-test-docker.pid")
EXEC_ROOT = Path("/run/swarm-node-test-docker")
# Kept between runs: the base image and the image's layers are cached there, so a second run rebuilds in seconds.
DATA_ROOT = Path("/var/lib/swarm-node-test-docker")
# Each table as it is before anything is added: what iptables-save cannot print for a table that does not exist yet
# (nf_tables creates a table on first use), and what restoring it must return to: no rules, no chains of its own,
# every policy ACCEPT.
EMPTY_TABLES = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
}
IPTABLES_TABLES = tuple(EMPTY_TABLES)


@dataclass(frozen=True)
class HostNetworking:
    """What dockerd changes on the host: the iptables tables it writes to, ip_forward, the network links."""

    iptables: dict[str, str]
    ip_forward: str
    links: frozenset[str]

    @classmethod
    def now(cls) -> HostNetworking:
        return cls(
            iptables={table: _iptables_save(table) for table in IPTABLES_TABLES},
            ip_forward=Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
            links=frozenset(_link_names()),
        )

    def forward_policy(self) -> str:
        return next(line for line in self.iptables["filter"].splitlines() if line.startswith(":FORWARD")).split()[1]

    def restore(self) -> None:
        """Puts the host back as this snapshot saw it: the links created since removed, the tables and ip_forward
        rewritten."""
        for name in sorted(set(_link_names()) - self.links):
            subprocess.run(["ip", "link", "delete", name], capture_output=True)
        for table, saved in self.iptables.items():
            subprocess.run(["iptables-restore", "--table", table], input=saved, text=True, check=True)
        Path("/proc/sys/net/ipv4/ip_forward").write_text(self.ip_forward + "\n")

    def differences(self, other: HostNetworking) -> list[str]:
        """What differs between two snapshots, in words (rule counters and comments aside)."""
        out = []
        for table in IPTABLES_TABLES:
            if _rules(self.iptables[table]) != _rules(other.iptables[table]):
                out.append(f"iptables {table}: {_rules(self.iptables[table])} != {_rules(other.iptables[table])}")
        if self.ip_forward != other.ip_forward:
            out.append(f"ip_forward {self.ip_forward} != {other.ip_forward}")
        if self.links != other.links:
            out.append(f"links {sorted(self.links)} != {sorted(other.links)}")
        return out


def _iptables_save(table: str) -> str:
    saved = subprocess.run(["iptables-save", "--table", table], capture_output=True, text=True, check=True).stdout
    if f"*{table}" in saved.splitlines():
        return saved
    return "\n".join([f"*{table}", *(f":{chain} ACCEPT [0:0]" for chain in EMPTY_TABLES[table]), "COMMIT", ""])


def _rules(saved: str) -> list[str]:
    # '#' lines carry dates; ':CHAIN POLICY [packets:bytes]' counters move with any traffic
    return [line.split(" [")[0] for line in saved.splitlines() if line and not line.startswith("#")]


def _link_names() -> list[str]:
    listed = json.loads(subprocess.run(["ip", "-json", "link"], capture_output=True, text=True, check=True).stdout)
    return [link["ifname"] for link in listed]


class DockerEngine:
    """dockerd on SOCKET, its log in `log_path`; `env` is what docker and docker-compose need to reach it. The host's
    networking is snapshot before it starts (`host_before`) and put back once it has stopped."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{SOCKET}")
        self.host_before: HostNetworking | None = None

    def start(self, timeout_s: float = 120) -> None:
        if PID_FILE.exists():  # a dockerd killed earlier can leave its PID file, which refuses the next start
            stale = PID_FILE.read_text().strip()
            if stale.isdigit() and Path(f"/proc/{stale}").exists():
                raise RuntimeError(f"a test dockerd (PID {stale}) is still running on {SOCKET}")
            PID_FILE.unlink()
        self.host_before = HostNetworking.now()
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [
                "dockerd",
                f"--host=unix://{SOCKET}",
                f"--data-root={DATA_ROOT}",
                f"--exec-root={EXEC_ROOT}",
                f"--pidfile={PID_FILE}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s  # a hang guard: the API answers within a second on an idle machine
        while subprocess.run(["docker", "info"], env=self.env, capture_output=True).returncode != 0:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"dockerd exited with {self.process.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not answer in {timeout_s} s: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.5)

    def docker(self, *args: str, timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )
        if check and result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} exited {result.returncode}: {result.stderr[-3000:]}")
        return result

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM to our dockerd by its PID (it stops its containers first), SIGKILL past the timeout; then the host's
        networking as it was before the start."""
        if self.process is None or self.log.closed:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self.log.close()
        PID_FILE.unlink(missing_ok=True)
        self.host_before.restore()

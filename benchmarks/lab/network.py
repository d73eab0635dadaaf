"""The lab's network: N network namespaces on one bridge, shaped links, home routers, partitions, processes in
them, and cleanup of what a killed lab left.


Topology: a hub namespace holds a bridge; node i lives in namespace `<tag>-n<i>` with one
interface `eth0` at 198.18.<1 + i // 250>.<1 + i % 250>/16, joined to the bridge by a veth
pair. The root namespace is joined too (198.18.0.254), so `swarm-node peers` and the
dashboard work from the host. Per node, both directions of its link are shaped: upload by a
`tc tbf` on its eth0, download by a `tc tbf` on its bridge port; random loss by iptables'
`statistic` match on its INPUT and OUTPUT (so `--loss p` drops a packet with probability p
in each direction). Delay is NOT emulated; RTT stays that of a veth (tens of microseconds).
This kernel has no `netem`, and no `fq` or `etf` qdisc either, so the other kernel route (a tc
BPF program stamping each packet with a later departure time, which `fq` honours) is closed
too (tried 2026-11-23: "Specified qdisc kind is unknown"). A user-space relay would move
every packet of every link through a process on the same 2 cores the nodes saturate, and
measure the relay.

Home routers: `Lab(n, nat={3: 0, 4: 1})` puts node 3 behind router 0 and node 4 behind router 1.
A router is a namespace `<tag>-r<k>` with a WAN side on the bridge (<net>.250.<1 + k>) and a LAN
bridge (192.168.<k>.1/24, a home LAN's range); its nodes sit at 192.168.<k>.<2 + j> with it as
their default route. It does what a home router does: source NAT of everything leaving
(iptables MASQUERADE) and, from the WAN side, only packets of connections opened from inside
(conntrack ESTABLISHED,RELATED); nothing is forwarded to a port. Public nodes have no route to
192.168.0.0/16 at all, so a direct dial fails either way. `Lab.dial(src, dst, port)` checks that
from a node's own namespace. A lab with routers puts its public side at 198.20.x.y instead of
198.18.x.y (`Lab.net`): libp2p's relay client builds /p2p-circuit addresses only over a relay's
public addresses and drops the benchmarking range 198.18.0.0/15 as unroutable, as it keeps a
node's own addresses only when they are private (192.168/16) or public. 198.20/16 is somebody's
real range, so such a lab never joins the host to its bridge (`host_link=False`).

Faults: `--churn-every S` kills a random non-bootstrap node with SIGKILL every S seconds and
restarts it (same state directory: it resumes) `--churn-down` seconds later; `--partition-at
T --partition-for S` moves the bridge ports of the upper half of the nodes to a second
bridge for S seconds (two halves that cannot reach each other), then moves them back.

Everything the lab creates is torn down on exit, on Ctrl-C, on SIGTERM and on an exception;
a lab killed with SIGKILL leaves a registry file under /tmp/swarm-lab that the next lab (or
`--cleanup`) uses to remove what it left. Without root the lab says so in one line and runs
the nodes on 127.0.0.1 with no shaping.

Use: `with Lab(3) as lab: lab.shape(0, Link(mbit=20)); lab.run(0, [...])`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REGISTRY_DIR = Path("/tmp/swarm-lab")
BENCH_NET = "198.18"  # RFC 2544's benchmarking range: routed nowhere, so the host may join the bridge
NAT_LAB_NET = "198.20"  # a lab with routers: an "internet" that libp2p counts as public (module docstring)
HOST_IP = f"{BENCH_NET}.0.254"
PREFIX_LEN = 16
MAX_NODES = 1000
MAX_ROUTERS = 200


def router_wan_ip(router: int, net: str = NAT_LAB_NET) -> str:
    return f"{net}.250.{1 + router}"


def router_lan_ip(router: int) -> str:
    return f"192.168.{router}.1"


def node_ip(index: int, net: str = BENCH_NET) -> str:
    return f"{net}.{1 + index // 250}.{1 + index % 250}"


def lab_unavailable() -> str | None:
    """Why this machine cannot build the lab (None: it can)."""
    if os.geteuid() != 0:
        return "the swarm lab needs root (network namespaces, tc, iptables)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"the swarm lab needs `{tool}` (Debian: iproute2, iptables)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


@dataclass(frozen=True)
class Link:
    """How one node's link is shaped. Rates in Mbit/s (None: unshaped); loss per packet and direction."""

    mbit: float | None = None
    up_mbit: float | None = None  # overrides `mbit` for what the node sends
    down_mbit: float | None = None  # overrides `mbit` for what the node receives
    loss: float = 0.0

    def __post_init__(self) -> None:
        for rate in (self.mbit, self.up_mbit, self.down_mbit):
            if rate is not None and not 0.01 <= rate <= 100_000:
                raise ValueError(f"a link rate must be in [0.01, 100000] Mbit/s, got {rate}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")

    @property
    def up(self) -> float | None:
        return self.up_mbit if self.up_mbit is not None else self.mbit

    @property
    def down(self) -> float | None:
        return self.down_mbit if self.down_mbit is not None else self.mbit

    def describe(self) -> str:
        rate = (
            "unshaped"
            if self.up is None and self.down is None
            else f"{self.up or '-'}/{self.down or '-'} Mbit/s up/down"
        )
        return rate + (f", {self.loss:.1%} loss each way" if self.loss else "")


def _tbf(rate_mbit: float) -> list[str]:
    # burst: at least one MTU and ~4 ms of traffic at the rate, so low rates stay exact and high ones reachable
    burst = max(15_000, int(rate_mbit * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "400ms"]


def remove_stale_namespaces(prefix: str) -> list[str]:
    """Delete the network namespaces named `prefix`<owner's process id>x... whose owner is gone, after killing what
    still runs in them. For namespaces of a benchmark's own (a checkpoint store, a run's shaped loopback) that a
    SIGKILL left behind."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    removed = []
    for name in listed:
        owner = name.removeprefix(prefix).split("x")[0]
        if not name.startswith(prefix) or not owner.isdigit() or Path(f"/proc/{owner}").exists():
            continue
        kill_and_delete_namespace(name)
        removed.append(name)
    return removed


def kill_and_delete_namespace(name: str) -> None:
    """SIGKILL whatever still runs in the network namespace `name`, then delete it (gone already: nothing happens)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


@dataclass
class _Process:
    index: int
    argv: list[str]
    log: Path
    popen: subprocess.Popen
    restarts: int = 0


@dataclass
class Lab:
    """N network namespaces on one bridge (see the module docstring). Use as a context manager."""

    nodes: int
    tag: str = field(default_factory=lambda: f"sl{uuid.uuid4().hex[:5]}")
    loopback: bool = False  # no namespaces (not root): every node on 127.0.0.1, shaping ignored
    host_link: bool = True  # join the root namespace to the bridge (HOST_IP), so the host can watch; tests leave it out
    # node index -> the router it sits behind (see the module docstring)
    nat: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"a lab has 1 to {MAX_NODES} nodes, not {self.nodes}")
        if any(not 0 <= i < self.nodes for i in self.nat) or any(not 0 <= r < MAX_ROUTERS for r in self.nat.values()):
            raise ValueError(f"nat maps node indices (< {self.nodes}) to routers (< {MAX_ROUTERS}), not {self.nat}")
        if self.nat and self.loopback:
            raise ValueError("NAT needs the namespaced lab (root)")
        if self.nat and self.host_link:
            raise ValueError(
                f"a lab with routers lives on {NAT_LAB_NET}.0.0/16, a real range the host must not route to: pass "
                "host_link=False"
            )
        if len(self.tag) > 7 or not self.tag.isalnum():
            raise ValueError("a lab tag is at most 7 letters or digits (interface names are limited to 15 characters)")
        self.processes: dict[int, _Process] = {}
        self.links: dict[int, Link] = {}
        self.partitioned: set[int] = set()
        self._up = False

    # names ------------------------------------------------------------------------------

    def ns(self, index: int) -> str:
        return f"{self.tag}-n{index}"

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    @property
    def net(self) -> str:
        """The first two octets of the public side's /16 (see the module docstring)."""
        return NAT_LAB_NET if self.nat else BENCH_NET

    def ip(self, index: int) -> str:
        """The address node `index` listens at (a private one behind a router)."""
        if self.loopback:
            return "127.0.0.1"
        if index in self.nat:
            router = self.nat[index]
            return f"192.168.{router}.{2 + sorted(i for i, r in self.nat.items() if r == router).index(index)}"
        return node_ip(index, self.net)

    def wan_ip(self, router: int) -> str:
        """Where router `router`'s NAT'd nodes appear to come from."""
        return router_wan_ip(router, self.net)

    def router(self, router: int) -> str:
        return f"{self.tag}-r{router}"

    def _port_ns(self, index: int) -> str:
        """The namespace holding the far end of node `index`'s link (its router's LAN, or the hub)."""
        return self.router(self.nat[index]) if index in self.nat else self.hub

    def _port(self, index: int) -> str:
        return f"{self.tag}p{index}"

    @property
    def _registry(self) -> Path:
        return REGISTRY_DIR / f"{self.tag}.json"

    # life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> "Lab":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        if self.loopback:
            self._up = True
            return
        why = lab_unavailable()
        if why:
            raise RuntimeError(why)
        cleanup_stale()
        if self.host_link and (holder := host_link_holder()):
            raise RuntimeError(
                f"lab {holder} already joins this host to {BENCH_NET}.0.0/{PREFIX_LEN} as {HOST_IP}: a second lab with "
                "host_link would take its routes (pass host_link=False, or wait for it to end)"
            )
        self._up = True
        self._save_registry()  # before creating anything: a crash from here on is cleaned up next time
        try:
            _run("ip", "netns", "add", self.hub)
            for bridge in ("br0", "br1"):  # br1 holds the cut-off half during a partition
                _run("ip", "-n", self.hub, "link", "add", bridge, "type", "bridge")
                _run("ip", "-n", self.hub, "link", "set", bridge, "up")
            if self.host_link:
                _run("ip", "link", "add", f"{self.tag}h", "type", "veth", "peer", "name", f"{self.tag}hp")
                _run("ip", "link", "set", f"{self.tag}hp", "netns", self.hub)
                _run("ip", "-n", self.hub, "link", "set", f"{self.tag}hp", "master", "br0", "up")
                _run("ip", "addr", "add", f"{HOST_IP}/{PREFIX_LEN}", "dev", f"{self.tag}h")
                _run("ip", "link", "set", f"{self.tag}h", "up")
            for router in sorted(set(self.nat.values())):
                self._add_router(router)
            for index in range(self.nodes):
                ns, port, far = self.ns(index), self._port(index), self._port_ns(index)
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", f"{self.tag}v{index}", "type", "veth", "peer", "name", port)
                _run("ip", "link", "set", f"{self.tag}v{index}", "netns", ns)
                _run("ip", "link", "set", port, "netns", far)
                _run("ip", "-n", far, "link", "set", port, "master", "lan" if index in self.nat else "br0", "up")
                _run("ip", "-n", ns, "link", "set", f"{self.tag}v{index}", "name", "eth0")
                _run(
                    "ip",
                    "-n",
                    ns,
                    "addr",
                    "add",
                    f"{self.ip(index)}/{24 if index in self.nat else PREFIX_LEN}",
                    "dev",
                    "eth0",
                )
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                if index in self.nat:
                    _run("ip", "-n", ns, "route", "add", "default", "via", router_lan_ip(self.nat[index]))
        except BaseException:
            self.down()
            raise

    def _add_router(self, router: int) -> None:
        """A home router: WAN on the bridge, a LAN bridge behind it, MASQUERADE out, only replies in."""
        ns, wan, hub_port = self.router(router), f"{self.tag}w{router}", f"{self.tag}q{router}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", wan, "type", "veth", "peer", "name", hub_port)
        _run("ip", "link", "set", wan, "netns", ns)
        _run("ip", "link", "set", hub_port, "netns", self.hub)
        _run("ip", "-n", self.hub, "link", "set", hub_port, "master", "br0", "up")
        _run("ip", "-n", ns, "link", "set", wan, "name", "wan")
        _run("ip", "-n", ns, "addr", "add", f"{self.wan_ip(router)}/{PREFIX_LEN}", "dev", "wan")
        _run("ip", "-n", ns, "link", "add", "lan", "type", "bridge")
        _run("ip", "-n", ns, "addr", "add", f"{router_lan_ip(router)}/24", "dev", "lan")
        for link in ("lo", "wan", "lan"):
            _run("ip", "-n", ns, "link", "set", link, "up")
        _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        iptables = ["ip", "netns", "exec", ns, "iptables"]
        _run(*iptables, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        _run(
            *iptables,
            "-A",
            "FORWARD",
            "-i",
            "wan",
            "-o",
            "lan",
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED",
            "-j",
            "ACCEPT",
        )
        _run(*iptables, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")

    def dial(self, source: int, ip: str, port: int, timeout_s: float = 3.0) -> bool:
        """Whether a TCP connection from node `source`'s namespace to ip:port opens (the NAT check)."""
        probe = (
            "import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), "
            "timeout=float(sys.argv[3])).close()\n"
            "except OSError:\n    sys.exit(1)\n"
        )
        prefix = [] if self.loopback else ["ip", "netns", "exec", self.ns(source)]
        return (
            subprocess.run(
                [*prefix, sys.executable, "-c", probe, ip, str(port), str(timeout_s)],
                capture_output=True,
                timeout=timeout_s + 30,
            ).returncode
            == 0
        )

    def down(self) -> None:
        """Stop every process this lab started (their process groups), then remove its namespaces and links."""
        for proc in self.processes.values():
            _signal_group(proc.popen, signal.SIGINT)
        deadline = time.monotonic() + 20
        for proc in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.processes.values():
            _signal_group(proc.popen, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        if self._up and not self.loopback:
            _remove(self.tag, self.nodes)
            self._registry.unlink(missing_ok=True)
        self._up = False

    def _save_registry(self) -> None:
        REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
        record = {
            "owner_pid": os.getpid(),
            "tag": self.tag,
            "nodes": self.nodes,
            "host_link": self.host_link,
            "process_groups": [p.popen.pid for p in self.processes.values()],
        }
        tmp = self._registry.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self._registry)

    # shaping and faults -------------------------------------------------------------------

    def shape(self, index: int, link: Link) -> None:
        """Shape node `index`'s link (replacing any earlier shaping)."""
        self.links[index] = link
        if self.loopback:
            return
        ns, far = self.ns(index), self._port_ns(index)
        _run("tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root", check=False)
        _run("tc", "-n", far, "qdisc", "del", "dev", self._port(index), "root", check=False)
        if link.up is not None:
            _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *_tbf(link.up))
        if link.down is not None:
            _run("tc", "-n", far, "qdisc", "add", "dev", self._port(index), "root", *_tbf(link.down))
        for chain in ("INPUT", "OUTPUT"):
            _run("ip", "netns", "exec", ns, "iptables", "-F", chain)
            if link.loss:
                _run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "iptables",
                    "-A",
                    chain,
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    f"{link.loss:.6f}",
                    "-j",
                    "DROP",
                )

    def partition(self, cut_off: set[int]) -> None:
        """Cut the nodes in `cut_off` from the others (and from the host); they still reach each other."""
        if self.loopback:
            raise RuntimeError("partitions need the namespaced lab (root)")
        if cut_off & set(self.nat):
            raise RuntimeError("a node behind a router cannot be partitioned on its own: its link ends at the router")
        for index in sorted(cut_off):
            _run("ip", "-n", self.hub, "link", "set", self._port(index), "master", "br1")
        self.partitioned |= set(cut_off)

    def heal(self) -> None:
        for index in sorted(self.partitioned):
            _run("ip", "-n", self.hub, "link", "set", self._port(index), "master", "br0")
        self.partitioned.clear()

    # processes ----------------------------------------------------------------------------

    def run(self, index: int, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` in node `index`'s namespace, in a process group of its own, output to `log`."""
        prefix = [] if self.loopback else ["ip", "netns", "exec", self.ns(index)]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                prefix + argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
        restarts = self.processes[index].restarts + 1 if index in self.processes else 0
        self.processes[index] = _Process(index, argv, log, popen, restarts)
        if not self.loopback:
            self._save_registry()
        return popen

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        proc = self.processes[index]
        _signal_group(proc.popen, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=30)

    def restart(self, index: int, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start node `index`'s last command again; a restart resumes its state, so without `--fresh`."""
        proc = self.processes[index]
        return self.run(index, [a for a in proc.argv if a != "--fresh"], proc.log, env)

    def alive(self, index: int) -> bool:
        return index in self.processes and self.processes[index].popen.poll() is None


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, sig)


def _remove(tag: str, nodes: int) -> None:
    """Delete a lab's namespaces, routers included (which deletes their veth ends, and so the pairs), and its host
    link."""
    for index in range(nodes):
        _run("ip", "netns", "del", f"{tag}-n{index}", check=False)
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():  # routers, however many the lab had
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{tag}-r"):
            _run("ip", "netns", "del", name, check=False)
    _run("ip", "netns", "del", f"{tag}-hub", check=False)
    _run("ip", "link", "del", f"{tag}h", check=False)


def _registry_records():
    """(path, record) of every lab in the registry; record None where the file cannot be read."""
    if not REGISTRY_DIR.exists():
        return
    for path in sorted(REGISTRY_DIR.glob("*.json")):
        try:
            yield path, json.loads(path.read_text())
        except (OSError, ValueError):
            yield path, None


def _owner_alive(record: dict) -> bool:
    owner = record.get("owner_pid")
    return bool(owner) and Path(f"/proc/{owner}").exists()


def host_link_holder() -> str | None:
    """The tag of a live lab joining the host to the bench network (one at most: they share HOST_IP and its route)."""
    for _, record in _registry_records():
        if record is not None and record.get("host_link") and _owner_alive(record):
            return record["tag"]
    return None


def stop_on_first_signal() -> None:
    """From now on the first SIGTERM or Ctrl-C raises KeyboardInterrupt, so that the caller's cleanup of its lab runs
    (its processes stopped, its namespaces removed), even in a process a script started in the background, where the
    shell set SIGINT to be ignored. A signal after that one is ignored: it would cut the cleanup short."""

    def stop(*_) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def cleanup_stale() -> list[str]:
    """Remove what labs whose owner process is gone left behind (process groups, namespaces, links); their tags."""
    removed = []
    for path, record in list(_registry_records()):
        if record is None:
            path.unlink(missing_ok=True)
            continue
        if record.get("owner_pid") != os.getpid() and _owner_alive(record):
            continue  # a live lab
        for pgid in record.get("process_groups", []):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        _remove(record["tag"], record["nodes"])
        path.unlink(missing_ok=True)
        removed.append(record["tag"])
    return removed


def p2p_daemon_of(pid: int) -> int | None:
    """The p2pd process started by process `pid` (None: none is running)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            if parent == pid and name == "p2pd":
                return int(entry.name)
    return None

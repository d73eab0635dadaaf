"""Each host's own uplink, for a run whose hosts share one machine: a network namespace of the run's own, whose
loopback is shaped per host.

stage_recovery's `--checkpoint-uplinks per-host` starts each run in a namespace of its own (RunNamespace). Inside it,
the run's hosts (the driver, every stage server, every checkpoint store) talk over that namespace's loopback, and
HostUplinks gives each host an uplink of the rate: an htb class on the loopback that every packet the host sends
goes through. So what a stage's host sends shares one link, as on a home connection: its hidden states and
gradients, what a CheckFree rebuild reads from it, and its checkpoint uploads. Downlinks are not shaped.

A host is known by ports. A p2p daemon sends from the port it listens on, on connections it dials too (go-libp2p
reuses the listening port; checked with `ss` on this machine, 2026-11-30), and a store answers from its own port.
A checkpoint upload leaves the benchmark process from a port of the moment, so it is matched by where it goes: the
stage's own store, which only that stage's host uploads to. Traffic of no host (none, once every host is added)
goes to an unshaped class. The namespace is the run's alone, so nothing else on the machine is shaped and two runs
side by side never share a class; it is removed when the run ends, and a namespace whose owner died is removed by the
next one (lab.remove_stale_namespaces). Imports no torch.
"""

from __future__ import annotations

import itertools
import os
import re

from benchmarks.lab import _run, kill_and_delete_namespace, lab_unavailable, remove_stale_namespaces

NAMESPACE_PREFIX = "uplk"  # then the owner's process id, "x" and an index
NAMESPACES = itertools.count()
NAMESPACE_ENV = "SWARM_NODE_RUN_NAMESPACE"
ROOT = "1:"
UNSHAPED = "1:1"  # the default class: traffic of no host
FIRST_HOST_CLASS = 0x10


class RunNamespace:
    """A network namespace for one run, with its loopback up: `command(argv)` runs argv inside it. `close()` kills
    what still runs there and deletes it (a context manager does both ends)."""

    def __init__(self) -> None:
        why = lab_unavailable()
        if why:
            raise RuntimeError(f"a run with an uplink per host: {why}")
        remove_stale_namespaces(NAMESPACE_PREFIX)
        self.name = f"{NAMESPACE_PREFIX}{os.getpid()}x{next(NAMESPACES)}"
        _run("ip", "netns", "add", self.name)
        try:
            _run("ip", "-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside the namespace, with its name in NAMESPACE_ENV (each of `ip`, `env` and argv execs the
        next: one process)."""
        return ["ip", "netns", "exec", self.name, "env", f"{NAMESPACE_ENV}={self.name}", *argv]

    def close(self) -> None:
        kill_and_delete_namespace(self.name)

    def __enter__(self) -> RunNamespace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def in_own_namespace() -> bool:
    """Whether this process runs in a RunNamespace (the one its NAMESPACE_ENV names, checked: the same namespace)."""
    name = os.environ.get(NAMESPACE_ENV)
    if not name or "/" in name:
        return False
    try:
        return os.stat(f"/run/netns/{name}").st_ino == os.stat("/proc/self/ns/net").st_ino
    except FileNotFoundError:
        return False


class HostUplinks:
    """Uplinks of `mbit` each for the hosts on this namespace's loopback (module docstring). Only in a namespace of a
    run's own: it puts an htb root on `lo`, which would shape the whole machine's loopback elsewhere."""

    def __init__(self, mbit: float, device: str = "lo") -> None:
        if not in_own_namespace():
            raise RuntimeError("HostUplinks shapes the loopback: run it in a namespace of its own (RunNamespace)")
        self.mbit, self.device = mbit, device
        self.classes: dict[str, str] = {}  # host -> its htb class
        # lo's packets are up to 64 KiB: a burst below that would hold each one back by more than its share
        self.burst = max(1 << 17, int(mbit * 1e6 / 8 * 0.004))
        _run("tc", "qdisc", "add", "dev", device, "root", "handle", ROOT, "htb", "default", UNSHAPED.split(":")[1])
        _run("tc", "class", "add", "dev", device, "parent", ROOT, "classid", UNSHAPED, *self.htb("100gbit"))

    def htb(self, rate: str) -> list[str]:
        burst = str(self.burst)
        return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst, "quantum", "65536"]

    def add(self, host: str, sends_from: tuple[int, ...] = (), sends_to: tuple[int, ...] = ()) -> str:
        """Give `host` its uplink (on first use) and count as its own the packets sent from `sends_from` ports and
        those sent to `sends_to` ports. A host that comes back under the same name (a stage's replacement server: a
        new machine behind a link of the same rate) gets the same class; the one before it sends nothing any more."""
        classid = self.classes.get(host)
        if classid is None:
            classid = f"1:{FIRST_HOST_CLASS + len(self.classes):x}"
            _run(
                "tc",
                "class",
                "add",
                "dev",
                self.device,
                "parent",
                ROOT,
                "classid",
                classid,
                *self.htb(f"{self.mbit}mbit"),
            )
            self.classes[host] = classid
        for field, ports in (("sport", sends_from), ("dport", sends_to)):
            for port in ports:
                _run(
                    "tc", "filter", "add", "dev", self.device, "parent", ROOT, "protocol", "ip", "prio", "1",
                    "u32", "match", "ip", field, str(port), "0xffff", "flowid", classid,
                )  # fmt: skip
        return classid

    def sent_bytes(self) -> dict[str, int]:
        """Bytes each host has sent over its uplink so far (and "unshaped": traffic of no host)."""
        shown = _run("tc", "-s", "class", "show", "dev", self.device).stdout
        by_class = {
            match.group(1): int(match.group(2))
            for match in re.finditer(r"class htb (\S+) .*?\n\s*Sent (\d+) bytes", shown)
        }
        names = {classid: host for host, classid in self.classes.items()} | {UNSHAPED: "unshaped"}
        return {names[classid]: sent for classid, sent in by_class.items() if classid in names}


def port_of(maddrs: list) -> int:
    """The TCP port of a p2p daemon, from its visible multiaddresses (all on the one loopback: one port)."""
    ports = {int(match.group(1)) for m in maddrs if (match := re.search(r"/tcp/(\d+)", str(m)))}
    if len(ports) != 1:
        raise RuntimeError(f"expected one TCP port among {maddrs}")
    return ports.pop()

"""benchmarks/host_uplinks.py: a run's own namespace whose loopback gives each host an uplink. What a host sends from
its ports, and what is sent to a port only it sends to, goes through its class; other traffic through the unshaped
one; the namespace goes when the run ends. Counted in bytes by tc, not timed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.host_uplinks import HostUplinks, RunNamespace, in_own_namespace, port_of
from benchmarks.lab import lab_unavailable
from tests.helpers.common import REPO

needs_lab = pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))

# Inside the namespace: host "a" serves 3 MB from its port, host "b" uploads 2 MB to a store's port (from a port of
# the moment, as a checkpoint upload does), and 1 MB comes from a port of no host. Prints each class's bytes.
TRANSFERS = """
import json, socket, threading
from benchmarks.host_uplinks import HostUplinks

def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server, server.getsockname()[1]

def send(server, size):
    connection, _ = server.accept()
    connection.sendall(b"x" * size)
    connection.close()

def drain(server):
    connection, _ = server.accept()
    while connection.recv(1 << 20):
        pass
    connection.sendall(b"K")
    connection.close()

a, a_port = listener()
store, store_port = listener()
nobody, nobody_port = listener()
uplinks = HostUplinks(mbit=400)
uplinks.add("a", sends_from=(a_port,))
uplinks.add("b", sends_to=(store_port,))
threads = [
    threading.Thread(target=send, args=(a, 3_000_000)),
    threading.Thread(target=drain, args=(store,)),
    threading.Thread(target=send, args=(nobody, 1_000_000)),
]
for thread in threads:
    thread.start()
for port in (a_port, nobody_port):
    with socket.create_connection(("127.0.0.1", port)) as client:
        while client.recv(1 << 20):
            pass
with socket.create_connection(("127.0.0.1", store_port)) as upload:
    upload.sendall(b"y" * 2_000_000)
    upload.shutdown(socket.SHUT_WR)
    assert upload.recv(1) == b"K"
for thread in threads:
    thread.join()
print(json.dumps(uplinks.sent_bytes()))
"""


@pytest.mark.integration
@needs_lab
def test_each_host_s_packets_go_through_its_own_uplink_and_the_namespace_goes_after():
    with RunNamespace() as namespace:
        done = subprocess.run(
            namespace.command([sys.executable, "-c", TRANSFERS]), capture_output=True, text=True, cwd=REPO
        )
        assert done.returncode == 0, done.stderr
        sent = json.loads(done.stdout.splitlines()[-1])
    assert set(sent) == {"a", "b", "unshaped"}
    # the payload and its headers; the acknowledgements each receiver sends back are a small share
    assert 3_000_000 <= sent["a"] < 3_300_000
    assert 2_000_000 <= sent["b"] < 2_200_000
    assert 1_000_000 <= sent["unshaped"] < 1_500_000
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespace.name not in listed


@pytest.mark.integration
@needs_lab
def test_a_run_s_namespace_is_known_from_inside_and_its_loopback_is_shaped_only_there():
    assert not in_own_namespace()
    with pytest.raises(RuntimeError, match="namespace of its own"):
        HostUplinks(mbit=20)  # here it would shape the machine's own loopback
    probe = "import benchmarks.host_uplinks as u; print(u.in_own_namespace())"
    with RunNamespace() as namespace:
        inside = subprocess.run(
            namespace.command([sys.executable, "-c", probe]), capture_output=True, text=True, cwd=REPO
        )
        assert inside.stdout.strip() == "True", inside.stderr
    shaped = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    assert "htb" not in shaped


@pytest.mark.integration
@needs_lab
def test_a_namespace_whose_run_died_is_removed_by_the_next_one():
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"uplk{gone.pid}x0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with RunNamespace():
            pass
        assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_a_daemon_s_port_is_read_from_its_addresses():
    assert port_of(["/ip4/127.0.0.1/tcp/41234/p2p/QmPeer"]) == 41234
    with pytest.raises(RuntimeError, match="one TCP port"):
        port_of(["/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip4/127.0.0.1/tcp/2/p2p/Qm"])

"""How a process joins its swarm's DHT, and leaves it: the DHT node and its p2p daemon, started with retries over
the bootstrap peers, its reachability measured (node/transport/reachability.py), shut down without hanging.

The DHT node runs inside the process's own asyncio loop (`DHTNode`, not the `hivemind.DHT`
child process): the child's uvloop pipe can die on values above ~16 KB and leave its
caller waiting forever (../shared/NOTES.md), and our loop is free anyway since torch work
runs in worker threads.

A process that talks to a swarm calls these through its session (node/transport/session.py), and the session's
membership keeps it joined (node/transport/membership.py); tests and benchmarks that want a bare DHT node call them
directly. Every key a process reads or writes starts with `key_prefix` (protocol major version and swarm id).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from pathlib import Path

from node.config import NodeConfig
from protocol.version import PROTOCOL_MAJOR

log = logging.getLogger(__name__)


class SwarmJoinError(RuntimeError):
    """The node could not start its p2p daemon or reach any initial peer."""


# hivemind's DHT pings each peer it bootstraps from and refuses one whose clock is more than
# MAX_DHT_TIME_DISCREPANCY_SECONDS (3 s) off its own, in a ValidationError that says only this
HIVEMIND_CLOCK_REFUSAL = re.compile(
    r"local time must be within (?P<bound>[\d.]+) seconds.*local: (?P<local>[\d.]+), peer: (?P<peer>[\d.]+)"
)


def clock_refusal(exc: BaseException) -> str | None:
    """What a join refused for this node's clock should say (None: refused for another reason)."""
    found = HIVEMIND_CLOCK_REFUSAL.search(str(exc))
    if found is None:
        return None
    off = float(found["local"]) - float(found["peer"])
    return (
        f"this node's clock is {abs(off):.0f} s {'ahead of' if off > 0 else 'behind'} its bootstrap peer's, and the "
        f"DHT (hivemind) refuses a peer more than {float(found['bound']):.0f} s off; set the system clock right "
        "(timedatectl set-ntp true)"
    )


def key_prefix(swarm_id: str) -> str:
    return f"swarm-node/v{PROTOCOL_MAJOR}/{swarm_id}"


async def create_dht_node(
    config: NodeConfig,
    client_mode: bool | None = None,
    refusals=None,
    identity_path: Path | None = None,
    behind_nat: bool = False,
    clock_offsets=None,
):
    """Start a DHT node (and its p2pd), retrying unreachable bootstrap peers with backoff.

    Any one reachable initial peer suffices (p2pd dials them all). `identity_path` is the
    daemon's key file (node/transport/p2p_key.py): with it the node keeps its /p2p/ id across
    restarts; without it (viewers, `peers`) the daemon takes a throwaway one. Its records are
    validated (node/transport/records.py); refused ones are counted in `refusals` (a
    stats.RecordRefusals) when given, and every verified record's signing time is given to `clock_offsets` (a
    stats.ClockOffsets) when given. `behind_nat`: nobody can dial this node, so it is a DHT
    client (no peer keeps it in a routing table it could not answer from) and its daemon asks
    the bootstrap peers for a circuit relay slot; a DHT server's daemon is told it is public,
    so that it relays for them (node/transport/reachability.py says why both are forced)."""
    from node.transport.protobuf_shim import import_hivemind_isolated

    import_hivemind_isolated()  # before any hivemind import: lets libp2p live in the same process
    from hivemind.dht.node import DHTNode

    from node.transport import hivemind_p2p

    from node.transport.records import SwarmRecordValidator, bound_key_storage

    swarm = config.swarm
    client_mode = swarm.client_mode if client_mode is None else client_mode
    p2p_options = dict(
        host_maddrs=swarm.host_maddrs,
        announce_maddrs=swarm.announce_maddrs or None,
        startup_timeout=swarm.p2pd_startup_timeout_s,
    )
    if identity_path is not None:
        from node.transport.p2p_key import load_or_create_p2p_key

        # ours is written 0600 and atomically; hivemind would write its own otherwise
        load_or_create_p2p_key(identity_path)
        p2p_options["identity_path"] = str(identity_path)
    # with no bootstrap peer there is nobody to ask for a relay slot
    relay_client = behind_nat and bool(swarm.initial_peers)
    if behind_nat:
        p2p_options["check_if_identity_free"] = False  # its own daemon just left: the check would see its ghost
        client_mode = True
    if relay_client:
        p2p_options["trusted_relays"] = swarm.initial_peers
    elif not client_mode:
        p2p_options["force_reachability"] = "public"
    delay, last_error = swarm.bootstrap_backoff_s, None
    for attempt in range(1, swarm.bootstrap_attempts + 1):
        try:
            dht_options = dict(
                initial_peers=swarm.initial_peers or None,
                client_mode=client_mode,
                record_validator=SwarmRecordValidator(swarm.swarm_id, refusals=refusals, clock_offsets=clock_offsets),
            )
            if relay_client:
                from node.transport.reachability import start_relay_client

                dht = await start_relay_client(DHTNode, dht_options, p2p_options)
            else:
                # what DHTNode.create tells a daemon it starts itself
                daemon_mode = {"dht_mode": "client"} if client_mode else {}
                dht = await hivemind_p2p.start_dht_node(DHTNode, dht_options, dict(p2p_options, **daemon_mode))
            bound_key_storage(dht, refusals)
            return dht
        except Exception as exc:  # hivemind raises P2PDaemonError, asyncio.TimeoutError, OSError...
            last_error = exc
            if attempt == swarm.bootstrap_attempts:
                break
            log.warning(
                "cannot join the swarm (attempt %d/%d): %s; retrying in %.0fs",
                attempt,
                swarm.bootstrap_attempts,
                clock_refusal(exc) or exc,
                delay,
            )
            await asyncio.sleep(delay)
            delay *= 2
    if not swarm.initial_peers:
        raise SwarmJoinError(f"could not start a new swarm after {swarm.bootstrap_attempts} attempts: {last_error}")
    if (clock := clock_refusal(last_error)) is not None:  # a peer answered: its answer was about this node's clock
        raise SwarmJoinError(f"could not join the swarm after {swarm.bootstrap_attempts} attempts: {clock}")
    tried = "; ".join(
        [
            f"{maddr} ({verdict})"
            for maddr, verdict in zip(
                swarm.initial_peers, await asyncio.gather(*(probe_tcp(m) for m in swarm.initial_peers))
            )
        ]
    )
    raise SwarmJoinError(
        f"could not join the swarm after {swarm.bootstrap_attempts} attempts; none of the {len(swarm.initial_peers)} "
        "initial peer(s) "
        f"answered: {tried}. Last error: {last_error}"
    )


async def start_swarm_dht(config: NodeConfig, identity_path: Path, refusals=None, clock_offsets=None):
    """Start a node's DHT node and measure its reachability (node/transport/reachability.py);
    a node found behind NAT restarts its daemon as one (same key, so the same peer id) and waits a while for a relay
    slot. Returns (dht, reachability); the session's membership keeps such a node's links (hold_links)."""
    from node.transport.reachability import measure_reachability, serve_observed_address

    swarm = config.swarm
    dht = await create_dht_node(
        config,
        refusals=refusals,
        identity_path=identity_path,
        behind_nat=swarm.reachability == "outbound-only",
        clock_offsets=clock_offsets,
    )
    reachability = swarm.reachability
    if reachability == "auto":
        if swarm.announce_maddrs:
            reachability = "direct"
        else:
            bootstrap_ids = list(dht_addresses_by_peer(swarm.initial_peers))
            reachability, observed = await measure_reachability(dht.p2p, bootstrap_ids, swarm.dht_timeout_s)
            log.info(
                "reachability %s: bootstrap peers see this node at %s", reachability, observed or "(nobody answered)"
            )
            if reachability == "outbound-only":
                log.warning(
                    "this node is behind NAT (peers see it at %s): it joins as a DHT client, asks its bootstrap peers "
                    "for a relay, and is reached over the connections it opens; forward a port and set "
                    "swarm.announce_maddrs to be dialed directly",
                    observed,
                )
                await shutdown_dht(dht)
                dht = await create_dht_node(
                    config, refusals=refusals, identity_path=identity_path, behind_nat=True, clock_offsets=clock_offsets
                )
    if reachability == "direct":
        await serve_observed_address(dht.p2p)  # only a node others can dial tells others where it sees them
    else:
        from node.transport.reachability import RELAY_WAIT_S, wait_for_relay_address

        if swarm.initial_peers:
            relayed = await wait_for_relay_address(dht.p2p, RELAY_WAIT_S)
            if relayed:
                reachability = "relayed"
                log.info("a relay reserved this node a slot: peers can dial it at %s", relayed)
            else:
                log.warning(
                    "no relay slot within %.0fs: this node is reached only over the connections it opens until one is "
                    "reserved",
                    RELAY_WAIT_S,
                )
    return dht, reachability


async def probe_tcp(maddr: str, timeout: float = 3.0) -> str:
    """Why a bootstrap address may have failed, as a user can act on it: no TCP listener, a timeout (a firewall or
    NAT), or TCP fine."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp":
        return "not a TCP address: not probed"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts[2], int(parts[4])), timeout)
    except asyncio.TimeoutError:
        return f"no TCP answer within {timeout:.0f}s: host down, or a firewall/NAT in the way"
    except (OSError, ValueError) as exc:
        return f"TCP connect failed: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
    writer.close()
    return "TCP port open, but the p2p handshake failed: a different peer id there, or another program on that port"


DEAD_DAEMON_SHUTDOWN_S = 2.0  # a shutdown once the daemon has exited: its parts that ask the daemon never hear back


async def shutdown_dht(dht, timeout: float = 10.0) -> None:
    """Shut the DHT node and its p2pd down, without hanging when p2pd is already gone.

    A Ctrl-C in a terminal reaches the whole process group, so p2pd often dies of the same
    signal that asked the node to stop, and a polite shutdown would then wait forever. Once the
    daemon has exited (a node leaving a connection that died to rejoin), the shutdown gets
    DEAD_DAEMON_SHUTDOWN_S rather than `timeout`: every second of it delays the rejoin.
    """
    from node.transport import hivemind_p2p

    p2p = getattr(dht, "p2p", None)
    process = hivemind_p2p.daemon_process(p2p) if p2p is not None else None
    if process is not None and process.returncode is not None:
        timeout = min(timeout, DEAD_DAEMON_SHUTDOWN_S)
    try:
        await asyncio.wait_for(dht.shutdown(), timeout)
    except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - leaving anyway; say why
        log.warning("DHT shutdown did not complete (%s); leaving anyway", type(exc).__name__)
        process = hivemind_p2p.daemon_process(p2p) if p2p is not None else None
        if process is not None and process.returncode is None:
            process.kill()
    finally:
        if p2p is not None:
            hivemind_p2p.retire_control_connection(p2p)


def dht_addresses_by_peer(addresses: Iterable[str]) -> dict[str, list[str]]:
    """Group multiaddrs ending in /p2p/<PeerID> by PeerID; anything else (untrusted input) is skipped."""
    from multiaddr import Multiaddr

    grouped: dict[str, list[str]] = {}
    for text in addresses:
        try:
            peer_id = Multiaddr(text)["p2p"]
        except Exception:  # malformed or without /p2p/: nothing to dial
            continue
        grouped.setdefault(peer_id, []).append(text)
    return grouped

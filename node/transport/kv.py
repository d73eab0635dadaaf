"""The DHT's key-value primitives every swarm record goes through: store one subkey, read a key's subkeys.

Below both the transport (node/transport/dht.py) and the record layer (node/transport/records.py); it
imports no hivemind: the DHT node is passed in."""

from __future__ import annotations

import asyncio
import logging
import random

log = logging.getLogger(__name__)

MAX_VALUES_PER_KEY = 256  # peers read per key and round: bounds the work a flood of subkeys can cause


async def store_value(dht, key: str, value: bytes, expiration_time: float, subkey: str, timeout: float) -> bool:
    """Store one subkey's value; False when the DHT refused it or did not answer within `timeout`."""
    try:
        return await asyncio.wait_for(dht.store(key, value, expiration_time=expiration_time, subkey=subkey), timeout)
    except asyncio.TimeoutError:
        return False


async def read_values(dht, key: str, timeout: float) -> list[tuple[object, object]] | None:
    """Every (subkey, value) pair stored under a key; None if the DHT did not answer in time or the read raised.

    Our DHT peers hold at most records.MAX_KEY_BYTES per key, so their replies fit p2pd's 4 MiB message. A
    peer without that bound (an older node) may hold a flooded key whose reply does not fit: that read does not
    raise, hivemind's reply fails inside it and it returns this node's cached copy or nothing
    (benchmarks/notebook/2026-11-25-crowd.md)."""
    try:
        found = await asyncio.wait_for(dht.get(key, latest=True), timeout)
    except asyncio.TimeoutError:
        log.warning("the DHT did not answer for %s within %.0fs", key, timeout)
        return None
    except Exception as exc:  # noqa: BLE001 - a value hivemind cannot decode must cost one read, never the node
        log.warning("reading %s from the DHT failed: %s: %s", key, type(exc).__name__, exc)
        return None
    if found is None or not isinstance(found.value, dict):
        return []
    return [(subkey, entry.value) for subkey, entry in found.value.items()]


async def read_key(
    dht, key: str, timeout: float, limit: int | None = MAX_VALUES_PER_KEY
) -> list[tuple[object, object]]:
    """(subkey, value) pairs stored under a key, at most `limit` drawn at random (None: all), so that a flood of
    subkeys costs a bounded amount of checking and cannot push others out by coming first; none if the read failed."""
    pairs = await read_values(dht, key, timeout) or []
    if limit is not None and len(pairs) > limit:
        pairs = random.sample(pairs, limit)
    return pairs

"""Where a peer sees us: the one answer of the observed-address stream, so a node learns it is behind NAT.

A node that joins asks a few of its bootstrap peers, over a p2p stream of their daemon
(handler OBSERVED_ADDRESS_HANDLER, no request body), which address its connection came
from. Each answers one frame (node/transport/framing.py) holding the msgpack map

    {"v": OBSERVED_VERSION, "observed": "<multiaddr the stream's connection comes from>"}

It is STUN's question, asked over libp2p: the connection is authenticated, but the answer is
only what one peer says, so the asker trusts it only for its own choice (announce relayed or
outbound-only) and asks several. Unsigned: it is never stored or forwarded.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.refusals import Refusal
from protocol.validation import check_int, check_str, reject

OBSERVED_ADDRESS_HANDLER = "swarm-node/v1/observed-address"
OBSERVED_VERSION = 1
MAX_OBSERVED_BYTES = (
    512  # a multiaddr with a /p2p-circuit hop is ~200 characters; the frame is bounded before it is read
)
MAX_OBSERVED_CHARS = 256


def encode_observed(observed: str) -> bytes:
    return msgpack.packb({"v": OBSERVED_VERSION, "observed": observed})


def decode_observed(data: bytes) -> str:
    """The observed multiaddr, or ProtocolRejection for anything else."""
    if len(data) > MAX_OBSERVED_BYTES:
        reject(Refusal.TOO_LARGE, f"observed-address answer of {len(data)} bytes, limit {MAX_OBSERVED_BYTES}")
    try:
        obj: Any = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types; all mean the same to us
        reject(Refusal.NOT_MSGPACK, f"observed-address answer is not msgpack: {type(exc).__name__}")
    if type(obj) is not dict or set(obj) != {"v", "observed"}:
        reject(Refusal.BAD_STRUCTURE, "observed-address answer must be the map {v, observed}")
    if check_int(obj["v"], "v") != OBSERVED_VERSION:
        reject(Refusal.UNKNOWN_VERSION, f"observed-address version {obj['v']}, this node speaks {OBSERVED_VERSION}")
    observed = check_str(obj["observed"], "observed", MAX_OBSERVED_CHARS)
    if not observed.startswith("/"):
        reject(Refusal.BAD_VALUE, f"observed address {observed!r} is not a multiaddr")
    return observed

"""Pipeline calls: what a driver and stage servers say to each other over a p2p stream.

Torch-free, like the rest of `protocol/`: tensors cross as {dtype, shape, data} and
`node/pipeline/` converts them at the edge. One call is one stream (framing:
`node/transport/framing.py`, frame types `PipelineFrame`):

    caller -> CALL    msgpack StageCall
    server -> RESULT  msgpack StageResult          (or REFUSE {"reason", "detail"})

The stream's peer id is authenticated by libp2p, so a call cannot claim another sender;
calls are therefore not signed (the DHT announcements that say who serves what are, see
`protocol.messages.StageAnnouncement`). Every field is checked here with the same exact-type
rules as the envelope messages, before any tensor is built: the receiver's `PipelineLimits`
bound the tensors a call may carry (count, rank, dims, elements), so a peer cannot make
a server allocate more than a real call of its configured size would need. Finiteness of
float values is checked in `node/` (it needs the numbers), and refused with the same
vocabulary (`PipelineRefusal`, in protocol/refusals.py).

Operations (`StageCall.op`):
    forward   run `parts` of the stage on `tensors` ("input_ids" or "hidden", plus "position_ids"
              and "attention_mask"); with train=True the server keeps the autograd graph under
              `call_id` for one backward. Returns {"output"}: hidden states, or logits when the
              parts end with "head".
    backward  the gradient of the output of forward `call_id` ("grad"); returns {"grad"}: the
              gradient of its input hidden states (nothing when the input was token ids).
              Gradients accumulate in the server until `step`.
    step      apply the accumulated gradients (clip, optimizer step); returns info {"grad_norm", "step"}.
    infer     forward without a graph, through the session `call_id`'s KV cache (generation).
    end_session  drop the KV cache of session `call_id`.
    weights   the stage's current weights for `parts` (codec bytes in "weights"), with its step
              and last gradient norm: how a new replica copies a live one and how CheckFree
              reads a lost stage's neighbours.
    collect   the output of the last hop of a chained forward `call_id` (below), once, to the
              peer that the chain named as its `origin`. Returns {"output"}.

Chained calls (version 2; SWARM's servers pass activations to the next stage themselves).
A forward or backward may carry `origin` (the driver's p2p peer id) and `route`, the hops
after this one. The server runs its own call, then calls the first hop of `route` with its
output ("hidden") or its input's gradient ("grad") and the rest of the route, and answers
its caller once that onward call has answered: an empty result, or REFUSE `onward_failed`
when any later hop failed (the driver then sends the micro-batch hop by hop, which finds
the server at fault). The last hop of a forward keeps its output for `collect`. So a hidden
state crosses one link per hop instead of the driver's link twice. A server dials only
servers it finds in its own read of the signed stage announcements, by their peer id: a
caller cannot make it open a stream to an address of its choosing. Forwards of a chain are
kept for their backward under (origin, call id), not the stream's peer, because the
backward reaches each stage from the opposite neighbour; call ids carry a random part.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Self

from protocol.refusals import PipelineRefusal, ProtocolRejection, Refusal
from protocol.validation import check_fields, check_float, check_int, check_list, check_str, reject

# 2: chained forward/backward calls (StageCall.origin and .route) and the `collect` op
PIPELINE_VERSION = 2
OPS = ("forward", "backward", "step", "infer", "end_session", "weights", "collect")
CHAINED_OPS = ("forward", "backward")
PARTS = ("embed", "layers", "head")
# Element types a tensor may declare on the wire, with their sizes in bytes.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}
MAX_CALL_ID_CHARS = 64
MAX_FINGERPRINT_CHARS = 64
MAX_PEER_ID_CHARS = 64  # a base58 libp2p peer id (46-52 characters for the keys p2pd makes)
# a pass is at most num_stages + 2 hops (embed and head apart when CheckFree+ swaps), and num_stages <= 64
MAX_ROUTE_HOPS = 72


class PipelineFrame(enum.IntEnum):
    CALL = 1  # caller -> server: msgpack StageCall
    RESULT = 2  # server -> caller: msgpack StageResult
    REFUSE = 3  # server -> caller: msgpack {"reason": str, "detail": str}; the call failed


@dataclass(frozen=True)
class PipelineLimits:
    """What a stage server accepts in one call; derived from its model and config by `node/`."""

    max_tensors: int = 4  # tensors per call or result
    max_rank: int = 4  # dimensions per tensor
    max_dim: int = 1 << 20  # any one dimension
    max_elements: int = 64 << 20  # elements of one tensor
    max_weights_bytes: int = 1 << 30  # encoded weights in a `weights` result

    def frame_limit(self) -> int:
        """Longest CALL/RESULT frame a receiver reads: every tensor at its largest, plus headers."""
        return self.max_tensors * self.max_elements * 8 + self.max_weights_bytes + 64 * 1024


DEFAULT_PIPELINE_LIMITS = PipelineLimits()


@dataclass(frozen=True)
class WireTensor:
    """A tensor on the wire: little-endian values, row-major."""

    dtype: str  # a key of DTYPE_BYTES
    shape: list[int]  # 0..max_rank dimensions, each in [0, max_dim]
    data: bytes  # exactly prod(shape) * DTYPE_BYTES[dtype] bytes

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, obj: Any, limits: PipelineLimits, name: str = "tensor") -> Self:
        f = check_fields(obj, cls, minor=0)
        dtype = check_str(f["dtype"], f"{name}.dtype", 16)
        if dtype not in DTYPE_BYTES:
            reject(Refusal.BAD_VALUE, f"{name}.dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        shape = [
            check_int(d, f"{name}.shape", hi=limits.max_dim)
            for d in check_list(f["shape"], f"{name}.shape", limits.max_rank)
        ]
        elements = math.prod(shape)
        if elements > limits.max_elements:
            reject(Refusal.TOO_LARGE, f"{name} has {elements} elements, limit {limits.max_elements}")
        data = f["data"]
        if type(data) is not bytes:
            reject(Refusal.BAD_STRUCTURE, f"{name}.data must be bytes")
        if len(data) != elements * DTYPE_BYTES[dtype]:
            reject(
                Refusal.BAD_STRUCTURE,
                f"{name}.data has {len(data)} bytes, shape {shape} of {dtype} needs {elements * DTYPE_BYTES[dtype]}",
            )
        return cls(dtype=dtype, shape=shape, data=data)


def _parts_from_wire(obj: Any, name: str) -> list[str]:
    parts = check_list(obj, name, len(PARTS))
    for part in parts:
        if check_str(part, "part", 16) not in PARTS:
            reject(Refusal.BAD_VALUE, f"part {part!r} is not one of {PARTS}")
    if len(set(parts)) != len(parts):
        reject(Refusal.BAD_VALUE, f"{name} {parts} repeat a part")
    return parts


@dataclass(frozen=True)
class RouteHop:
    """One hop after this one in a chained call: which server (by its p2p peer id, looked up by the receiving server in
    its own read of the stage announcements) and the call it gets."""

    stage: int
    stage_fingerprint: str
    peer_id: str
    call_id: str
    parts: list[str]

    def to_wire(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "stage_fingerprint": self.stage_fingerprint,
            "peer_id": self.peer_id,
            "call_id": self.call_id,
            "parts": list(self.parts),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        f = check_fields(obj, cls, minor=0)
        return cls(
            stage=check_int(f["stage"], "route.stage", hi=4096),
            stage_fingerprint=check_str(f["stage_fingerprint"], "route.stage_fingerprint", MAX_FINGERPRINT_CHARS),
            peer_id=check_str(f["peer_id"], "route.peer_id", MAX_PEER_ID_CHARS),
            call_id=check_str(f["call_id"], "route.call_id", MAX_CALL_ID_CHARS),
            parts=_parts_from_wire(f["parts"], "route.parts"),
        )


def _tensors_from_wire(obj: Any, limits: PipelineLimits) -> dict[str, WireTensor]:
    if type(obj) is not dict:
        reject(Refusal.BAD_STRUCTURE, "tensors must be a map of name -> tensor")
    if len(obj) > limits.max_tensors:
        reject(Refusal.TOO_MANY_ITEMS, f"{len(obj)} tensors, limit {limits.max_tensors}")
    return {
        check_str(name, "tensor name", 32): WireTensor.from_wire(value, limits, name) for name, value in obj.items()
    }


@dataclass(frozen=True)
class StageCall:
    """One request to a stage server."""

    v: int  # PIPELINE_VERSION
    op: str  # one of OPS
    stage: int  # the stage index the caller believes the server serves
    stage_fingerprint: str  # the stage's fingerprint (model, split, index, shapes): refused if not the server's
    call_id: str  # micro-batch hop id (forward/backward), session id (infer/end_session) or step id; <= 64 chars
    parts: list[str]  # which parts of the stage to run, in order (a subset of PARTS); for `weights`: which to send
    train: bool  # forward: keep the graph for a backward
    tensors: dict[str, WireTensor]  # the op's inputs (see the module docstring)
    scale: float  # step: factor applied to the accumulated gradients before clipping (1.0 otherwise)
    lr_scale: float = 1.0  # step: factor on the server's configured learning rate (1.0: unchanged)
    origin: str = ""  # a chained forward/backward: the p2p peer id of the driver that started the chain ("": none)
    route: list[RouteHop] = field(default_factory=list)  # a chained forward/backward: the hops after this one
    extra: dict[str, Any] = field(default_factory=dict)  # reserved; must be empty in version 2

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": self.v,
            "op": self.op,
            "stage": self.stage,
            "stage_fingerprint": self.stage_fingerprint,
            "call_id": self.call_id,
            "parts": list(self.parts),
            "train": self.train,
            "tensors": {k: t.to_wire() for k, t in self.tensors.items()},
            "scale": self.scale,
            "lr_scale": self.lr_scale,
            "origin": self.origin,
            "route": [hop.to_wire() for hop in self.route],
            "extra": dict(self.extra),
        }

    @classmethod
    def from_wire(cls, obj: Any, limits: PipelineLimits = DEFAULT_PIPELINE_LIMITS) -> Self:
        f = check_fields(obj, cls, minor=0)
        if check_int(f["v"], "v") != PIPELINE_VERSION:
            reject(Refusal.UNKNOWN_VERSION, f"pipeline call version {f['v']}, this node speaks {PIPELINE_VERSION}")
        if check_str(f["op"], "op", 16) not in OPS:
            reject(Refusal.BAD_VALUE, f"op {f['op']!r} is not one of {OPS}")
        parts = _parts_from_wire(f["parts"], "parts")
        if type(f["train"]) is not bool:
            reject(Refusal.BAD_STRUCTURE, "train must be a boolean")
        if type(f["extra"]) is not dict or f["extra"]:
            reject(Refusal.BAD_STRUCTURE, f"extra must be an empty map in pipeline version {PIPELINE_VERSION}")
        origin = check_str(f["origin"], "origin", MAX_PEER_ID_CHARS)
        route = [RouteHop.from_wire(hop) for hop in check_list(f["route"], "route", MAX_ROUTE_HOPS)]
        if (origin or route) and f["op"] not in CHAINED_OPS:
            reject(Refusal.BAD_VALUE, f"only {CHAINED_OPS} calls are chained, not {f['op']!r}")
        if route and not origin:
            reject(Refusal.BAD_VALUE, "a route without an origin: its last hop would not know whom its output is for")
        return cls(
            v=f["v"],
            op=f["op"],
            stage=check_int(f["stage"], "stage", hi=4096),
            stage_fingerprint=check_str(f["stage_fingerprint"], "stage_fingerprint", MAX_FINGERPRINT_CHARS),
            call_id=check_str(f["call_id"], "call_id", MAX_CALL_ID_CHARS),
            parts=parts,
            train=f["train"],
            tensors=_tensors_from_wire(f["tensors"], limits),
            scale=check_float(f["scale"], "scale", lo=0.0, hi=1e6),
            lr_scale=check_float(f["lr_scale"], "lr_scale", lo=0.0, hi=100.0),
            origin=origin,
            route=route,
            extra={},
        )

    @property
    def chained(self) -> bool:
        return bool(self.origin)


@dataclass(frozen=True)
class StageResult:
    """A stage server's answer to a call."""

    v: int  # PIPELINE_VERSION
    tensors: dict[str, WireTensor]  # the op's outputs
    weights: bytes | None  # `weights`: node/weights/codec.py bytes of the requested parts (None otherwise)
    step: int  # the server's optimizer steps so far
    grad_norm: float  # the stage's last gradient norm (after clipping), 0.0 before its first step
    lr_scale: float  # the stage's current learning-rate factor (1.1 after a CheckFree recovery)

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": self.v,
            "tensors": {k: t.to_wire() for k, t in self.tensors.items()},
            "weights": self.weights,
            "step": self.step,
            "grad_norm": self.grad_norm,
            "lr_scale": self.lr_scale,
        }

    @classmethod
    def from_wire(cls, obj: Any, limits: PipelineLimits = DEFAULT_PIPELINE_LIMITS) -> Self:
        f = check_fields(obj, cls, minor=0)
        if check_int(f["v"], "v") != PIPELINE_VERSION:
            reject(Refusal.UNKNOWN_VERSION, f"pipeline result version {f['v']}, this node speaks {PIPELINE_VERSION}")
        weights = f["weights"]
        if weights is not None and (type(weights) is not bytes or len(weights) > limits.max_weights_bytes):
            reject(Refusal.BAD_STRUCTURE, "weights must be bytes within the limit, or nil")
        return cls(
            v=f["v"],
            tensors=_tensors_from_wire(f["tensors"], limits),
            weights=weights,
            step=check_int(f["step"], "step"),
            grad_norm=check_float(f["grad_norm"], "grad_norm", lo=0.0),
            lr_scale=check_float(f["lr_scale"], "lr_scale", lo=0.0, hi=100.0),
        )


def refusal_body(reason: PipelineRefusal | Refusal | str, detail: str = "") -> dict[str, str]:
    """The REFUSE frame's map (the caller msgpack-packs it)."""
    code = reason.value if isinstance(reason, enum.Enum) else str(reason)
    return {"reason": code[:32], "detail": detail[:500]}


def parse_refusal(obj: Any) -> tuple[str, str]:
    """(reason, detail) of a REFUSE frame's decoded map; ("unparsable", "") for anything else."""
    if type(obj) is not dict or type(obj.get("reason")) is not str:
        return "unparsable", ""
    detail = obj.get("detail")
    return obj["reason"][:32], detail[:500] if type(detail) is str else ""


__all__ = [
    "CHAINED_OPS",
    "DEFAULT_PIPELINE_LIMITS",
    "DTYPE_BYTES",
    "OPS",
    "PARTS",
    "PIPELINE_VERSION",
    "PipelineFrame",
    "PipelineLimits",
    "ProtocolRejection",
    "RouteHop",
    "StageCall",
    "StageResult",
    "WireTensor",
    "parse_refusal",
    "refusal_body",
]

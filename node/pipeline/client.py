"""Calling a stage server: one call per p2p stream, bounded, with a deadline.

Used by the driver (forward, backward, step, inference sessions) and by stage servers
themselves (a new replica copying a live one; a recovery reading its neighbours).
Any way a call can fail — no connection, a broken or silent stream, a malformed answer,
a refusal — ends as `HopFailed`, whose `reason` is a short code for counters, so that
the caller's only decision is "try another replica of that stage".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgpack

from node.transport.joining import key_prefix
from node.transport.framing import STREAM_FAILED, open_stream, read_frame, stream_failure, write_frame
from protocol import ProtocolRejection, StageAnnouncement
from protocol.pipeline import PIPELINE_VERSION, PipelineFrame, PipelineLimits, StageCall, StageResult, parse_refusal

CONTROL_MAX_BYTES = 64 * 1024
# Tries of a call whose stream broke: under load a p2p stream sometimes ends inside a live server's answer
BROKEN_STREAM_ATTEMPTS = 3


class HopFailed(Exception):
    """A call to one stage server did not produce a usable result."""

    def __init__(self, server: StageAnnouncement, reason: str, detail: str = "") -> None:
        super().__init__(
            f"stage {server.stage} server {server.node_id[:12]}: {reason}{': ' + detail if detail else ''}"
        )
        self.server = server
        self.reason = reason
        self.detail = detail

    @property
    def refused(self) -> bool:
        """The server answered with a refusal (it is alive), rather than not answering at all."""
        return self.reason.startswith("refused:")


def handler_name(swarm_id: str, model_fingerprint: str) -> str:
    """The p2p stream protocol of one model's pipeline calls."""
    return f"{key_prefix(swarm_id)}/pipeline/{model_fingerprint}/v{PIPELINE_VERSION}"


def unpack(body: bytes, limits: PipelineLimits) -> object:
    """msgpack-decode a frame body with caps no valid call exceeds (raises ValueError)."""
    items = max(limits.max_tensors, limits.max_rank, 64)
    return msgpack.unpackb(
        body,
        raw=False,
        strict_map_key=True,
        max_bin_len=limits.frame_limit(),
        max_str_len=4096,
        max_array_len=items,
        max_map_len=items,
        max_ext_len=0,
    )


async def call_stage(
    p2p, handler: str, server: StageAnnouncement, call: StageCall, limits: PipelineLimits, timeout: float
) -> StageResult:
    """Send `call` to `server` and return its result; HopFailed for every failure."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await open_stream(p2p, server.p2p_peer_id, server.p2p_maddrs, handler, timeout)
            await write_frame(writer, PipelineFrame.CALL, msgpack.packb(call.to_wire(), use_bin_type=True))
            kind, body = await read_frame(
                reader,
                PipelineFrame,
                lambda k: limits.frame_limit() if k is PipelineFrame.RESULT else CONTROL_MAX_BYTES,
            )
    except TimeoutError:
        raise HopFailed(server, "timeout", f"no answer to {call.op} within {timeout:.0f}s") from None
    except STREAM_FAILED as exc:
        raise HopFailed(server, "unreachable", stream_failure(exc)) from None
    finally:
        if writer is not None:
            writer.close()
    try:
        decoded = unpack(body, limits)
    except ValueError as exc:
        raise HopFailed(server, "malformed", f"undecodable {kind.name}: {exc}") from None
    if kind is PipelineFrame.REFUSE:
        reason, detail = parse_refusal(decoded)
        raise HopFailed(server, f"refused:{reason}", detail)
    if kind is not PipelineFrame.RESULT:
        raise HopFailed(server, "malformed", f"expected RESULT, got {kind.name}")
    try:
        return StageResult.from_wire(decoded, limits)
    except ProtocolRejection as exc:
        raise HopFailed(server, "malformed", str(exc)) from None


async def until_answered(
    send: Callable[[], Awaitable[StageResult]], on_repeat: Callable[[HopFailed], None] = lambda failure: None
) -> StageResult:
    """`send()` again while its stream breaks (reason 'unreachable'), up to BROKEN_STREAM_ATTEMPTS tries, calling
    `on_repeat` before each repeat. Only for calls a server may receive twice: a forward (it runs again), a backward or
    a step (answered from memory: StageHandler), a `weights` read. A dead server fails every try at once (its daemon
    refuses the stream). A timeout is not repeated (the server is presumed dead, and another try would cost another
    call timeout), nor a refusal."""
    for _ in range(BROKEN_STREAM_ATTEMPTS - 1):
        try:
            return await send()
        except HopFailed as failure:
            if failure.reason != "unreachable":
                raise
            on_repeat(failure)
    return await send()

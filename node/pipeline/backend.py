"""A stage's torch work: forward (kept for its backward), backward, step, inference sessions, weights.

Petals keeps this apart from the wire (src/petals/server/backend.py): the backend sees decoded
calls and tensors, never streams or peers' bytes, so it is tested without a network
(tests/test_pipeline_backend.py). It is not thread-safe: the handler runs one call at a
time in a worker thread (`StageHandler`), which keeps the server's event loop free while a
step runs.

Every input tensor is checked against the model before torch sees it (`tensors.expect`);
a call this stage cannot serve raises `BackendRefused` with the refusal code the caller
gets.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from node.weights.codec import encode_weights
from node.config import PipelineConfig
from node.device import model_device
from node.pipeline.stages import PipelineStage, StagePlan, part_tensors
from node.pipeline.tensors import FLOATS, TensorRefused, expect
from protocol.pipeline import StageCall
from protocol.refusals import PipelineRefusal, Refusal


class BackendRefused(Exception):
    """A call this stage does not run, with the code the caller is refused with."""

    def __init__(self, reason: Refusal | PipelineRefusal, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class _Pending:
    """A forward kept for its backward."""

    inputs: torch.Tensor | None  # the input hidden states (requires grad), None when the input was token ids
    output: torch.Tensor
    batch: int
    created: float


class StageBackend:
    """One stage's weights, optimizer and per-caller state; calls are keyed by (caller, call id)."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        hf_config,
        plan: StagePlan,
        stage: PipelineStage,
        step: int = 0,
        lr_scale: float = 1.0,
    ) -> None:
        self.pipeline = pipeline
        self.hf_config = hf_config
        self.plan = plan
        self.stage = stage
        # where the stage's weights are (the server placed them: node/device.py); each call's tensors come off the wire
        # on the CPU and are moved here, and its results go back to the CPU for the wire (node/pipeline/tensors.py)
        self.device = model_device(stage)
        self.index = stage.index
        self.max_len = pipeline.max_sequence_length or hf_config.max_position_embeddings
        # hidden states and their gradients leave in this dtype (pipeline.wire_dtype); any float dtype is accepted and
        # cast to the stage's own on arrival, so that a driver relays what it gets whatever its own setting
        self.wire_dtype = getattr(torch, pipeline.wire_dtype)
        self.step = step
        self.lr_scale = lr_scale
        self.grad_norm = 0.0
        self.samples_per_s = 0.0
        self.optimizer = self.new_optimizer()
        self._pending: OrderedDict[tuple[str, str], _Pending] = OrderedDict()
        self._sessions: OrderedDict[tuple[str, str], tuple[object, float]] = OrderedDict()

    def new_optimizer(self) -> torch.optim.Optimizer:
        """A fresh AdamW (a recovered stage starts with one, as CheckFree prescribes)."""
        return torch.optim.AdamW(
            self.stage.parameters(), lr=self.pipeline.lr * self.lr_scale, weight_decay=self.pipeline.weight_decay
        )

    @property
    def pending_forwards(self) -> int:
        return len(self._pending)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def owned_parts(self) -> set[str]:
        """Parts calls may run: this stage's own (its CheckFree+ copies of a neighbour's part are only read by
        `weights`)."""
        return {p.value for p in self.plan.parts(self.index)}

    def held_parts(self) -> set[str]:
        return {p.value for p in self.stage.parts}

    def expire(self) -> None:
        """Drop kept forwards and sessions unused for `pending_ttl_s` (a caller that died never sends their end)."""
        deadline = time.monotonic() - self.pipeline.pending_ttl_s
        while self._pending and next(iter(self._pending.values())).created < deadline:
            self._pending.popitem(last=False)
        while self._sessions and next(iter(self._sessions.values()))[1] < deadline:
            self._sessions.popitem(last=False)

    # calls --------------------------------------------------------------------------------

    def forward(self, caller: str, call: StageCall) -> dict[str, torch.Tensor]:
        if not call.parts:
            raise BackendRefused(PipelineRefusal.BAD_TENSOR, "a forward needs at least one part")
        x, positions, mask = self._inputs(call, call.parts[0])
        if not call.train:
            with torch.no_grad():
                return {"output": self._for_wire(call.parts, self._run_parts(call.parts, x, positions, mask))}
        self._pending.pop((caller, call.call_id), None)  # a repeat of a call whose answer was lost: run it again
        if len(self._pending) >= self.pipeline.max_pending_forwards:
            raise BackendRefused(PipelineRefusal.BUSY, f"{len(self._pending)} forwards await their backward")
        started = time.perf_counter()
        inputs = None
        if call.parts[0] != "embed":
            inputs = x.requires_grad_(True)
        self.stage.train()
        output = self._run_parts(call.parts, x, positions, mask)
        self._pending[(caller, call.call_id)] = _Pending(
            inputs=inputs, output=output, batch=x.shape[0], created=time.monotonic()
        )
        self._note_throughput(x.shape[0], time.perf_counter() - started)
        return {"output": self._for_wire(call.parts, output.detach())}

    def backward(self, caller: str, call: StageCall) -> dict[str, torch.Tensor]:
        pending = self._pending.pop((caller, call.call_id), None)
        if pending is None:
            raise BackendRefused(PipelineRefusal.UNKNOWN_CALL, f"no forward {call.call_id!r} from this caller")
        grad = self._expect(call.tensors, "grad", FLOATS, tuple(pending.output.shape), cast=pending.output.dtype)
        pending.output.backward(grad)
        return {} if pending.inputs is None else {"grad": pending.inputs.grad.to(self.wire_dtype)}

    def apply_step(self, scale: float, lr_scale: float) -> bool:
        """Clip and apply the accumulated gradients (scale 0: the driver abandoned the step, drop them). True if
        stepped."""
        params = [p for p in self.stage.parameters() if p.grad is not None]
        if scale == 0.0 or not params:
            self.optimizer.zero_grad(set_to_none=True)
            return False
        for p in params:
            p.grad.mul_(scale)
        norm = torch.nn.utils.clip_grad_norm_(params, self.pipeline.max_grad_norm)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm at step {self.step}; step refused")
        for group in self.optimizer.param_groups:
            group["lr"] = self.pipeline.lr * self.lr_scale * lr_scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_norm = min(float(norm), self.pipeline.max_grad_norm)
        self.step += 1
        return True

    def infer(self, caller: str, call: StageCall) -> dict[str, torch.Tensor]:
        key = (caller, call.call_id)
        cache = self._sessions.pop(key, (None, 0.0))[0]
        if cache is None:
            if len(self._sessions) >= self.pipeline.max_sessions:
                raise BackendRefused(PipelineRefusal.BUSY, f"{len(self._sessions)} inference sessions open")
            cache = self.stage.new_cache()
        x, positions, mask = self._inputs(call, call.parts[0] if call.parts else "", cached_len=cache.seq_len)
        self.stage.eval()
        with torch.no_grad():
            output = self._run_parts(call.parts, x, positions, mask, cache=cache)
        self._sessions[key] = (cache, time.monotonic())
        return {"output": self._for_wire(call.parts, output)}

    def end_session(self, caller: str, call: StageCall) -> dict[str, torch.Tensor]:
        self._sessions.pop((caller, call.call_id), None)
        return {}

    def weights(self, parts: list[str]) -> bytes:
        """The codec bytes of `parts` (all held parts when empty), as a `weights` result carries them."""
        return encode_weights(part_tensors(self.stage, parts or [p.value for p in self.stage.parts]), "fp32").to_bytes()

    # helpers ------------------------------------------------------------------------------

    def _for_wire(self, parts: list[str], output: torch.Tensor) -> torch.Tensor:
        """Hidden states travel in the wire dtype; logits (parts ending with the head) in the stage's own."""
        return output if parts and parts[-1] == "head" else output.to(self.wire_dtype)

    def _expect(self, tensors, name: str, dtype, shape, cast: torch.dtype | None = None) -> torch.Tensor:
        """The named input, checked, on this stage's device (and in `cast`, if given)."""
        try:
            return expect(tensors, name, dtype, shape).to(self.device, dtype=cast)
        except TensorRefused as exc:
            raise BackendRefused(exc.reason, exc.detail) from None

    def _inputs(
        self, call: StageCall, first_part: str, cached_len: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids or hidden states, position ids, attention mask), each checked against this model."""
        tensors = call.tensors
        hidden_dtype = next(self.stage.parameters()).dtype
        if first_part == "embed":
            x = self._expect(tensors, "input_ids", torch.int64, (None, None))
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.hf_config.vocab_size):
                raise BackendRefused(PipelineRefusal.BAD_TENSOR, f"input_ids outside [0, {self.hf_config.vocab_size})")
        elif first_part in ("layers", "head"):
            x = self._expect(tensors, "hidden", FLOATS, (None, None, self.hf_config.hidden_size), cast=hidden_dtype)
        else:
            raise BackendRefused(PipelineRefusal.BAD_TENSOR, "a call needs at least one part")
        batch, length = x.shape[0], x.shape[1]
        if not 0 < batch <= self.pipeline.max_batch_size or not 0 < length or cached_len + length > self.max_len:
            raise BackendRefused(
                PipelineRefusal.BAD_TENSOR,
                f"batch {batch} x {cached_len}+{length} tokens is outside this server's limits "
                f"({self.pipeline.max_batch_size} x {self.max_len})",
            )
        positions = self._expect(tensors, "position_ids", torch.int64, (batch, length))
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.max_len):
            raise BackendRefused(PipelineRefusal.BAD_TENSOR, "position_ids out of range")
        mask = self._expect(tensors, "attention_mask", torch.int64, (batch, cached_len + length))
        return x, positions, mask

    def _run_parts(
        self, parts: list[str], x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None
    ) -> torch.Tensor:
        for part in parts:
            if part == "embed":
                x = self.stage.embed(x)
            elif part == "layers":
                x = self.stage.forward_layers(x, positions, mask, cache=cache)
            else:
                x = self.stage.head(x)
        return x

    def _note_throughput(self, sequences: int, seconds: float) -> None:
        rate = sequences / max(seconds, 1e-6)
        self.samples_per_s = rate if self.samples_per_s == 0 else 0.9 * self.samples_per_s + 0.1 * rate

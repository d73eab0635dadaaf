"""A stage's torch work without a network (node/pipeline/backend.py): forward/backward/step equal the whole model's,
and calls it cannot serve are refused with the caller's refusal code."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from node.config import PipelineConfig
from node.pipeline.backend import BackendRefused, StageBackend
from node.pipeline.stages import split_model
from node.pipeline.tensors import to_wire
from protocol.pipeline import PIPELINE_VERSION, StageCall
from protocol.refusals import PipelineRefusal

B, T, HIDDEN = 2, 5, 32


def model():
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def backends(pipeline: PipelineConfig) -> tuple[torch.nn.Module, list[StageBackend]]:
    whole = model()
    stages = split_model(whole, 3)
    return whole, [StageBackend(pipeline, whole.config, stage.plan, stage) for stage in stages]


def call(op: str, stage: int, call_id: str = "c", parts=("layers",), train: bool = True, **tensors) -> StageCall:
    return StageCall(
        v=PIPELINE_VERSION,
        op=op,
        stage=stage,
        stage_fingerprint="fp",
        call_id=call_id,
        parts=list(parts),
        train=train,
        tensors={k: to_wire(v) for k, v in tensors.items()},
        scale=1.0,
    )


def inputs(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "position_ids": torch.arange(T).expand(B, T).contiguous(),
        "attention_mask": torch.ones(B, T, dtype=torch.long),
    }


def test_a_chain_of_backends_trains_like_the_whole_model():
    pipeline = PipelineConfig(max_grad_norm=1e9)  # no clipping before the gradients are compared
    whole, chain = backends(pipeline)
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    extra = inputs(ids)
    x = chain[0].forward("driver", call("forward", 0, parts=("embed", "layers"), input_ids=ids, **extra))["output"]
    x = chain[1].forward("driver", call("forward", 1, hidden=x, **extra))["output"]
    logits = chain[2].forward("driver", call("forward", 2, parts=("layers", "head"), hidden=x, **extra))["output"]
    reference = whole(input_ids=ids, **extra).logits
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    grad = torch.ones_like(logits)
    g = chain[2].backward("driver", call("backward", 2, parts=("layers", "head"), grad=grad))["grad"]
    g = chain[1].backward("driver", call("backward", 1, grad=g))["grad"]
    assert chain[0].backward("driver", call("backward", 0, parts=("embed", "layers"), grad=g)) == {}
    reference.backward(grad)
    torch.testing.assert_close(
        chain[1].stage.layers[0].mlp.up_proj.weight.grad,
        whole.model.layers[1].mlp.up_proj.weight.grad,
        atol=1e-4,
        rtol=1e-4,
    )
    assert all(b.apply_step(1.0, 1.0) for b in chain)
    assert [b.step for b in chain] == [1, 1, 1] and all(b.grad_norm > 0 for b in chain)
    assert chain[1].samples_per_s > 0 and chain[1].pending_forwards == 0


def test_an_abandoned_step_drops_the_gradients():
    _, chain = backends(PipelineConfig())
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(2))
    out = chain[0].forward("driver", call("forward", 0, parts=("embed", "layers"), input_ids=ids, **inputs(ids)))[
        "output"
    ]
    chain[0].backward("driver", call("backward", 0, parts=("embed", "layers"), grad=torch.ones_like(out)))
    assert not chain[0].apply_step(0.0, 1.0)
    assert chain[0].step == 0 and all(p.grad is None for p in chain[0].stage.parameters())


def test_calls_the_backend_cannot_serve_are_refused_with_their_code():
    _, chain = backends(PipelineConfig(max_pending_forwards=1, max_batch_size=2))
    middle = chain[1]
    hidden = torch.randn(B, T, HIDDEN)
    extra = inputs(hidden)

    def refused(run, *args) -> PipelineRefusal:
        with pytest.raises(BackendRefused) as refusal:
            run(*args)
        return refusal.value.reason

    nan = hidden.clone()
    nan[0, 0, 0] = float("nan")
    assert refused(middle.forward, "p", call("forward", 1, hidden=nan, **extra)) is PipelineRefusal.BAD_TENSOR
    assert (
        refused(middle.forward, "p", call("forward", 1, hidden=torch.randn(3, T, HIDDEN), **extra))
        is PipelineRefusal.BAD_TENSOR
    )
    assert (
        refused(middle.backward, "p", call("backward", 1, call_id="never", grad=hidden)) is PipelineRefusal.UNKNOWN_CALL
    )
    middle.forward("p", call("forward", 1, call_id="kept", hidden=hidden, **extra))
    assert (
        refused(middle.forward, "p", call("forward", 1, call_id="more", hidden=hidden, **extra)) is PipelineRefusal.BUSY
    )
    assert (
        refused(middle.backward, "someone else", call("backward", 1, call_id="kept", grad=hidden))
        is PipelineRefusal.UNKNOWN_CALL
    )
    assert middle.owned_parts() == {"layers"}


def test_inference_sessions_keep_their_cache_until_ended():
    _, chain = backends(PipelineConfig(max_sessions=1))
    hidden = torch.randn(B, T, HIDDEN)
    middle = chain[1]
    middle.infer("p", call("infer", 1, call_id="s1", train=False, hidden=hidden, **inputs(hidden)))
    step = {"position_ids": torch.full((B, 1), T), "attention_mask": torch.ones(B, T + 1, dtype=torch.long)}
    assert middle.infer("p", call("infer", 1, call_id="s1", train=False, hidden=torch.randn(B, 1, HIDDEN), **step))[
        "output"
    ].shape == (B, 1, HIDDEN)
    with pytest.raises(BackendRefused):
        middle.infer("p", call("infer", 1, call_id="s2", train=False, hidden=hidden, **inputs(hidden)))
    middle.end_session("p", call("end_session", 1, call_id="s1"))
    assert middle.sessions == 0


def test_hidden_states_and_their_gradients_travel_in_the_wire_dtype_and_logits_do_not():
    """pipeline.wire_dtype bfloat16: a stage's hidden output and its input's gradient leave as bfloat16 (2 bytes a
    value), the head's logits as float32; a receiver casts any float dtype to its own. bfloat16 keeps 8 significant
    bits: 1 + 2^-8 rounds to 1 (a tie, to even), 1 + 2^-7 and 3 are exact."""
    from node.pipeline.tensors import from_wire

    whole, chain = backends(PipelineConfig(wire_dtype="bfloat16", max_grad_norm=1e9))
    assert chain[1]._for_wire(["layers"], torch.tensor([1 + 2**-8, 1 + 2**-7, 3.0])).tolist() == [1.0, 1 + 2**-7, 3.0]
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    extra = inputs(ids)
    x = chain[0].forward("driver", call("forward", 0, parts=("embed", "layers"), input_ids=ids, **extra))["output"]
    assert x.dtype is torch.bfloat16 and len(to_wire(x).data) == B * T * HIDDEN * 2
    x = chain[1].forward("driver", call("forward", 1, hidden=x, **extra))["output"]
    logits = chain[2].forward("driver", call("forward", 2, parts=("layers", "head"), hidden=x, **extra))["output"]
    assert logits.dtype is torch.float32
    # bfloat16 between stages: close to the whole model, not equal
    torch.testing.assert_close(logits, whole(input_ids=ids, **extra).logits, atol=0.05, rtol=0.05)
    g = chain[2].backward("driver", call("backward", 2, parts=("layers", "head"), grad=torch.ones_like(logits)))
    assert g["grad"].dtype is torch.bfloat16
    # a float32 gradient into a bfloat16-wire server is accepted (a driver relays what it got, whatever its setting)
    g = chain[1].backward("driver", call("backward", 1, grad=from_wire(to_wire(g["grad"])).float()))["grad"]
    assert g.dtype is torch.bfloat16 and chain[1].stage.layers[0].mlp.up_proj.weight.grad.dtype is torch.float32
    assert chain[0].backward("driver", call("backward", 0, parts=("embed", "layers"), grad=g)) == {}
    assert all(b.apply_step(1.0, 1.0) for b in chain)


def test_a_hidden_state_of_an_integer_dtype_is_refused():
    _, chain = backends(PipelineConfig())
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    wrong = call("forward", 1, hidden=torch.zeros(B, T, HIDDEN, dtype=torch.int32), **inputs(ids))
    with pytest.raises(BackendRefused) as refusal:
        chain[1].forward("p", wrong)
    assert refusal.value.reason is PipelineRefusal.BAD_TENSOR and "int32" in refusal.value.detail


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_non_finite_value_is_refused_in_every_wire_dtype_and_every_finite_one_kept(dtype):
    """The receiving check reads the wire's own bytes (bfloat16 as its bit patterns): a NaN or an infinity of
    either sign anywhere is refused; the largest and smallest finite values, a subnormal and -0 arrive unchanged."""
    from node.pipeline.tensors import FLOATS, TensorRefused, expect

    finfo = torch.finfo(dtype)
    kept = torch.tensor([finfo.max, finfo.min, finfo.tiny / 4, -0.0, 1.5], dtype=dtype)
    arrived = expect({"x": to_wire(kept)}, "x", FLOATS, (5,))
    assert arrived.dtype is dtype and torch.equal(arrived, kept) and arrived[3].signbit()
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 4):
            spoiled = kept.clone()
            spoiled[where] = bad
            with pytest.raises(TensorRefused, match="not finite"):
                expect({"x": to_wire(spoiled)}, "x", FLOATS, (5,))


def test_a_repeated_step_call_is_answered_without_being_applied_twice():
    """A driver whose stream broke before the answer came sends the same step call again (PipelineRouter.step): the
    server that applied it answers the repeat with the first answer; another call id, or another caller, steps."""
    import asyncio

    from node.pipeline.handler import StageHandler
    from protocol.pipeline import DEFAULT_PIPELINE_LIMITS

    _, chain = backends(PipelineConfig())
    handler = StageHandler(DEFAULT_PIPELINE_LIMITS)
    handler.backend, handler.fingerprint, handler.state = chain[0], "fp", "serving"
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(3))

    def accumulate(call_id: str) -> None:
        out = chain[0].forward("driver", call("forward", 0, call_id, ("embed", "layers"), input_ids=ids, **inputs(ids)))
        chain[0].backward(
            "driver", call("backward", 0, call_id, ("embed", "layers"), grad=torch.ones_like(out["output"]))
        )

    async def steps():
        accumulate("m1")
        first = await handler.serve("driver", call("step", 0, "step-1", ("embed", "layers")))
        weights = [p.detach().clone() for p in chain[0].stage.parameters()]
        accumulate("m2")  # gradients the repeat must leave alone
        again = await handler.serve("driver", call("step", 0, "step-1", ("embed", "layers")))
        assert again == first and chain[0].step == 1
        assert all(torch.equal(a, b) for a, b in zip(weights, chain[0].stage.parameters()))
        assert any(p.grad is not None for p in chain[0].stage.parameters())
        other = await handler.serve("driver", call("step", 0, "step-2", ("embed", "layers")))
        assert chain[0].step == 2 and other.step == 2
        accumulate("m3")
        await handler.serve("another-driver", call("step", 0, "step-2", ("embed", "layers")))
        assert chain[0].step == 3

    asyncio.run(steps())


def test_a_repeated_backward_call_is_answered_without_accumulating_twice_and_a_repeated_forward_runs_again():
    """A driver whose stream broke inside the answer sends the same call again (PipelineRouter.call_until_answered):
    a repeated backward gets the first answer and leaves the accumulated gradients as one backward left them; a
    repeated forward runs again, replacing the graph the first one kept (one backward consumes it), even where the
    server keeps no more graphs than that one."""
    import asyncio

    from node.pipeline.handler import StageHandler
    from protocol.pipeline import DEFAULT_PIPELINE_LIMITS

    _, chain = backends(PipelineConfig(max_pending_forwards=1))
    handler = StageHandler(DEFAULT_PIPELINE_LIMITS)
    handler.backend, handler.fingerprint, handler.state = chain[1], "fp", "serving"
    hidden = torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(4))
    grad = torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(5))

    def grads() -> list[torch.Tensor]:
        return [p.grad.clone() for p in chain[1].stage.parameters()]

    async def calls():
        forward = call("forward", 1, "m1", hidden=hidden, **inputs(hidden))
        first_out = await handler.serve("driver", forward)
        again_out = await handler.serve("driver", forward)  # its answer was lost: it runs again
        assert again_out == first_out and chain[1].pending_forwards == 1
        first = await handler.serve("driver", call("backward", 1, "m1", grad=grad))
        once = grads()
        again = await handler.serve("driver", call("backward", 1, "m1", grad=grad))
        assert again == first and "grad" in first.tensors
        assert all(torch.equal(a, b) for a, b in zip(once, grads()))  # not accumulated twice
        # another caller's call of the same id is its own: it has no forward here, so it is refused
        with pytest.raises(BackendRefused) as refused:
            await handler.serve("another-driver", call("backward", 1, "m1", grad=grad))
        assert refused.value.reason is PipelineRefusal.UNKNOWN_CALL

    asyncio.run(calls())


def test_a_served_call_reports_its_worker_threads_cpu_and_page_faults_within_its_wall_time():
    """`timing` gets what the torch work cost the worker thread that ran it (COMPUTE_WORK), beside its wall time: the
    thread's CPU seconds, which no single thread can spend faster than the wall clock runs, and its minor page faults
    (a count). Measured on the event loop's thread instead, the CPU would be about nothing."""
    import asyncio

    from node.pipeline.handler import COMPUTE_WORK, StageHandler
    from protocol.pipeline import DEFAULT_PIPELINE_LIMITS

    _, chain = backends(PipelineConfig())
    handler = StageHandler(DEFAULT_PIPELINE_LIMITS)
    handler.backend, handler.fingerprint, handler.state = chain[0], "fp", "serving"
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(5))
    timing: dict[str, float] = {}
    forward = call("forward", 0, "m1", ("embed", "layers"), input_ids=ids, **inputs(ids))
    asyncio.run(handler.serve("driver", forward, timing))
    assert set(COMPUTE_WORK) <= set(timing)
    assert 0 < timing["compute_cpu"] <= timing["compute"]
    assert isinstance(timing["compute_faults"], int) and timing["compute_faults"] >= 0

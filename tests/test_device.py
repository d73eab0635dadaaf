"""model.device and model.dtype (node/device.py): the config's errors, where the policy is placed, and every tensor path
checked on this CPU-only machine by tests/helpers/devices.py: a tensor left on the CPU next to the policy's fails here
as it would on a GPU."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager

import pytest
import torch

from node.config import ConfigError, ModelConfig, load_config
from node.device import DeviceError, model_device, resolve_device
from node.loop import Node
from node.model import build_char_tokenizer, build_default_model, ensure_default_model, load_policy
from node.trainer import GRPOTrainer
from tests.helpers.devices import POLICY_DEVICE, WrongDevice, policy_device_checked

META = torch.device("meta")  # where a placement test puts the policy: tensors there have a device and no data

# the config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "CPU", "mps", "cuda:0 "])
def test_an_unknown_device_is_one_readable_line(value):
    with pytest.raises(ConfigError, match=r"^invalid config: model\.device: must be auto, cpu, cuda or cuda:N") as err:
        load_config(None, [f"model.device={json.dumps(value)}"])
    assert "\n" not in str(err.value)


def test_auto_is_the_gpu_torch_sees_else_the_cpu(monkeypatch):
    assert resolve_device(ModelConfig()) == torch.device("cpu")  # this machine has none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(ModelConfig()) == torch.device("cuda", 0)  # without a flag
    assert resolve_device(ModelConfig(device="cpu")) == torch.device("cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_keeps_working_on_the_cpu(dtype):
    assert resolve_device(ModelConfig(device="cpu", dtype=dtype)) == torch.device("cpu")


def test_cuda_asked_where_there_is_none_stops_the_load_with_one_line(tiny_config):
    node = Node(tiny_config("model.device=cuda"))
    with pytest.raises(DeviceError, match=r"model\.device is 'cuda' but torch .* sees no CUDA device") as caught:
        node.load()
    assert "\n" not in str(caught.value) and isinstance(caught.value, ConfigError)  # the CLI prints it, exit code 2


def test_a_gpu_index_this_machine_lacks_and_bfloat16_where_the_gpu_cannot(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    with pytest.raises(DeviceError, match=r"model\.device is 'cuda:1' but this machine has 1 CUDA device"):
        resolve_device(ModelConfig(device="cuda:1"))
    with pytest.raises(DeviceError, match=r"bfloat16 is not supported on cuda:0 Tesla V100-SXM2-16GB: set model\."):
        resolve_device(ModelConfig(device="auto", dtype="bfloat16"))
    assert resolve_device(ModelConfig(device="cuda", dtype="float16")) == torch.device("cuda", 0)


def test_a_node_on_a_gpu_keeps_attention_off_cudnn_and_a_cpu_node_leaves_it(monkeypatch):
    """cuDNN's attention plans anew for every shape, and a node's shapes change every call: 4x slower bfloat16 rounds
    on an H200 (benchmarks/notebook/2026-11-27-gpu.md). Resolving a CUDA device turns it off; resolving the CPU changes
    nothing."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        resolve_device(ModelConfig(device="cpu", dtype="bfloat16"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        assert resolve_device(ModelConfig(device="cuda", dtype="bfloat16")) == torch.device("cuda", 0)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


# where the policy goes ----------------------------------------------------------------------------


def test_a_node_that_sees_a_gpu_sends_its_policy_there_without_a_flag(tiny_config, monkeypatch):
    """auto, with torch seeing a GPU: the policy is sent to cuda:0, which this CPU build of torch then refuses."""
    config = tiny_config()
    ensure_default_model(config, progress=False)  # built here first: only the policy's placement may meet the "GPU"
    node = Node(config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        node.load()


def test_the_policy_and_its_kl_reference_go_where_the_device_says(tiny_config):
    """Placement, on the meta device (a device that is not the CPU; it unties tied weights, which no real device
    does, so nothing is trained there): the loaded policy and the trainer's KL reference."""
    node = Node(tiny_config())
    node.load()
    node.save()
    model, tokenizer = load_policy(node.store.latest(), "bfloat16", META)
    assert {(p.device, p.dtype) for p in model.parameters()} == {(META, torch.bfloat16)} and model_device(model) == META
    trainer = GRPOTrainer(node.config.trainer.model_copy(update={"kl_beta": 0.1}), model, tokenizer.pad_token_id, 1.0)
    assert trainer.device == META and {p.device for p in trainer.reference.parameters()} == {META}


# the check itself --------------------------------------------------------------------------------


def test_the_check_fails_where_a_gpu_would_and_passes_where_it_would_not():
    layer = torch.nn.Linear(4, 3)
    with policy_device_checked(layer) as executor:
        with pytest.raises(WrongDevice, match="mixes the policy's device with the CPU"):
            layer(torch.zeros(2, 4))  # made without a device
        with pytest.raises(WrongDevice):
            layer(torch.from_numpy(torch.zeros(2, 4).numpy()))  # from numpy, as off the wire
        with pytest.raises(WrongDevice):
            executor.submit(layer, torch.ones(1, 4)).result()  # in the node's worker threads too
        assert model_device(layer) == POLICY_DEVICE  # the policy's device has a name of its own under the check
        with pytest.raises(WrongDevice):
            layer(torch.zeros(2, 4).to("cpu"))  # sent to the CPU, not to the policy's device
        out = layer(torch.zeros(2, 4).to(model_device(layer)))
        out = out * torch.tensor(2.0)  # a zero-dimensional CPU tensor is a scalar, on a GPU too
        host = torch.zeros(2, 3)
        host[:] = out  # a copy crosses devices
        with pytest.raises(WrongDevice, match="numpy"):
            out.detach().numpy()
        assert out.detach().cpu().numpy().shape == (2, 3)
    layer(torch.zeros(2, 4))  # outside the block nothing is checked


# every tensor path, under the check --------------------------------------------------------------


@contextmanager
def checked_node(node: Node):
    """`node`'s policy (and KL reference) on the policy's device; the node's worker threads checked too."""
    with policy_device_checked(node.model, node.trainer.reference) as executor:
        yield executor


async def _rounds(node: Node, executor, count: int) -> list[dict]:
    asyncio.get_running_loop().set_default_executor(executor)
    return [await node.run_round() for _ in range(count)]


def test_the_round_loop_keeps_every_tensor_with_the_policy(tiny_config):
    """Sampling (the KV-cache loop), the update with its KL reference, held-out evaluation, checkpoints: two rounds."""
    node = Node(tiny_config("trainer.kl_beta=0.1", "trainer.drop_uniform_groups=false", "eval_every=1"))
    node.load()
    with checked_node(node) as executor:
        rows = asyncio.run(_rounds(node, executor, 2))
    assert [r["policy_version"] for r in rows] == [1, 2] and all("heldout_accuracy" in r for r in rows)
    assert node.store.load_round(node.store.latest()) == 2


def test_a_swarm_round_recomputes_peers_log_probs_with_the_policy(tiny_config, tmp_path):
    """Two nodes through the in-process exchange (the real signing, decoding and re-scoring): b samples its own groups
    and trains on a's, whose log-probs it recomputes with its policy (off-policy, importance-weighted)."""
    from node.rollouts.base import Completion, RolloutGroup
    from tests.helpers.inprocess import in_process_nodes

    common = ["swarm.transport=dht", "swarm.external_questions=1", "trainer.drop_uniform_groups=false", "eval_every=0"]
    a, b = in_process_nodes(tiny_config, tmp_path, {"a": common, "b": common})
    question = a.tasks.batch(first_draw=0, count=1)[0]
    prompt_ids = a.tokenizer.encode(a.tasks.prompt(question), add_special_tokens=False)
    completions = []
    for text in (question.answer, question.answer + "1"):  # one right, one wrong: a learning signal
        ids = a.tokenizer.encode(text, add_special_tokens=False) + [a.tokenizer.eos_token_id]
        completions.append(Completion(prompt_ids, ids, text, [-0.5] * len(ids), "stop", policy_version=0))
    asyncio.run(a.transport.publish(1, 0, [RolloutGroup(question.spec, completions, [1.0, 0.0])]))
    with checked_node(b) as executor:
        [row] = asyncio.run(_rounds(b, executor, 1))
    assert row["external_questions"] == 1 and row["policy_version"] == 1
    assert "importance_weight_mean" in row  # a's completions were scored against b's policy


def test_the_warm_start_trains_on_the_policys_device(tiny_config):
    from node.warmstart import warm_start

    config = tiny_config("model.default.warmup_steps=2")
    tokenizer = build_char_tokenizer()
    model = build_default_model(config.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    before = model.lm_head.weight.detach().clone()
    with policy_device_checked(model):
        warm_start(model, tokenizer, config, progress=False)
    assert not torch.equal(before, model.lm_head.weight)


def test_the_pipeline_hop_moves_activations_to_the_stage_and_back(tiny_config):
    """Three stage servers' handlers, called as a driver calls them: token ids, activations and gradients arrive as
    wire tensors (numpy, on the CPU), are moved to each stage's device, and leave for the wire on the CPU; then a step
    and a KV-cached inference session."""
    from node.pipeline.backend import StageBackend
    from node.pipeline.handler import StageHandler
    from node.pipeline.stages import pipeline_limits, split_model
    from node.pipeline.tensors import to_wire
    from protocol.pipeline import PIPELINE_VERSION, StageCall

    config = tiny_config("model.default.num_layers=3")
    tokenizer = build_char_tokenizer()
    model = build_default_model(config.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    stages = split_model(model, 3)
    handlers = []

    def serve(stage):  # what a stage server does once its stage is loaded and placed
        handler = StageHandler(pipeline_limits(config, model.config, sum(p.numel() for p in model.parameters())))
        handler.backend = StageBackend(config.pipeline, model.config, stage.plan, stage)
        handler.fingerprint, handler.state = f"stage-{stage.index}", "serving"
        return handler

    parts = [["embed", "layers"], ["layers"], ["layers", "head"]]
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    extra = {"position_ids": torch.arange(4).expand(2, 4).contiguous(), "attention_mask": torch.ones(2, 4).long()}

    def call(op, stage, tensors, call_id="c1", train=True):
        return StageCall(
            v=PIPELINE_VERSION,
            op=op,
            stage=stage,
            stage_fingerprint=f"stage-{stage}",
            call_id=call_id,
            parts=parts[stage] if op in ("forward", "backward", "infer") else [],
            train=train,
            tensors=tensors,
            scale=1.0,
        )

    async def drive(executor):
        asyncio.get_running_loop().set_default_executor(executor)
        wire = {name: to_wire(t) for name, t in extra.items()}
        x = {"input_ids": to_wire(ids)}
        for i, handler in enumerate(handlers):
            x = {"hidden": (await handler.serve("driver", call("forward", i, {**x, **wire}))).tensors["output"]}
        logits = x["hidden"]
        grad = {"grad": to_wire(torch.ones(logits.shape) / 100)}
        for i in reversed(range(3)):
            result = await handlers[i].serve("driver", call("backward", i, grad))
            grad = result.tensors
        for i, handler in enumerate(handlers):
            await handler.serve("driver", call("step", i, {}))
        x = {"input_ids": to_wire(ids)}
        for i, handler in enumerate(handlers):
            result = await handler.serve("driver", call("infer", i, {**x, **wire}, call_id="s1", train=False))
            x = {"hidden": result.tensors["output"]}
        return logits, x["hidden"], [h.backend.step for h in handlers]

    with policy_device_checked(*stages) as executor:
        handlers.extend(serve(stage) for stage in stages)
        logits, inferred, steps = asyncio.run(drive(executor))
    assert logits.shape == [2, 4, len(tokenizer)] and inferred.shape == logits.shape and steps == [1, 1, 1]


def test_a_noloco_exchange_takes_the_weights_off_the_device_and_back(tiny_config):
    """The outer-step service with a partner whose weights come through the codec (as off the wire): the snapshot, the
    NoLoCo rule and the write-back, the policy on its device."""
    from node.averaging.outer import float_parameters
    from node.averaging.pairing import AveragingResult
    from node.averaging.service import OuterStepService
    from node.weights.codec import EncodedWeights, decode_weights, encode_weights

    config = tiny_config("swarm.transport=dht", "averaging.method=noloco", "averaging.every_steps=1")
    tokenizer = build_char_tokenizer()
    model = build_default_model(config.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    partner = {name: p.detach() + 0.01 for name, p in float_parameters(model).items()}

    class CodecPartner:
        refusals: dict = {}

        async def average(self, theta, round_id, timeout, find_within=None):
            sent = encode_weights(theta, "fp32").to_bytes()
            theirs = decode_weights(EncodedWeights.from_bytes(encode_weights(partner, "fp16").to_bytes()))
            ours = decode_weights(EncodedWeights.from_bytes(sent))
            mean = {name: (ours[name] + theirs[name]) / 2 for name in ours}
            return AveragingResult(mean, ["partner"], len(sent), len(sent), 0.0, round_id)

        async def stop(self):
            pass

    before = {name: p.detach().clone() for name, p in float_parameters(model).items()}

    async def exchange(executor):
        asyncio.get_running_loop().set_default_executor(executor)
        service = OuterStepService(config, model, CodecPartner())
        assert service.maybe_start(policy_version=1)
        await service.wait_exchange()
        return service.apply_if_done()

    with policy_device_checked(model) as executor:
        outcome = asyncio.run(exchange(executor))
    assert outcome["outcome"] == "averaged"
    assert all(not torch.equal(before[name], p) for name, p in float_parameters(model).items())


def test_weights_fetched_for_a_stage_are_compared_on_the_cpu():
    """A stage server checks a neighbour's weights against its own stage's (pipeline recovery, CheckFree+ replicas):
    the received ones arrive on the CPU, its own are on its device."""
    from node.weights.codec import EncodedWeights, decode_weights, encode_weights
    from node.weights.validation import validate_partner_weights

    stage = torch.nn.Linear(4, 3)
    ours = {name: t.detach() for name, t in stage.state_dict().items()}
    received = decode_weights(EncodedWeights.from_bytes(encode_weights(ours, "fp32").to_bytes()))
    with policy_device_checked(stage):
        validate_partner_weights({name: t.detach() for name, t in stage.state_dict().items()}, received, 0.5)


# checkpoints -----------------------------------------------------------------------------------


_WRITTEN_ON_A_GPU = False


def _as_if_on_a_gpu(storage) -> str | None:
    """torch.save's location tag for a storage while `_WRITTEN_ON_A_GPU`: what a GPU machine writes."""
    return "cuda:0" if _WRITTEN_ON_A_GPU else None


torch.serialization.register_package(1, _as_if_on_a_gpu, lambda storage, location: None)


@contextmanager
def written_on_a_gpu():
    global _WRITTEN_ON_A_GPU
    _WRITTEN_ON_A_GPU = True
    try:
        yield
    finally:
        _WRITTEN_ON_A_GPU = False


def test_a_checkpoint_written_on_a_gpu_resumes_on_a_machine_without_one(tiny_config, tmp_path):
    config = tiny_config("trainer.drop_uniform_groups=false", "eval_every=0", state_dir=tmp_path / "state")
    node = Node(config)
    node.load()
    asyncio.run(node.run_round())
    with written_on_a_gpu():
        node.save()
    with pytest.raises(RuntimeError, match="CUDA"):  # what a plain torch.load does with it here
        torch.load(node.store.latest() / "trainer.pt", weights_only=False)
    resumed = Node(config)
    resumed.load()
    assert resumed.round == 1 and resumed.trainer.optimizer.state
    moments = [s["exp_avg"] for s in resumed.trainer.optimizer.state.values()]
    assert {m.device for m in moments} == {model_device(resumed.model)}

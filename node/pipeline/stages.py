"""A causal LM cut into contiguous pipeline stages that each run alone on hidden states.

Stage i of S holds the decoder layers `StagePlan.layer_range(i)`; stage 0 also holds the
token embedding (EMBED) and stage S-1 the final norm and LM head (HEAD). A stage runs its
parts on what the previous stage sent: token ids for EMBED, hidden states for LAYERS.
Positions and masks travel with every call (position ids and the 2-D padding mask, as HF
models take them), and each stage builds the causal mask and the rotary embeddings itself
with transformers' own helpers, so left padding (the sampler) and right padding (the
trainer) give the same numbers as the whole model (tests/test_pipeline_stages.py).

Why these choices:
- Parts have names relative to themselves (`part_state_dict`): LAYERS of two stages of
  equal depth have identical names, so CheckFree can average stage i-1 and i+1 into i and
  CheckFree+ can copy stage 1 into stage 0.
- Tied embeddings are untied: stage 0 and stage S-1 live on different machines, and each
  trains its own copy (the whole model's gradient of the tied weight is the sum of the
  two copies' gradients, which the tests check).
- CheckFree+ replicas (`extra_parts`): stage 1 keeps a copy of the embedding and stage S-2
  a copy of the head, so that a lost end stage can be rebuilt from its neighbour alone.
- `StageCache` is a per-session KV cache (Petals' inference sessions): the copied layers are
  renumbered 0..k-1 so that one HF `DynamicCache` per stage holds exactly its layers. The cache
  is passed by the keyword the installed transformers names it: `cache` (5.24 deprecates
  `past_key_values`, to be removed in 5.40), `past_key_values` in older releases.
- What drivers and servers both need to know of a split (`stage_plan`, `expected_fingerprints`,
  `pipeline_limits`) lives here, so that a driver never imports the server.
"""

from __future__ import annotations

import copy
import enum
import functools
import hashlib
import inspect
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask

from node.config import NodeConfig
from protocol.pipeline import PipelineLimits


class StagePart(str, enum.Enum):
    """The pieces a stage can hold."""

    EMBED = "embed"
    LAYERS = "layers"
    HEAD = "head"  # final norm + LM head


@dataclass(frozen=True)
class StagePlan:
    """How a model of `num_layers` decoder layers is split into `num_stages` stages."""

    num_layers: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_stages > self.num_layers:
            raise ValueError(
                f"cannot split {self.num_layers} decoder layers into {self.num_stages} stages (1..{self.num_layers})"
            )

    def layer_range(self, index: int) -> range:
        """Contiguous layers of stage `index`; sizes differ by at most one, earlier stages get the extra."""
        if not 0 <= index < self.num_stages:
            raise ValueError(f"stage {index} is outside [0, {self.num_stages})")
        base, extra = divmod(self.num_layers, self.num_stages)
        start = index * base + min(index, extra)
        return range(start, start + base + (1 if index < extra else 0))

    def parts(self, index: int) -> tuple[StagePart, ...]:
        """The parts stage `index` owns (replicas of a neighbour's are extra)."""
        self.layer_range(index)
        parts = [StagePart.LAYERS]
        if index == 0:
            parts.insert(0, StagePart.EMBED)
        if index == self.num_stages - 1:
            parts.append(StagePart.HEAD)
        return tuple(parts)


def checkfree_plus_extra_parts(num_stages: int) -> dict[int, tuple[StagePart, ...]]:
    """CheckFree+ replicas: the embedding on stage 1 and the head on stage S-2 (S = 2: each end holds the other's)."""
    if num_stages < 2:
        return {}
    if num_stages == 2:
        return {0: (StagePart.HEAD,), 1: (StagePart.EMBED,)}
    extra: dict[int, tuple[StagePart, ...]] = {1: (StagePart.EMBED,)}
    extra[num_stages - 2] = extra.get(num_stages - 2, ()) + (StagePart.HEAD,)  # S = 3: stage 1 neighbours both ends
    return extra


class StageCache:
    """A per-session KV cache of one stage's layers."""

    def __init__(self) -> None:
        self.cache = DynamicCache()

    @property
    def seq_len(self) -> int:
        return self.cache.get_seq_length()


@functools.cache
def cache_keyword(function) -> str:
    """The keyword `function` takes the KV cache by: `cache` in current transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


def _decoder(model):
    """The decoder stack of an HF causal LM (Qwen2/Llama family: `model.model`)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise TypeError(
            f"{type(model).__name__} is not a decoder-only causal LM of the Llama/Qwen2 family (no model.layers / "
            "model.embed_tokens)"
        )
    return inner


class PipelineStage(torch.nn.Module):
    def __init__(
        self,
        hf_config,
        plan: StagePlan,
        index: int,
        parts: tuple[StagePart, ...],
        embed_tokens,
        layers,
        norm,
        lm_head,
        rotary_emb,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.plan = plan
        self.index = index
        self.parts = parts
        self.embed_tokens = embed_tokens
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary_emb = rotary_emb
        for local, layer in enumerate(self.layers):  # one DynamicCache per stage holds exactly these layers
            layer.self_attn.layer_idx = local

    @classmethod
    def from_model(cls, model, plan: StagePlan, index: int, extra_parts: tuple[StagePart, ...] = ()) -> "PipelineStage":
        """The stage's parts copied out of `model` (never sharing storage with it)."""
        decoder = _decoder(model)
        if plan.num_layers != len(decoder.layers):
            raise ValueError(f"the plan splits {plan.num_layers} layers, the model has {len(decoder.layers)}")
        parts = tuple(dict.fromkeys(plan.parts(index) + tuple(extra_parts)))
        embed = copy.deepcopy(decoder.embed_tokens) if StagePart.EMBED in parts else None
        head = StagePart.HEAD in parts
        lm_head = None
        if head:
            lm_head = torch.nn.Linear(
                model.lm_head.in_features,
                model.lm_head.out_features,
                bias=model.lm_head.bias is not None,
                dtype=model.lm_head.weight.dtype,
            )
            with torch.no_grad():
                # untied: a copy, even when the model ties it to the embedding
                lm_head.weight.copy_(model.lm_head.weight)
                if model.lm_head.bias is not None:
                    lm_head.bias.copy_(model.lm_head.bias)
        layers = [copy.deepcopy(decoder.layers[i]) for i in plan.layer_range(index)]
        return cls(
            model.config,
            plan,
            index,
            parts,
            embed,
            layers,
            copy.deepcopy(decoder.norm) if head else None,
            lm_head,
            copy.deepcopy(decoder.rotary_emb),
        )

    @classmethod
    def from_config(
        cls, hf_config, plan: StagePlan, index: int, extra_parts: tuple[StagePart, ...] = ()
    ) -> "PipelineStage":
        """A freshly initialised stage of this architecture (weights arrive later, or this is a random re-init)."""
        small = copy.deepcopy(hf_config)
        layers = plan.layer_range(index)
        small.num_hidden_layers = len(layers)
        if hasattr(small, "layer_types") and small.layer_types is not None:
            small.layer_types = [hf_config.layer_types[i] for i in layers]
        model = AutoModelForCausalLM.from_config(small)
        stage = cls.from_model(model, StagePlan(len(layers), 1), 0, ())
        parts = tuple(dict.fromkeys(plan.parts(index) + tuple(extra_parts)))
        return cls(
            hf_config,
            plan,
            index,
            parts,
            stage.embed_tokens if StagePart.EMBED in parts else None,
            list(stage.layers),
            stage.norm if StagePart.HEAD in parts else None,
            stage.lm_head if StagePart.HEAD in parts else None,
            stage.rotary_emb,
        )

    # running ----------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise ValueError(f"stage {self.index} holds no embedding")
        return self.embed_tokens(input_ids)

    def forward_layers(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: StageCache | None = None,
    ) -> torch.Tensor:
        """This stage's decoder layers; `attention_mask` is the 2-D padding mask over past + current tokens."""
        past = cache.cache if cache is not None else None
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{cache_keyword(create_causal_mask): past},
        )
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=past is not None,
                **{cache_keyword(type(layer).forward): past},
            )
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] in the model's dtype."""
        if self.lm_head is None:
            raise ValueError(f"stage {self.index} holds no head")
        return self.lm_head(self.norm(hidden))

    def new_cache(self) -> StageCache:
        return StageCache()

    # weights ----------------------------------------------------------------------------

    def _module(self, part: StagePart) -> torch.nn.Module:
        if part not in self.parts:
            raise ValueError(f"stage {self.index} does not hold {part.value}")
        if part is StagePart.EMBED:
            return self.embed_tokens
        if part is StagePart.LAYERS:
            return self.layers
        return torch.nn.ModuleDict({"norm": self.norm, "lm_head": self.lm_head})

    def parameters_of(self, part: StagePart) -> list[torch.nn.Parameter]:
        return list(self._module(part).parameters())

    def part_state_dict(self, part: StagePart) -> dict[str, torch.Tensor]:
        """Tensors of `part`, named relative to it (equal names for LAYERS of equal depth)."""
        return {name: tensor.detach().clone() for name, tensor in self._module(part).state_dict().items()}

    def load_part_state_dict(self, part: StagePart, tensors: dict[str, torch.Tensor]) -> None:
        """Strict: every name, shape and dtype must match."""
        module = self._module(part)
        mine = module.state_dict()
        if set(mine) != set(tensors):
            missing, extra = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
            raise ValueError(f"{part.value}: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(mine[name].shape) or tensor.dtype != mine[name].dtype:
                raise ValueError(
                    f"{part.value}.{name}: {tuple(tensor.shape)} {tensor.dtype} instead of {tuple(mine[name].shape)} "
                    f"{mine[name].dtype}"
                )
        module.load_state_dict(tensors, strict=True)


def split_model(
    model, num_stages: int, extra_parts: dict[int, tuple[StagePart, ...]] | None = None
) -> list[PipelineStage]:
    plan = StagePlan(len(_decoder(model).layers), num_stages)
    extra_parts = extra_parts or {}
    return [PipelineStage.from_model(model, plan, i, extra_parts.get(i, ())) for i in range(num_stages)]


def run_stages(
    stages: list[PipelineStage],
    input_ids,
    attention_mask,
    position_ids,
    order: list[int] | None = None,
    caches: list[StageCache] | None = None,
) -> torch.Tensor:
    """The in-process reference chain: embed on stage 0, LAYERS in `order`, head on the last stage."""
    order = list(range(len(stages))) if order is None else order
    hidden = stages[0].embed(input_ids)
    for i in order:
        hidden = stages[i].forward_layers(hidden, position_ids, attention_mask, cache=caches[i] if caches else None)
    return stages[-1].head(hidden)


def stage_fingerprint(model_fingerprint: str, plan: StagePlan, index: int, stage: PipelineStage) -> str:
    """16 hex chars naming what a stage is: model, split, index, layers, parts and every tensor's name/shape/dtype."""
    digest = hashlib.sha256(
        f"{model_fingerprint}:{plan.num_stages}:{index}:{plan.layer_range(index)}:"
        f"{[p.value for p in stage.parts]};".encode()
    )
    for part in stage.parts:
        for name, tensor in stage._module(part).state_dict().items():
            digest.update(f"{part.value}/{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()[:16]


def layers_shape_signature(stage: PipelineStage) -> str:
    """Equal for two stages whose LAYERS can be averaged or copied into each other."""
    return hashlib.sha256(
        ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in stage.layers.state_dict().items()).encode()
    ).hexdigest()[:16]


def stage_plan(config: NodeConfig, hf_config) -> StagePlan:
    return StagePlan(num_layers=hf_config.num_hidden_layers, num_stages=config.pipeline.num_stages)


def extra_parts_for(config: NodeConfig, index: int) -> tuple[StagePart, ...]:
    """The CheckFree+ replicas stage `index` keeps of a neighbour's parts (none without CheckFree+)."""
    if not config.pipeline.checkfree_plus or config.pipeline.num_stages < 2:
        return ()
    return checkfree_plus_extra_parts(config.pipeline.num_stages).get(index, ())


def expected_fingerprints(config: NodeConfig, hf_config, model_fingerprint: str) -> list[str]:
    """Every stage's fingerprint, computed from the model's config alone (what drivers check servers against)."""
    plan = stage_plan(config, hf_config)
    return [
        stage_fingerprint(
            model_fingerprint, plan, i, PipelineStage.from_config(hf_config, plan, i, extra_parts_for(config, i))
        )
        for i in range(plan.num_stages)
    ]


def pipeline_limits(config: NodeConfig, hf_config, model_parameters: int) -> PipelineLimits:
    """What one call may carry for this model: a batch of the largest sequences, as hidden states or logits."""
    max_len = config.pipeline.max_sequence_length or hf_config.max_position_embeddings
    widest = max(hf_config.hidden_size, hf_config.vocab_size)
    return PipelineLimits(
        max_tensors=4,
        max_rank=3,
        max_dim=max(config.pipeline.max_batch_size, max_len, widest),
        max_elements=config.pipeline.max_batch_size * max_len * widest,
        max_weights_bytes=8 * model_parameters + (1 << 20),
    )


def part_tensors(stage: PipelineStage, parts: list[str], depth: int | None = None) -> dict[str, torch.Tensor]:
    """The named tensors of `parts`, as they travel in a `weights` result: "<part>/<name>". depth: lay LAYERS out as
    a stage of that many layers would hold them (each layer's tensors shaped as this stage's first layer's), to check
    what a neighbour of another depth sends."""
    out = {}
    for part in parts:
        tensors = stage.part_state_dict(StagePart(part))
        if part == StagePart.LAYERS.value and depth is not None:
            first = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.split(".", 1)[0] == "0"}
            tensors = {f"{layer}.{rest}": t for layer in range(depth) for rest, t in first.items()}
        out.update({f"{part}/{name}": tensor for name, tensor in tensors.items()})
    return out


def split_parts(named: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse of `part_tensors`: {part: {name: tensor}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in named.items():
        part, _, name = key.partition("/")
        out.setdefault(part, {})[name] = tensor
    return out

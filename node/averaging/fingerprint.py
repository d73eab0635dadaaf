"""The averaging namespace: one per (swarm, model fingerprint).

Peers only average with peers whose model has the same architecture, parameter shapes and
dtypes and tokenizer (`node.model.model_fingerprint`). Putting the fingerprint in the
prefix keeps other models out of the matchmaking group altogether: their readiness
announcements live under another DHT key and their exchange handler has another name,
so they never see us and cannot even open an exchange stream to us.
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedTokenizerBase

from node.model import model_fingerprint
from node.transport.joining import key_prefix

_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def averaging_prefix(swarm_id: str, fingerprint: str) -> str:
    """`swarm-node/v<major>/<swarm_id>/avg/<fingerprint>`; ValueError for a fingerprint that would break the key."""
    if not _SAFE.match(fingerprint):
        raise ValueError(f"fingerprint {fingerprint!r} must be 1-64 characters of [A-Za-z0-9_.-]")
    return f"{key_prefix(swarm_id)}/avg/{fingerprint}"


def averaging_prefix_for(swarm_id: str, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> str:
    """The averaging prefix of this model, from its fingerprint."""
    return averaging_prefix(swarm_id, model_fingerprint(model, tokenizer))

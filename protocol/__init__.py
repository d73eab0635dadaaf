"""The wire protocol of swarm-node: every message, its version and its validation.

Torch-free and independent of `node/`: peers written in anything can implement it.
"""

from protocol.specs import TaskSpec, SpecError

__all__ = ["TaskSpec", "SpecError"]

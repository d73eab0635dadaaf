"""Checks on a partner's weights before they are averaged into ours.

A partner's theta enters our slow weights with weight 1/|G| (1/2 for NoLoCo pairs), so a
single bad message could wreck the model: names, shapes and dtypes must match ours
exactly, every value must be finite, and the whole vector must lie within a relative
distance of ours (peers that average regularly stay close; a far-away vector is a
different model, a diverged one, or an attack).
"""

from __future__ import annotations

import math

import torch

from node.device import HOST
from protocol.refusals import SentencedEnum


class WeightsRefusal(SentencedEnum):
    """Why a partner's weights were not used; every code carries a sentence for humans."""

    WRONG_NAMES = ("wrong_names", "The partner's tensor names differ from ours (missing or extra tensors).")
    WRONG_SHAPE = ("wrong_shape", "A tensor's shape differs from ours.")
    WRONG_DTYPE = ("wrong_dtype", "A tensor's declared dtype differs from ours.")
    NOT_FINITE = ("not_finite", "A tensor contains NaN or infinity.")
    TOO_FAR = ("too_far", "The partner's weights are further from ours than the allowed relative distance.")
    MALFORMED = ("malformed", "The bytes received are not a well-formed weights message, or exceed the size bound.")


class WeightsRefused(Exception):
    """A partner's weights refused for `reason` (a WeightsRefusal, which is also its str code)."""

    def __init__(self, reason: WeightsRefusal | str, detail: str = "") -> None:
        reason = WeightsRefusal(reason)
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value

    def __reduce__(self):  # picklable, like protocol.ProtocolRejection
        return (type(self), (self.reason.value, self.detail))


def relative_distance(local: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> float:
    """||received - local|| / (||local|| + 1e-12), with both norms taken over all tensors at once (float64, on the CPU:
    received weights arrive there, and ours may be on a GPU)."""
    diff_sq = local_sq = 0.0
    for name, mine in local.items():
        mine = mine.detach().to(HOST)
        # the norms accumulate in float64 (no overflow, no lost small terms) without a float64 copy of each tensor
        diff_sq += float(torch.linalg.vector_norm(received[name].detach() - mine, dtype=torch.float64)) ** 2
        local_sq += float(torch.linalg.vector_norm(mine, dtype=torch.float64)) ** 2
    return math.sqrt(diff_sq) / (math.sqrt(local_sq) + 1e-12)


def validate_partner_weights(
    local: dict[str, torch.Tensor], received: dict[str, torch.Tensor], max_relative_distance: float
) -> None:
    """Raise WeightsRefused unless `received` can be averaged with `local`; checks run cheapest first."""
    if set(received) != set(local):
        missing, extra = sorted(set(local) - set(received)), sorted(set(received) - set(local))
        raise WeightsRefused(
            WeightsRefusal.WRONG_NAMES,
            f"missing {missing[:3]}{'…' if len(missing) > 3 else ''}, extra {extra[:3]}{'…' if len(extra) > 3 else ''}",
        )
    for name, mine in local.items():
        theirs = received[name]
        if tuple(theirs.shape) != tuple(mine.shape):
            raise WeightsRefused(
                WeightsRefusal.WRONG_SHAPE, f"{name}: {list(theirs.shape)} instead of {list(mine.shape)}"
            )
        if theirs.dtype != mine.dtype:
            raise WeightsRefused(WeightsRefusal.WRONG_DTYPE, f"{name}: {theirs.dtype} instead of {mine.dtype}")
    # a NaN or an infinity anywhere makes the distance non-finite (float64 norms of float32 values never overflow):
    # only then are the tensors searched one by one for the first that holds one, to name it
    distance = relative_distance(local, received)
    if not math.isfinite(distance):
        culprit = next(
            (name for name, theirs in received.items() if not bool(torch.isfinite(theirs).all())), "(our own weights)"
        )
        raise WeightsRefused(WeightsRefusal.NOT_FINITE, culprit)
    if not distance <= max_relative_distance:
        raise WeightsRefused(WeightsRefusal.TOO_FAR, f"relative distance {distance:.4g} > {max_relative_distance:.4g}")

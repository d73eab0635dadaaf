"""The sharing benchmark's guard against comparing runs that started from different warm starts
(benchmarks/sharing.py: each row's `warm_start_digests`, and the report's warning)."""

from __future__ import annotations

import torch

from benchmarks.sharing import warm_start_mismatches, weights_digest


def test_the_digest_sees_one_changed_bit_and_nothing_else():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    same = torch.nn.Linear(4, 3)
    same.load_state_dict(model.state_dict())
    assert weights_digest(model) == weights_digest(same)
    with torch.no_grad():
        bits = same.weight.view(torch.int32)
        bits[1, 2] ^= 1  # the last bit of one float
    assert weights_digest(model) != weights_digest(same)
    assert len(weights_digest(model)) == 12


def test_arms_of_one_seed_from_different_warm_starts_are_named():
    def run(*digests):
        return {"warm_start_digests": list(digests)}

    by_key = {
        ("specialists", "silo"): {0: run("a", "b"), 1: run("c", "d"), 2: {}},
        ("specialists", "sapo_balance"): {0: run("a", "b"), 1: run("c", "e"), 2: run("x", "y")},
        ("homogeneous", "silo"): {1: run("c", "d")},
    }
    # seed 0 agrees; seed 2's silo row has no digest (stored before they were recorded); the homogeneous setting is
    # another comparison
    assert warm_start_mismatches(by_key) == ["specialists seed 1: sapo_balance c,e; silo c,d"]

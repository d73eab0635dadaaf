"""Checks on a partner's weights, and the averaging namespace built from the model fingerprint."""

from __future__ import annotations

import pickle

import pytest
import torch

from node.weights.validation import WeightsRefusal, WeightsRefused, relative_distance, validate_partner_weights


def local() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"w": torch.randn(8, 4, generator=generator), "b": torch.randn(4, generator=generator)}


def refusal(received, bound: float = 0.5) -> WeightsRefused:
    with pytest.raises(WeightsRefused) as caught:
        validate_partner_weights(local(), received, bound)
    return caught.value


def test_close_weights_pass():
    nearby = {k: v * 1.01 for k, v in local().items()}
    validate_partner_weights(local(), nearby, max_relative_distance=0.05)
    validate_partner_weights(local(), local(), max_relative_distance=0.0)


def test_wrong_names():
    mine = local()
    assert refusal({"w": mine["w"]}).reason is WeightsRefusal.WRONG_NAMES
    assert refusal({**mine, "extra": torch.zeros(1)}).reason == "wrong_names"


def test_wrong_shape():
    mine = local()
    refused = refusal({"w": mine["w"].T.contiguous(), "b": mine["b"]})
    assert refused.reason is WeightsRefusal.WRONG_SHAPE and "w" in refused.detail


def test_wrong_dtype():
    mine = local()
    assert refusal({"w": mine["w"].double(), "b": mine["b"]}).reason is WeightsRefusal.WRONG_DTYPE


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_not_finite(bad):
    mine = local()
    mine["b"][2] = bad
    assert refusal(mine).reason is WeightsRefusal.NOT_FINITE


def test_too_far_is_measured_over_all_tensors():
    mine = local()
    far = {k: v * 3 for k, v in mine.items()}  # distance exactly 2 ||local|| / ||local|| = 2
    assert relative_distance(mine, far) == pytest.approx(2.0)
    refused = refusal(far, bound=1.9)
    assert refused.reason is WeightsRefusal.TOO_FAR and "2" in refused.detail
    validate_partner_weights(mine, far, max_relative_distance=2.1)
    # one tensor far off is judged against the norm of the whole model, not of that tensor
    shifted = dict(mine, b=mine["b"] + 1.0)
    expected = 2.0 / torch.cat([mine["w"].flatten(), mine["b"]]).norm().item()  # ||[1, 1, 1, 1]|| = 2
    assert relative_distance(mine, shifted) == pytest.approx(expected, rel=1e-6)


def test_refusal_is_a_code_with_a_sentence_and_pickles():
    refused = WeightsRefused("too_far", "d=3")
    assert refused.reason is WeightsRefusal.TOO_FAR and str(refused) == "too_far: d=3"
    assert all(code.sentence for code in WeightsRefusal)
    again = pickle.loads(pickle.dumps(refused))
    assert again.reason is WeightsRefusal.TOO_FAR and again.detail == "d=3"
    with pytest.raises(ValueError):
        WeightsRefused("no_such_reason")


def test_averaging_prefix_separates_models():
    from node.averaging.fingerprint import averaging_prefix, averaging_prefix_for
    from node.config import ModelConfig
    from node.model import build_char_tokenizer, build_default_model, model_fingerprint

    tokenizer = build_char_tokenizer()

    def model(hidden: int):
        config = ModelConfig(
            default={
                "hidden_size": hidden,
                "num_layers": 1,
                "num_heads": 2,
                "intermediate_size": 32,
                "max_position_embeddings": 64,
            }
        )
        return build_default_model(config, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)

    small, same, wider = model(16), model(16), model(32)
    prefix = averaging_prefix_for("test-swarm", small, tokenizer)
    assert prefix == f"swarm-node/v1/test-swarm/avg/{model_fingerprint(small, tokenizer)}"
    assert averaging_prefix_for("test-swarm", same, tokenizer) == prefix
    assert averaging_prefix_for("test-swarm", wider, tokenizer) != prefix
    assert averaging_prefix_for("other-swarm", small, tokenizer) != prefix
    for bad in ("", "a/b", "x" * 65, "with space"):
        with pytest.raises(ValueError):
            averaging_prefix("test-swarm", bad)

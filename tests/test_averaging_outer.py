"""Outer optimizers (NoLoCo, DiLoCo) and the streaming correction, against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from node.averaging.outer import OuterOptimizerState, apply_with_drift, diloco_step, float_parameters, noloco_step


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_noloco_two_steps_match_hand_computation():
    state = OuterOptimizerState({"w": t(1.0, 2.0)})
    # step 1: own theta [2, 0], partner [4, 2] -> mean [3, 1]
    # m = 0.5*0 + 0.7*([3, 1] - [1, 2]) = [1.4, -0.7]; phi = [2.4, 1.3]
    new = noloco_step(state, {"w": t(2.0, 0.0)}, {"w": t(3.0, 1.0)}, mu=0.5, eta=0.7)
    assert_close(state.momentum["w"], t(1.4, -0.7))
    assert_close(new["w"], t(2.4, 1.3))
    # step 2: mean [2.5, 1.5]; m = 0.5*[1.4, -0.7] + 0.7*([2.5, 1.5] - [2.4, 1.3]) = [0.77, -0.21]; phi = [3.17, 1.09]
    new = noloco_step(state, {"w": t(3.0, 1.0)}, {"w": t(2.5, 1.5)}, mu=0.5, eta=0.7)
    assert_close(state.momentum["w"], t(0.77, -0.21))
    assert_close(new["w"], t(3.17, 1.09))
    assert state.steps == 2


def test_noloco_matches_the_papers_two_term_form():
    """m <- mu m - eta mean(delta) - eta (phi_i - mean(phi)) equals the theta-only form (ALGORITHMS.md §3)."""
    torch.manual_seed(0)
    phi_i, phi_j, theta_i, theta_j, m0 = (torch.randn(5) for _ in range(5))
    mu, eta = 0.5, 0.7
    delta_mean = ((phi_i - theta_i) + (phi_j - theta_j)) / 2
    expected_m = mu * m0 - eta * delta_mean - eta * (phi_i - (phi_i + phi_j) / 2)
    state = OuterOptimizerState({"w": phi_i})
    state.momentum["w"] = m0.clone()
    new = noloco_step(state, {"w": theta_i}, {"w": (theta_i + theta_j) / 2}, mu=mu, eta=eta)
    assert_close(state.momentum["w"], expected_m)
    assert_close(new["w"], phi_i + expected_m)


def test_noloco_with_self_as_partner_mu0_eta1_leaves_weights_unchanged():
    theta = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    state = OuterOptimizerState(theta)  # phi = theta: no inner steps yet
    mean_with_self = {k: (v + v) / 2 for k, v in theta.items()}
    new = noloco_step(state, theta, mean_with_self, mu=0.0, eta=1.0)
    for name in theta:
        assert torch.equal(new[name], theta[name])
    # after inner steps moved theta away from phi, the step lands on theta again (m = theta - phi)
    moved = {k: v + 0.25 for k, v in theta.items()}
    new = noloco_step(state, moved, {k: (v + v) / 2 for k, v in moved.items()}, mu=0.0, eta=1.0)
    for name in theta:
        assert_close(new[name], moved[name])


def test_noloco_without_partner_uses_own_theta():
    state = OuterOptimizerState({"w": t(1.0)})
    new = noloco_step(state, {"w": t(3.0)}, None, mu=0.5, eta=0.5)  # m = 0.5*(3-1) = 1; phi = 2
    assert_close(new["w"], t(2.0))


def test_returned_theta_does_not_alias_the_slow_weights():
    state = OuterOptimizerState({"w": t(1.0, 2.0)})
    new = noloco_step(state, {"w": t(1.0, 2.0)}, {"w": t(1.0, 2.0)}, mu=0.5, eta=0.7)
    new["w"].add_(100.0)
    assert_close(state.phi["w"], t(1.0, 2.0))


def test_diloco_nesterov_two_steps_match_hand_computation_and_torch_sgd():
    state = OuterOptimizerState({"w": t(1.0, 2.0)})
    # g = [0.5, -1]: buf = g; d = g + 0.9 buf = [0.95, -1.9]; phi = [1, 2] - 0.7 d = [0.335, 3.33]
    new = diloco_step(state, {"w": t(0.5, -1.0)}, eta=0.7, momentum=0.9)
    assert_close(new["w"], t(0.335, 3.33))
    # g = [0.1, 0.2]: buf = 0.9*[0.5, -1] + g = [0.55, -0.7]; d = g + 0.9 buf = [0.595, -0.43]; phi = [-0.0815, 3.631]
    new = diloco_step(state, {"w": t(0.1, 0.2)}, eta=0.7, momentum=0.9)
    assert_close(new["w"], t(-0.0815, 3.631))

    param = torch.nn.Parameter(t(1.0, 2.0))
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for grad in (t(0.5, -1.0), t(0.1, 0.2)):
        param.grad = grad
        sgd.step()
    assert_close(new["w"], param.detach())


def test_diloco_plain_momentum_and_outer_delta():
    state = OuterOptimizerState({"w": t(1.0, 2.0)})
    delta = state.outer_delta({"w": t(0.5, 3.0)})  # phi - theta
    assert_close(delta["w"], t(0.5, -1.0))
    new = diloco_step(state, delta, eta=0.7, momentum=0.9, nesterov=False)  # d = buf = g
    assert_close(new["w"], t(0.65, 2.7))


def test_apply_with_drift_keeps_local_steps_taken_during_the_exchange():
    sent = {"w": t(2.0, 2.0)}
    now = {"w": t(2.5, 1.5)}  # k inner steps after the snapshot moved the weights by [0.5, -0.5]
    result = apply_with_drift(now, sent, {"w": t(1.0, 1.0)})
    assert_close(result["w"], t(1.5, 0.5))
    # no steps in between: exactly the new theta
    new = {"w": torch.randn(7)}
    same = {"w": torch.randn(7)}
    assert torch.equal(apply_with_drift(same, same, new)["w"], new["w"])


def test_state_dict_round_trip_and_mismatch():
    model = torch.nn.Linear(3, 2)
    state = OuterOptimizerState.from_model(model)
    assert set(state.phi) == set(float_parameters(model)) == {"weight", "bias"}
    noloco_step(state, state.new_theta(), {k: v + 1 for k, v in state.phi.items()}, mu=0.5, eta=0.7)
    saved = state.state_dict()
    restored = OuterOptimizerState.from_model(torch.nn.Linear(3, 2))
    restored.load_state_dict(saved)
    assert restored.steps == 1
    for name in state.phi:
        assert torch.equal(restored.phi[name], state.phi[name])
        assert torch.equal(restored.momentum[name], state.momentum[name])
    with pytest.raises(ValueError, match="shape"):
        OuterOptimizerState.from_model(torch.nn.Linear(4, 2)).load_state_dict(saved)
    with pytest.raises(ValueError, match="missing"):
        noloco_step(state, {"weight": state.phi["weight"]}, None, mu=0.5, eta=0.7)


def test_bf16_theta_is_stepped_in_fp32():
    state = OuterOptimizerState({"w": t(1.0, 2.0).to(torch.bfloat16)})
    assert state.phi["w"].dtype == torch.float32
    new = noloco_step(state, {"w": t(2.0, 2.0).to(torch.bfloat16)}, None, mu=0.0, eta=0.5)
    assert new["w"].dtype == torch.float32
    assert_close(new["w"], t(1.5, 2.0))

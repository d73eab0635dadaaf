"""Outer optimizers over slow weights: NoLoCo (pairs, no all-reduce) and DiLoCo (all-reduce).

Each node keeps fast weights theta (its model, trained by the inner optimizer), slow
weights phi and an outer momentum m (`OuterOptimizerState`, fp32). Every H inner steps it
averages something with peers and takes one outer step; the inner optimizer's state stays
local. Pure torch, no networking: the averaging is `node.averaging.pairing`.

NoLoCo (../shared/papers/ALGORITHMS.md §3). With delta_j = phi_j - theta_j over the group G:
    m   <- mu * m - eta * mean_G(delta) - eta * (phi_i - mean_G(phi))
    phi <- phi + m ;  theta <- phi
Both terms share eta, so mean_G(delta) + phi_i - mean_G(phi) = phi_i - mean_G(theta) and
    m <- mu * m + eta * (mean_G(theta) - phi_i)
(our derivation): only theta travels, P values per peer per outer step.

DiLoCo: outer gradient g = mean over all replicas of (phi - theta), then SGD with Nesterov
momentum on phi (the DiLoCo paper: lr 0.7, momentum 0.9), exactly torch.optim.SGD's rule
with dampening 0: b <- momentum * b + g; d = g + momentum * b (Nesterov) or b; phi <- phi - lr * d.

Streaming correction (`apply_with_drift`): the exchange takes time, and a node that keeps
training while it runs has taken k more inner steps by the time the mean arrives. The
outer step is computed from the theta that was *sent*; replacing the model with the new
theta would throw those k steps away, so the node adds them back on top:
    theta <- new_theta + (theta_now - theta_sent)
as Streaming DiLoCo does for its overlapped communication.
"""

from __future__ import annotations

import torch

Named = dict[str, torch.Tensor]


def float_parameters(model: torch.nn.Module) -> Named:
    """The model's trainable floating-point parameters by name (what averaging covers)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad and p.is_floating_point()}


class OuterOptimizerState:
    """Slow weights phi and outer momentum m, both fp32 copies on the CPU, keyed by parameter name."""

    def __init__(self, initial: Named) -> None:
        if not initial:
            raise ValueError("an outer optimizer needs at least one tensor")
        for name, tensor in initial.items():
            if not tensor.is_floating_point():
                raise ValueError(f"{name}: outer steps need floating-point tensors, got {tensor.dtype}")
        self.phi: Named = {name: t.detach().to("cpu", torch.float32).clone() for name, t in initial.items()}
        self.momentum: Named = {name: torch.zeros_like(t) for name, t in self.phi.items()}
        self.steps = 0

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "OuterOptimizerState":
        return cls(float_parameters(model))

    def state_dict(self) -> dict:
        return {
            "phi": {k: v.clone() for k, v in self.phi.items()},
            "momentum": {k: v.clone() for k, v in self.momentum.items()},
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint; it must cover exactly our tensors with the same shapes."""
        for part in ("phi", "momentum"):
            _check_matches(self.phi, state[part], f"checkpoint {part}")
        self.phi = {k: state["phi"][k].detach().to("cpu", torch.float32).clone() for k in self.phi}
        self.momentum = {k: state["momentum"][k].detach().to("cpu", torch.float32).clone() for k in self.phi}
        self.steps = int(state["steps"])

    def outer_delta(self, theta: Named) -> Named:
        """phi - theta: what a DiLoCo replica contributes to the all-reduce (its outer gradient)."""
        _check_matches(self.phi, theta, "theta")
        return {k: self.phi[k] - theta[k].detach().to("cpu", torch.float32) for k in self.phi}

    def new_theta(self) -> Named:
        """A copy of phi: what the model is set to after an outer step (copies, so phi cannot be aliased)."""
        return {k: v.clone() for k, v in self.phi.items()}


def _check_matches(reference: Named, other: Named, what: str) -> None:
    if set(other) != set(reference):
        missing, extra = sorted(set(reference) - set(other)), sorted(set(other) - set(reference))
        raise ValueError(f"{what} does not cover the slow weights: missing {missing[:3]}, extra {extra[:3]}")
    for name, tensor in reference.items():
        if tuple(other[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{what}: {name} has shape {list(other[name].shape)}, expected {list(tensor.shape)}")


def noloco_step(state: OuterOptimizerState, theta: Named, mean_theta: Named | None, mu: float, eta: float) -> Named:
    """One NoLoCo outer step: m <- mu*m + eta*(mean_G(theta) - phi); phi <- phi + m. Returns the new theta (= phi).

    `theta` is this node's own fast weights (already part of `mean_theta`). When the
    exchange found no partner, pass `mean_theta=None`: the group is this node alone and
    the step uses its own theta (m <- mu*m + eta*(theta - phi), a Lookahead-style step), so
    a skipped exchange still applies the inner progress.
    """
    _check_matches(state.phi, theta, "theta")
    target = theta if mean_theta is None else mean_theta
    _check_matches(state.phi, target, "mean_theta")
    for name, phi in state.phi.items():
        m = state.momentum[name]
        m.mul_(mu).add_(target[name].detach().to("cpu", torch.float32) - phi, alpha=eta)
        phi.add_(m)
    state.steps += 1
    return state.new_theta()


def diloco_step(
    state: OuterOptimizerState, mean_delta: Named, eta: float, momentum: float, nesterov: bool = True
) -> Named:
    """One DiLoCo outer step: SGD (Nesterov by default) on phi with gradient mean_delta = mean(phi - theta). Returns
    the new theta."""
    _check_matches(state.phi, mean_delta, "mean_delta")
    for name, phi in state.phi.items():
        grad = mean_delta[name].detach().to("cpu", torch.float32)
        buf = state.momentum[name]
        buf.mul_(momentum).add_(grad)
        direction = grad.add(buf, alpha=momentum) if nesterov else buf
        phi.sub_(direction, alpha=eta)
    state.steps += 1
    return state.new_theta()


def apply_with_drift(model_params_now: Named, theta_sent: Named, new_theta: Named) -> Named:
    """new_theta + (params_now - theta_sent): keep the inner steps taken while the exchange ran (fp32 results).

    `theta_sent` is the snapshot that went into the exchange, `model_params_now` the
    model's weights when the result is applied; with no steps in between this is new_theta.
    """
    _check_matches(new_theta, model_params_now, "model_params_now")
    _check_matches(new_theta, theta_sent, "theta_sent")
    return {
        name: new_theta[name].to(torch.float32)
        + (
            model_params_now[name].detach().to("cpu", torch.float32)
            - theta_sent[name].detach().to("cpu", torch.float32)
        )
        for name in new_theta
    }

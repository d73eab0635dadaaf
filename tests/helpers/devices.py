"""A GPU's device rule, checked on a machine without one: tensors meet the policy only on the policy's device.

On a GPU, a tensor made without `device=` (`torch.zeros(n)`), or one that came from numpy, the
wire or a checkpoint, is on the CPU, and the first operation that mixes it with the policy's
tensors fails. On a CPU-only machine every tensor is on the CPU and nothing fails: a forgotten
`.to(device)` passes every test. `PolicyDeviceCheck` (a torch function mode) plays the GPU's part.

The policy's device gets a name of its own: the parameters and buffers of the modules given to
`place` say their device is `POLICY_DEVICE`, torch.device("cpu", 0), a CPU device that is not
torch.device("cpu"). Whatever code asks the policy where it is (`model_device(model)`,
`model.device`, `hidden.device`) gets that name, and the mode follows each tensor:

- POLICY: placed, or made with `device=POLICY_DEVICE`, or sent there with `.to(...)`, or computed
  from a POLICY tensor;
- HOST: everything else: made without a device, or with the CPU's, sent with `.cpu()` or
  `.to("cpu")`, or never seen being made (numpy, the wire, torch.load): the CPU on a GPU machine.

An operation whose tensors include a POLICY one and a HOST one of one dimension or more raises
`WrongDevice`, naming the line of the project that called it (a GPU takes a zero-dimensional
CPU tensor as a scalar, so such a tensor passes, as it does there). Copies (`copy_`,
`t[i] = u`) cross devices on a GPU, so they pass too; what they fill keeps its place.
`.numpy()` of a POLICY tensor raises: a GPU tensor has none. What this cannot see: the device
of a torch.Generator.

torch function modes are per thread: `policy_device_checked` yields an executor whose threads
run under the check, for the node's `asyncio.to_thread` work (`loop.set_default_executor`).
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from tests.helpers.common import REPO

POLICY_DEVICE = torch.device("cpu", 0)  # the policy's device, as the check names it
POLICY, HOST = "policy", "host"
_TAG = "_swarm_node_device_check"
_COPIES = {torch.Tensor.copy_, torch.Tensor.__setitem__}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
_OURS = (REPO / "node", REPO / "benchmarks")


class WrongDevice(AssertionError):
    """A tensor met the policy's tensors without being on the policy's device (it would fail on a GPU)."""


def tag_of(tensor: torch.Tensor) -> str:
    return getattr(tensor, _TAG, HOST)


def place(*modules: torch.nn.Module | None) -> None:
    """The policy (and its copies: the KL reference, a pipeline stage) lives on the policy's device."""
    for module in modules:
        if module is not None:
            for tensor in [*module.parameters(), *module.buffers()]:
                setattr(tensor, _TAG, POLICY)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _caller() -> str:
    """The innermost line of the project's own code on the stack."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if any(path.is_relative_to(ours) for ours in _OURS):
            return f"{path.relative_to(REPO)}:{frame.lineno} ({frame.line})"
    return "outside the project"


def _where(device) -> str:
    """The tag of a tensor made or moved to `device` (a torch.device or its name)."""
    return POLICY if torch.device(device) == POLICY_DEVICE else HOST


def _moved_to(func, args, kwargs) -> str | None:
    """Where `.to()`, `.cpu()` or `.cuda()` sends its tensor (None: a `.to(dtype)`, which leaves it in place)."""
    if func is not torch.Tensor.to:
        return HOST if func is torch.Tensor.cpu else POLICY
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return tag_of(value)
        if isinstance(value, (torch.device, str)):
            return _where(value)
    return None


class PolicyDeviceCheck(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # `t.device`: the policy's has its own name
            return POLICY_DEVICE if tag_of(args[0]) == POLICY else func(*args, **kwargs)
        inputs = _tensors(args) + _tensors(kwargs)
        if func is torch.Tensor.numpy and inputs and tag_of(inputs[0]) == POLICY:
            raise WrongDevice(f"numpy() of a tensor on the policy's device at {_caller()}")
        result = func(*args, **kwargs)
        if func in _COPIES:
            return result
        if func in _MOVES:
            tag = _moved_to(func, args, kwargs)
            if tag is not None and tag != tag_of(inputs[0]) and result is inputs[0]:
                # on a CPU a move between CPU devices returns the tensor itself; on a GPU the moved tensor is
                # another one, and the original stays where it was: the move gets its own alias (same storage, graph)
                result = result.view_as(result)
            self._tag(result, tag_of(inputs[0]) if tag is None else tag)
            return result
        if not _tensors(result):
            return result
        if not inputs:  # made from scratch: where `device=` says, else on the CPU
            device = kwargs.get("device")
            self._tag(result, HOST if device is None else _where(device))
            return result
        tags = [tag_of(t) for t in inputs]
        if POLICY in tags and any(tag == HOST and t.dim() > 0 for tag, t in zip(tags, inputs)):
            shapes = ", ".join(f"{tag} {list(t.shape)}" for tag, t in zip(tags, inputs))
            raise WrongDevice(
                f"{getattr(func, '__name__', func)} mixes the policy's device with the CPU ({shapes}) at {_caller()}"
            )
        self._tag(result, POLICY if POLICY in tags else HOST)
        return result

    @staticmethod
    def _tag(result, tag: str) -> None:
        for tensor in _tensors(result):
            setattr(tensor, _TAG, tag)


@contextmanager
def policy_device_checked(*modules: torch.nn.Module | None) -> Iterator[ThreadPoolExecutor]:
    """Place `modules` on the policy's device and check this thread, and the threads of the executor it yields,
    until the block ends."""
    place(*modules)
    with ThreadPoolExecutor(max_workers=4, initializer=lambda: PolicyDeviceCheck().__enter__()) as executor:
        with PolicyDeviceCheck():
            yield executor

"""Exact-type, bounded field checks shared by every message and the envelope.

Types are exact (`type(v) is int`), so a boolean never passes for an integer and an
integer never passes for a float: a peer that sends the wrong type is refused, never
coerced. Each check returns its value so decoders read as one line per field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NoReturn

from protocol.refusals import ProtocolRejection, Refusal
from protocol.version import PROTOCOL_MINOR

MAX_INT = 2**63 - 1  # every integer fits a signed 64-bit integer in any implementation


def reject(reason: Refusal, detail: str) -> NoReturn:
    raise ProtocolRejection(reason, detail)


def check_int(value: Any, name: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if type(value) is not int:
        reject(Refusal.BAD_STRUCTURE, f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        reject(Refusal.BAD_VALUE, f"{name}={value} is outside [{lo}, {hi}]")
    return value


def check_float(value: Any, name: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if type(value) is not float:
        reject(Refusal.BAD_STRUCTURE, f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        reject(Refusal.BAD_VALUE, f"{name}={value} is not finite")
    if not lo <= value <= hi:
        reject(Refusal.BAD_VALUE, f"{name}={value} is outside [{lo}, {hi}]")
    return value


def check_str(value: Any, name: str, max_chars: int) -> str:
    if type(value) is not str:
        reject(Refusal.BAD_STRUCTURE, f"{name} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        reject(Refusal.STRING_TOO_LONG, f"{name} has {len(value)} characters, limit {max_chars}")
    return value


def check_bytes(value: Any, name: str, length: int) -> bytes:
    if type(value) is not bytes or len(value) != length:
        reject(Refusal.BAD_STRUCTURE, f"{name} must be {length} bytes")
    return value


def check_list(value: Any, name: str, max_items: int, min_items: int = 0) -> list[Any]:
    if type(value) is not list:
        reject(Refusal.BAD_STRUCTURE, f"{name} must be a list, got {type(value).__name__}")
    if len(value) > max_items:
        reject(Refusal.TOO_MANY_ITEMS, f"{name} has {len(value)} items, limit {max_items}")
    if len(value) < min_items:
        reject(Refusal.BAD_VALUE, f"{name} has {len(value)} items, needs at least {min_items}")
    return value


def check_addresses(value: Any, name: str, max_items: int, max_chars: int) -> list[str]:
    """A list of at most max_items multiaddr strings of at most max_chars each (dialing one that is
    not what it claims only fails: libp2p authenticates the peer at the other end)."""
    return [check_str(a, name, max_chars) for a in check_list(value, name, max_items)]


def since_minor(minor: int, default_factory: Any) -> Any:
    """A message field appended in protocol minor `minor`: a sender of an older minor omits it
    (the receiver uses the default), a sender of this minor or later must send it."""
    return dataclasses.field(default_factory=default_factory, metadata={"since_minor": minor})


def check_fields(obj: Any, cls: type, minor: int) -> dict[str, Any]:
    """`obj` must be a map with exactly the fields of dataclass `cls` that the sender's minor
    version has; extra fields are allowed (and ignored) only from a sender of a higher minor
    version, which appends them."""
    if type(obj) is not dict:
        reject(Refusal.BAD_STRUCTURE, f"{cls.__name__} must be a map, got {type(obj).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls) if f.metadata.get("since_minor", 0) <= minor]
    missing = [name for name in required if name not in obj]
    if missing:
        reject(Refusal.BAD_STRUCTURE, f"{cls.__name__} lacks {', '.join(missing)}")
    if len(obj) > len(names) and minor <= PROTOCOL_MINOR:
        extra = sorted(str(key) for key in obj if key not in names)
        reject(Refusal.BAD_STRUCTURE, f"{cls.__name__} has unknown fields {', '.join(extra)}")
    return obj

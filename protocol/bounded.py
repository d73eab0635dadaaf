"""Bounded memory for what peers can make a node remember: identities, sequence numbers, digests of refused values."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(OrderedDict[K, V]):
    """A dict of at most `capacity` keys. Setting a key makes it the newest; past the capacity the oldest
    are forgotten first, so a flood of throwaway identities pushes out only what is least recently active."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)

    def copy(self) -> BoundedDict[K, V]:
        copied: BoundedDict[K, V] = BoundedDict(self.capacity)
        for key, value in self.items():
            copied[key] = value
        return copied

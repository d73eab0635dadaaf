"""Nodes of one test process that trade rollouts through the in-process exchange (node/transport/inprocess.py: the
real signed records, decoding and re-scoring, only the network hop replaced)."""

from __future__ import annotations

from pathlib import Path

from node.loop import Node
from node.transport.inprocess import InProcessExchange, InProcessTransport


def in_process_nodes(make_config, tmp_path: Path, overrides: dict[str, list[str]]) -> list[Node]:
    """A loaded node per name of `overrides`, with that name's config overrides and its state in tmp_path/<name>, all
    on one exchange (not started: a caller may give them more, such as an averaging service, first)."""
    exchange = InProcessExchange()
    nodes = []
    for name, extra in overrides.items():
        node = Node(make_config(*extra, state_dir=tmp_path / name))
        node.load()
        node.transport = InProcessTransport(exchange, node.config, node.identity, node.stats, node.fingerprint)
        nodes.append(node)
    return nodes

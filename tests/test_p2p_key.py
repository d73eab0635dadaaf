"""The p2p daemon's key file: created private, read back to the same peer id, refused when exposed or foreign."""

from __future__ import annotations

import os

import pytest

from node.transport.p2p_key import load_or_create_p2p_key


def test_key_is_created_private_and_keeps_its_peer_id(tmp_path):
    path = tmp_path / "state" / "p2p.key"
    first = load_or_create_p2p_key(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_or_create_p2p_key(path) == first and first.startswith("Qm")
    assert [p.name for p in path.parent.iterdir()] == ["p2p.key"]  # no temporary file left behind


def test_exposed_or_foreign_key_is_refused(tmp_path):
    path = tmp_path / "p2p.key"
    load_or_create_p2p_key(path)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_or_create_p2p_key(path)
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"not a key")
    os.chmod(junk, 0o600)
    with pytest.raises(ValueError, match="not a p2p daemon key"):
        load_or_create_p2p_key(junk)

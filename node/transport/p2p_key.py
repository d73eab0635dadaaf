"""The p2p daemon's own key, kept in the state dir so that a restarted node keeps its peer id.

p2pd makes a fresh key at every start unless it is given one (`identity_path`): the node's
`/p2p/<id>` address then changed on each restart and every `--initial-peers` naming a
restarted bootstrap node was dead. This key is not the node's Ed25519 identity
(`identity.key`, which signs our records): it only names the daemon's transport endpoint.
It is in hivemind's format (a libp2p protobuf `PrivateKey` holding an RSA key), the one
`P2P.create(identity_path=...)` and `PeerID.from_identity` read.

hivemind's own writer opens the file with the process umask and only then narrows it to
0400; this one writes a 0600 temporary file, fsyncs and renames it, like `identity.key`
(protocol/identity.py), and refuses a key that group or others can read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from protocol.identity import write_private_file

P2P_KEY_FILE = "p2p.key"


def load_or_create_p2p_key(path: Path) -> str:
    """Create the daemon key at `path` when absent; return its peer id (base58)."""
    from node.transport.protobuf_shim import import_hivemind_isolated

    import_hivemind_isolated()
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        data = crypto_pb2.PrivateKey(
            key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()
        ).SerializeToString()
        write_private_file(path, data)
        return PeerID.from_identity(data).to_base58()
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(
                f"p2p key {path} is accessible by group/others (mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
            )
        data = file.read()
    try:
        return PeerID.from_identity(data).to_base58()
    except Exception as exc:  # protobuf or DER errors: one readable line, not a traceback from deep inside
        raise ValueError(
            f"{path} is not a p2p daemon key ({type(exc).__name__}); move it away to make a new one (the node's /p2p/ "
            "id changes)"
        ) from exc

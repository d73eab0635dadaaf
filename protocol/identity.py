"""A node's long-lived Ed25519 identity: it signs every envelope, and its node id is
derived from the public key, so an id cannot be claimed without holding the key.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
NODE_ID_BYTES = 20  # 160 bits of sha256: collision-free in practice, short enough to print


def node_id_from_public_key(public_key: bytes) -> str:
    """The node id: lowercase hex of the first 20 bytes of sha256(raw public key)."""
    if type(public_key) is not bytes or len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} raw bytes")
    return hashlib.sha256(public_key).digest()[:NODE_ID_BYTES].hex()


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True only for a valid Ed25519 signature; malformed keys or signatures give False."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


class NodeIdentity:
    """An Ed25519 private key with the node id derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key_bytes: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.node_id: str = node_id_from_public_key(self.public_key_bytes)

    @classmethod
    def generate(cls) -> "NodeIdentity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "NodeIdentity":
        """A deterministic identity from 32 raw private-key bytes (tests, golden bytes)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load_or_create(cls, path: Path) -> "NodeIdentity":
        """Load the key at `path`, or create it there if absent.

        The file holds an unencrypted PKCS#8 PEM key (raw 32 private bytes are accepted
        too). A new file is written to a temporary file with mode 0600, fsynced, then
        renamed into place, so a crash never leaves a half-written key. Like ssh, a key
        file that group or others can access is refused (PermissionError): whoever can
        read it can speak as this node. Fix with `chmod 600 <path>`. Two processes creating
        the same missing key at once each get a key and the last rename wins: give every
        live node its own key path.
        """
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return cls._create(path)
        with os.fdopen(fd, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise PermissionError(
                    f"node key {path} is accessible by group/others "
                    f"(mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
                )
            data = file.read()
        return cls(_parse_private_key(data, path))

    @classmethod
    def _create(cls, path: Path) -> "NodeIdentity":
        identity = cls.generate()
        pem = identity._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_private_file(path, pem)
        return identity

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def __repr__(self) -> str:  # never print key material
        return f"NodeIdentity(node_id={self.node_id!r})"


def _parse_private_key(data: bytes, path: Path) -> Ed25519PrivateKey:
    if data.lstrip().startswith(b"-----BEGIN"):
        key = serialization.load_pem_private_key(data, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
        return key
    if len(data) == 32:
        return Ed25519PrivateKey.from_private_bytes(data)
    raise ValueError(f"{path} is neither a PEM Ed25519 private key nor 32 raw private-key bytes")


def write_private_file(path: Path, data: bytes) -> None:
    """Write a secret whole or not at all, readable by its owner only (0600 whatever the umask), rename made durable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only narrow the mode; make it exact
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)

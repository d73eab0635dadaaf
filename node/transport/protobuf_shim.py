"""Let hivemind and py-libp2p live in one process.

Both packages ship generated protobuf modules for a file named `crypto.proto` in package
`crypto.pb`, with different contents, and both register them in protobuf's process-wide
default descriptor pool. Whichever is imported second fails with
`TypeError: duplicate symbol 'crypto.pb.KeyType'` (../shared/NOTES.md).

`import_hivemind_isolated()` imports hivemind while `descriptor_pool.Default()` hands
hivemind's own generated modules (`hivemind.proto.*_pb2`) a private pool; every other
caller, libp2p included, still gets the real default pool. Message classes built from a
private pool serialize and parse exactly like the others: hivemind never looks its types
up by name in the default pool, it only uses the classes its `_pb2` modules define.

Call it before anything imports hivemind; libp2p may be imported before or after.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
from types import ModuleType

from google.protobuf import descriptor_pool

_HIVEMIND_PROTO_PACKAGE = "hivemind.proto"

_lock = threading.Lock()
_private_pool: descriptor_pool.DescriptorPool | None = None  # set once hivemind is imported through the shim


def import_hivemind_isolated() -> ModuleType:
    """Import hivemind with its protobuf descriptors in a private pool; return the module.

    Idempotent. Raises RuntimeError if hivemind was already imported without the shim: its
    descriptors then sit in the default pool and libp2p can no longer be imported.
    """
    global _private_pool
    with _lock:
        if _private_pool is not None:
            return sys.modules["hivemind"]
        already = sorted(name for name in sys.modules if name == "hivemind" or name.startswith("hivemind."))
        if already:
            raise RuntimeError(
                "hivemind was imported before node.transport.protobuf_shim.import_hivemind_isolated() "
                f"(already loaded: {', '.join(already[:3])}{', ...' if len(already) > 3 else ''}); its protobuf "
                "descriptors are in the default pool and clash with libp2p's (duplicate symbol "
                "'crypto.pb.KeyType'). Call import_hivemind_isolated() before any hivemind import."
            )

        pool = descriptor_pool.DescriptorPool()
        real_default = descriptor_pool.Default

        def default_for_caller() -> descriptor_pool.DescriptorPool:
            # Generated modules call `descriptor_pool.Default()` at their top level, so the
            # calling frame's module name tells whose descriptors are being registered.
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(_HIVEMIND_PROTO_PACKAGE + "."):
                return pool
            return real_default()

        descriptor_pool.Default = default_for_caller
        try:
            hivemind = importlib.import_module("hivemind")
            # hivemind's __init__ imports most _pb2 modules; import the rest now, while the
            # private pool is in place, so that no later lazy import reaches the default pool.
            proto_package = importlib.import_module(_HIVEMIND_PROTO_PACKAGE)
            for module_info in pkgutil.iter_modules(proto_package.__path__):
                if module_info.name.endswith("_pb2"):
                    importlib.import_module(f"{_HIVEMIND_PROTO_PACKAGE}.{module_info.name}")
        finally:
            descriptor_pool.Default = real_default
        _private_pool = pool
        return hivemind

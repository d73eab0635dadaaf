from node.transport.base import Transport

__all__ = ["Transport"]

from node.transport.base import ExternalGroup, Transport

__all__ = ["ExternalGroup", "Transport"]

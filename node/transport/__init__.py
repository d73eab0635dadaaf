from node.transport.base import ExternalGroup, Transport


def build_transport(config) -> Transport:
    """The transport named by `config.swarm.transport`."""
    if config.swarm.transport == "none":
        from node.transport.null import NullTransport

        return NullTransport()
    raise ValueError(f"unknown transport {config.swarm.transport!r}")


__all__ = ["ExternalGroup", "Transport", "build_transport"]

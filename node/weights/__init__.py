"""Weights between peers: their wire codec and the checks a peer's weights pass before they are used.

Below both users: NoLoCo/DiLoCo averaging (node/averaging/) and a pipeline stage rebuilt from its
neighbours (node/pipeline/)."""

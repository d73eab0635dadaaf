"""The protocol version every envelope carries as [major, minor].

Compatibility rule: a minor release only appends fields (to the envelope body or to a
message) and may add message kinds, so a receiver accepts any minor of its own major and
ignores trailing fields it does not know when the sender's minor is higher than its own.
A new major may change anything, so an unknown major is refused outright.
"""

PROTOCOL_MAJOR = 1
# What each minor appended: 1 stage announcements (pipeline), signed averaging announcements;
# 2 PeerStats.accuracy_by_dataset; 3 p2p_maddrs in stage and averaging announcements (a caller on another host
# dials them); 4 StageLost reports (pipeline drivers); 5 PeerStats.reachability (nodes behind NAT); 6 sharded DHT
# keys for heartbeats and rollouts (protocol/shards.py); 7 StageLost.lost_at (when each stage was found lost);
# 8 PeerStats.device (where the node trains); 9 PeerStats.rejoins (swarm connections it rebuilt); 10 PeerStats
# staleness_mean, staleness_max, carried_in, carried_out, ahead_wait_s (the overlap of generation with training);
# 11 PeerStats.sampler_idle_s (the overlap's other idle time: the sampler waiting for the round); 12 PeerStats.restarts
# (the node's process started again after one that did not stop cleanly, or on a stalled round).
PROTOCOL_MINOR = 12
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"  # as a PeerStats.protocol_version string

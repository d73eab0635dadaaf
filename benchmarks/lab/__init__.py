"""The swarm lab: real `swarm-node` processes, each in its own network namespace, on shaped and faulty links.

- network.py: the namespaces, the bridge, shaped links, home routers (NAT), partitions, the processes run in them,
  and cleanup of what a killed lab left (`Lab`, `Link`);
- swarm.py: a swarm of `join` nodes in the lab and what their state directories say;
- workers.py: benchmarks that run one worker process per node, coordinated through files;
- presets.py: the tiny models, the pipeline's timings and the node command line that the lab's runs and the tests share;
- __main__.py: the command (`sudo .venv/bin/python -m benchmarks.lab --nodes 8 ...`, docs/lab.md).
"""

from benchmarks.lab.network import (
    BENCH_NET,
    HOST_IP,
    NAT_LAB_NET,
    REGISTRY_DIR,
    REPO,
    Lab,
    Link,
    _run,
    _tbf,
    cleanup_stale,
    host_link_holder,
    kill_and_delete_namespace,
    lab_unavailable,
    node_ip,
    remove_stale_namespaces,
    router_lan_ip,
    router_wan_ip,
    stop_on_first_signal,
)
from benchmarks.lab.swarm import (
    PHASES,
    isolated_argv,
    node_argv,
    node_summary,
    rounds_per_minute,
    seconds_by_phase,
    start_swarm,
    steady_rows,
    wait_for_address,
)
from benchmarks.lab.workers import (
    WORKER_WAIT_S,
    eth0_tx_bytes,
    start_workers,
    wait_file,
    wait_worker_file,
    write_atomic,
)

__all__ = [
    "BENCH_NET",
    "HOST_IP",
    "NAT_LAB_NET",
    "REGISTRY_DIR",
    "PHASES",
    "REPO",
    "WORKER_WAIT_S",
    "Lab",
    "Link",
    "_run",
    "_tbf",
    "cleanup_stale",
    "eth0_tx_bytes",
    "host_link_holder",
    "isolated_argv",
    "kill_and_delete_namespace",
    "lab_unavailable",
    "node_argv",
    "node_ip",
    "node_summary",
    "remove_stale_namespaces",
    "rounds_per_minute",
    "router_lan_ip",
    "router_wan_ip",
    "seconds_by_phase",
    "start_swarm",
    "stop_on_first_signal",
    "start_workers",
    "steady_rows",
    "wait_file",
    "wait_for_address",
    "wait_worker_file",
    "write_atomic",
]

"""benchmarks/pipeline_throughput.py's modules, a mode each: `harness` (what every mode runs the pipeline on: the model
sizes, one process, split in process, serve processes), `calls` (a call's round trip against its compute), `timing`
(the default mode), `loss_check`, `recovery`, `lab_runs` (--lab), `floor` (--transport-floor) and `costs`
(--check-cost, --protobuf-cost).

hivemind is imported here first, isolated (node/transport/hivemind_p2p.py), before torch or any module here loads it.
"""

from node.transport import hivemind_p2p  # noqa: F401 - hivemind's private calls, and its protobuf kept isolated

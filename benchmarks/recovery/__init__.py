"""benchmarks/stage_recovery.py's modules, one job each: `runs` (what a run is: the pipeline's config, its failure
schedule, the model it starts from), `checkpoints` (checkpoint-restart, the baseline), `bench` (the run of one
configuration), `churn` (the joiner churn benchmark, --churn), `campaign` (which runs a configuration lacks, launched
and kept under its key) and `report` (the figures from the kept rows).

Each of them reaches hivemind through node/pipeline/, so hivemind is imported here first, its protobuf descriptors
in a pool of their own where libp2p's cannot clash with them.
"""

from node.transport.protobuf_shim import import_hivemind_isolated

import_hivemind_isolated()

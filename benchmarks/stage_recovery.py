"""Recovering lost pipeline stages: CheckFree(+) vs checkpoint-restart vs random re-initialisation.

A 4-stage pipeline of the default architecture (8 decoder layers, 2 per stage) trains
with the language-model loss on the fixed offline corpus. Every stage server is a real
`StageServer` on its own DHT node and p2p daemon, the driver a real `LMDriver` routing
over p2p streams — all in this one process (one asyncio loop), so that failures can be
injected at exact steps: a failure kills the server's p2p daemon (its peers see refused
connections, as after kill -9), stops its tasks and drops its state. A fresh server on a
fresh DHT node then takes the stage over (a warm spare: its start is counted in the
recovery time). Strategies, same seeds and the same failure schedule for each:

- none:        no failures (sets the target validation loss);
- checkfree:   the new server rebuilds the stage from its neighbours (CheckFree for
               stages 1-2, CheckFree+ for stages 0 and 3, see node/pipeline/recovery.py);
- checkpoint:  every --checkpoint-every steps every server writes its stage, optimizer state, step
               and lr scale to disk (a temporary file, fsynced, renamed over the last one, the
               folder fsynced: save_stage_checkpoint), one stage after the other on this machine's
               one disk, while the training loop waits; after a failure the new server starts
               from a random init (nothing fetched), every stage reads the last checkpoint back
               from disk and the driver goes back to its step. Saves and loads are timed and in
               the strategy's wall clock. The interval is by default Young's rule,
               sqrt(2 x checkpoint cost x the pipeline's MTBF), from the first checkpoint's
               measured cost and the failure-free run's normal step (young_interval); with
               young-with-uploads, that cost includes what the steps beside the first checkpoint's
               background uploads took beyond normal steps (cost_with_uploads); young-own-steps
               prices the same against the run's own normal step (own_normal_step) instead of the
               failure-free run's, which ran at another load. With
               --checkpoint-store-mbit R (root) a checkpoint is not done until it is also uploaded to
               a store on another host (a network namespace behind a link of R Mbit/s, which fsyncs
               it), and a replacement server downloads its stage's checkpoint from there: a
               checkpoint kept only on the host that dies is lost with it. The stages share that
               one link, one after the other, unless --checkpoint-uplinks per-stage: then each
               stage's host has an uplink of R of its own and all stages save and upload at once
               (Checkpoints). --checkpoint-uplinks per-host goes further: every run, each
               strategy's and the failure-free one's, happens in a network namespace of its own,
               whose loopback gives every host (the driver, each stage server, each store) an
               uplink of R (host_uplinks.py), so that a stage host's hidden states, gradients,
               what CheckFree reads from it and its checkpoint uploads share its one link.
               With --checkpoint-uploads background training goes on once every
               stage has written its checkpoint to its own disk; the uploads run meanwhile and the
               checkpoint is the restore point once they have all ended (a failure before that cuts
               them and rolls back to the checkpoint before);
- random:      the new server initialises the stage randomly (fresh optimizer).

Failure schedule: each stage fails independently with probability rate / steps_per_hour
at each step (the paper's 5 %, 10 %, 16 % per stage per hour, with an "hour" scaled to
--steps-per-hour steps), drawn from the seed alone. The target is the validation loss the
failure-free run of the same seed reaches at --target-fraction of its steps. Reported per
strategy and rate (mean over seeds, with min and max): steps executed and wall-clock seconds to
the target (validation time left out: the same for every strategy), recovery seconds (failure
-> first step after, less a normal step) by how the stage came back, the loss spike (the training
loss of the first step after a failure minus that of the step before it), and what a checkpoint
cost. Unlike the paper's simulation (checkpoint_simulation.py replays a failure-free run and does
not charge checkpoint I/O), checkpoint save and load times are measured and charged here.
Every run starts from scratch, as the paper's, or with --pretrained-steps N from its seed's model
after N steps of the same objective in one process (made once, kept in the model cache): failures
then hit a pipeline further into training, where a fresh stage has more to relearn.

Every run appends its row to --results (benchmarks/results/stage_recovery.jsonl) as it ends, under
a key of the settings that make runs comparable; a run already there is not run again, and
--report computes the figures from the file alone. --side-by-side runs the strategies of one
(rate, seed) at once, each in its own process, so that they share the machine's load; the
failure-free runs of all seeds go first, side by side too. With --keep-load a run that reached its
target (its row written) goes on training until every run beside it has reached its own or ended:
else the fastest strategy's end frees the CPU for the slower ones, which then run their last
minutes at a lower load than it ran under. --size takes pipeline_throughput's model sizes.

--model takes a pretrained model (e.g. smollm2-135m-instruct: SmolLM2's 30 decoder layers cut into the 4 stages)
instead of the default architecture; --failures STEP:STAGE ... replaces the seeded schedule with exactly those
failures, the same for every seed and strategy (the rate then only prices Young's rule), so that the loss spike and
the steps back (each run's `losses`, every step's training loss, replays included) compare the methods at the same
moment of training:

    .venv/bin/python benchmarks/stage_recovery.py --model smollm2-135m-instruct --lr 3e-5 --micro-batch 4 \
        --max-steps 12 --eval-every 4 --failures 6:1 --rates 0.10 --seeds 1 --plain-baselines --side-by-side \
        --run-timeout-s 1800 --set pipeline.checkfree_plus=false \
        --results benchmarks/results/stage_recovery_smollm2.jsonl

Churn mode (--churn, issue #24): no spares; before each of --churn-failures seeded steps a
random stage's only server is killed, and a newcomer joins with `--stage auto` a random 0 to
2 announce TTLs later, so that it often arrives while the dead server's announcement is still
readable. Reported per seed (`joiner_churn`): the longest stall (from when a server is
available, i.e. the later of the kill and the newcomer's arrival, to the end of the first step
after it), the announce TTL, the fraction of steps lost (from each kill to the end of the first
step after it, less a normal step, counted in normal steps, plus the steps a checkpoint rollback
replays, over all step slots), and the validation loss after the run. CheckFree and checkpoint-restart (the stage's
newcomer, then every stage, loads
the last checkpoint) on the same schedule.

    .venv/bin/python benchmarks/stage_recovery.py --seeds 3
    .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 0.16 0.05 --side-by-side
    .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --report
    sudo .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 --side-by-side \
        --checkpoint-store-mbit 100
    sudo .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 --side-by-side \
        --checkpoint-store-mbit 20 --checkpoint-uplinks per-stage
    sudo .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 --side-by-side \
        --checkpoint-store-mbit 20 --checkpoint-uplinks per-stage --checkpoint-uploads background
    sudo .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 --side-by-side \
        --checkpoint-store-mbit 20 --checkpoint-uplinks per-host --checkpoint-uploads background
    .venv/bin/python benchmarks/stage_recovery.py --churn --seeds 3
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

# run as a script, Python puts benchmarks/ on the path, not the repository: benchmarks.* is imported from there
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.host_uplinks import in_own_namespace  # noqa: E402
from benchmarks.throughput.harness import SIZES  # noqa: E402
from benchmarks.recovery.campaign import RESULTS, campaign  # noqa: E402
from benchmarks.recovery.checkpoints import OWN_STEPS  # noqa: E402
from benchmarks.recovery.churn import churn  # noqa: E402
from benchmarks.recovery.runs import fixed_failures, uplink_per_host  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--only-seeds", type=int, nargs="+", help="run these seeds of the --seeds (e.g. those whose failure schedule "
        "has failures at the rate): the report still reads every row of the configuration",
    )  # fmt: skip
    parser.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.10, 0.16])
    parser.add_argument("--strategies", nargs="+", default=["checkfree", "checkpoint", "random"])
    parser.add_argument(
        "--max-steps",
        type=int,
        default=200,
        help="steps of the failure-free run (runs with failures may take up to twice as many)",
    )
    parser.add_argument(
        "--steps-per-hour", type=int, default=25, help="how many steps stand for one hour of the paper's failure rates"
    )
    parser.add_argument(
        "--checkpoint-every",
        default="young",
        help="steps between checkpoint-restart's checkpoints, or `young`: sqrt(2 x checkpoint cost x the pipeline's "
        "MTBF), from the first checkpoint's measured cost and the failure-free run's step (churn mode: a number), or "
        "`young-with-uploads` (uploads in the background): the same rule, the cost being the save plus what the steps "
        "beside the first checkpoint's uploads took beyond normal steps, no checkpoint until those uploads end, or "
        f"`young-own-steps`: the same, priced after {OWN_STEPS} normal steps of the run itself against their median "
        "(the failure-free run's step was taken at another load)",
    )
    parser.add_argument(
        "--checkpoint-store-mbit", type=float, default=None, help="checkpoint-restart uploads every checkpoint to a "
        "store on another host (a network namespace) over a link of this rate, and a replacement server downloads "
        "its stage's from there (root); default: checkpoints stay on this host's disk",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-uplinks", choices=["shared", "per-stage", "per-host"], default="shared", help="with a store: "
        "`shared`, one link of the rate to the store that the stages' uploads cross one after the other; `per-stage`, "
        "each stage's host its own uplink of the rate, so the stages upload at once (four home hosts and a store that "
        "is not the bottleneck); `per-host`, as per-stage, and every host's uplink (the driver's, each stage "
        "server's, each store's) carries all it sends: hidden states, gradients and CheckFree's reads share it with "
        "the uploads, in every strategy's runs and the failure-free ones (each run in a network namespace of its own)",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-uploads", choices=["blocking", "background"], default="blocking", help="with a store: "
        "`blocking`, training waits until every stage's upload is done; `background`, training goes on once every "
        "stage has its checkpoint on its own disk, and the checkpoint is the restore point once its uploads end",
    )  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--target-fraction",
        type=float,
        default=0.8,
        help="target = the failure-free run's validation loss at this fraction of --max-steps",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of every run, after the "
        "benchmark's own (e.g. tasks.datasets=[...]: the corpus the model trains on); part of the runs' key",
    )  # fmt: skip
    parser.add_argument("--size", choices=list(SIZES), help="a model size of pipeline_throughput (else --hidden)")
    parser.add_argument("--hidden", type=int, default=64, help="8 layers of this width, MLP twice as wide")
    parser.add_argument(
        "--model", help="a pretrained model instead of the default architecture (model.name_or_path: a preset such as "
        "smollm2-135m-instruct, a .gguf file or an HF directory), cut into the 4 stages; use a pretrained model's --lr",
    )  # fmt: skip
    parser.add_argument(
        "--failures", nargs="+", metavar="STEP:STAGE", help="exactly these failures (before driver step STEP, stage "
        "STAGE's only server), the same for every seed and strategy, instead of the seeded schedule of --rates (which "
        "then only prices Young's rule)",
    )  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument(
        "--plain-baselines",
        action="store_true",
        help="checkpoint-restart and random re-initialisation train without CheckFree+ (pipeline.checkfree_plus: no "
        "swapped stage order on odd micro-batches, no embedding copies on the neighbours), as a deployment of either "
        "would; CheckFree, and the failure-free run whose loss is the target, keep it. Default: every run with it",
    )
    parser.add_argument(
        "--pretrained-steps",
        type=int,
        default=0,
        help="every run of a seed starts from its model after this many steps of the same LM objective in one process "
        "(on sequences the runs never see; made once, kept in the model cache): failures then hit a pipeline further "
        "into training, where a fresh stage has more to relearn; default: from scratch, as the paper",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--run-timeout-s",
        type=float,
        default=600.0,
        help="a run still short of the target after this long counts as missed",
    )
    parser.add_argument(
        "--churn",
        action="store_true",
        help="joiner churn instead: kills on a seeded schedule, newcomers with --stage auto, no spares",
    )
    parser.add_argument("--churn-steps", type=int, default=60, help="churn: driver steps per seed")
    parser.add_argument("--churn-failures", type=int, default=6, help="churn: servers killed per seed (one at a time)")
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="each run's row is appended here as it ends; runs already there "
        "with the same configuration are not run again",
    )
    parser.add_argument("--side-by-side", action="store_true", help="the strategies of one (rate, seed) in parallel")
    parser.add_argument(
        "--keep-load",
        action="store_true",
        help="side by side: a run that reached its target keeps training until every run beside it has reached its "
        "own or ended, so that the slower ones keep the load they started under",
    )
    parser.add_argument("--report", action="store_true", help="only the figures from --results, for this configuration")
    parser.add_argument("--hold-dir", type=Path, help=argparse.SUPPRESS)  # --keep-load: the parent's LoadHold folder
    parser.add_argument("--one", nargs=3, metavar=("SEED", "RATE", "STRATEGY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.churn and args.checkpoint_store_mbit:
        parser.error("--checkpoint-store-mbit is for the failure-rate mode, not --churn")
    if uplink_per_host(args) and args.one and not in_own_namespace():
        parser.error("--checkpoint-uplinks per-host: a run goes in a network namespace of its own (main starts it)")
    if args.checkpoint_uplinks != "shared" and not args.checkpoint_store_mbit:
        parser.error("--checkpoint-uplinks needs --checkpoint-store-mbit (without a store, checkpoints stay on disk)")
    if args.checkpoint_every == "young-with-uploads" and args.checkpoint_uploads != "background":
        parser.error("--checkpoint-every young-with-uploads prices uploads in the background (--checkpoint-uploads)")
    if args.checkpoint_uploads != "blocking" and not args.checkpoint_store_mbit:
        parser.error("--checkpoint-uploads needs --checkpoint-store-mbit (without a store nothing is uploaded)")
    if args.keep_load and not args.side_by_side and not args.one:
        parser.error("--keep-load keeps the load of runs side by side (--side-by-side)")
    if args.model and (args.size or args.pretrained_steps):
        parser.error("--model brings its own shape and weights: not with --size or --pretrained-steps")
    try:
        fixed_failures(args.failures or [])
    except ValueError as exc:
        parser.error(str(exc))
    if args.churn and not args.checkpoint_every.isdigit():
        parser.error("--churn needs --checkpoint-every as a number of steps")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    os.environ.setdefault("SWARM_NODE_CACHE", str(Path(tempfile.gettempdir()) / "swarm-node-bench-cache"))
    if args.churn:
        churn(args)
    else:
        campaign(args)


if __name__ == "__main__":
    main()

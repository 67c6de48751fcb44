"""Typed wire messages: what peers say to each other, and how it maps onto frames.

Owns the message vocabulary (one frozen dataclass per message type) and the strict
translation between a message and a frame's ``(type, fields, tensors)``. Decoding checks every
field's presence and type against the dataclass annotations, so a handler only ever sees a
well-formed message; unknown extra fields are ignored (forward compatibility within a protocol
version). Does not own framing (``protocol.frames``), sockets, or what a node does with a message.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import torch

from protocol.errors import MalformedMessage, UnknownMessageType
from protocol.frames import (
    SMALL_FRAME_BYTES,
    Limits,
    decode_frame,
    encode_frame,
    frame_nbytes,
    join_frame,
)

_Tensors = Mapping[str, torch.Tensor]
"""A message's tensors by name: a ``dict`` for one made here, ``protocol.frames.FrameTensors``
(views of the frame, made when looked up) for one decoded from a frame."""


@dataclass(frozen=True)
class Hop:
    """One step of a microbatch's route: which peer of which stage handled it."""

    stage: int
    peer_id: str
    address: str


@dataclass(frozen=True)
class PeerRecord:
    """What a node tells others about itself (or relays about a third peer)."""

    peer_id: str
    address: str
    stage: int
    step: int = 0
    throughput: float = 0.0
    """Samples per second through this peer's stage (EMA of its own measurements)."""
    queue: int = 0
    """Jobs waiting in the peer's compute queue."""
    ready: bool = False
    """True once the peer holds its stage's weights and accepts work."""
    leaving: bool = False
    incarnation: int = 0
    """Raised only by the peer itself, when it answers a report of its death or restarts: a
    death notice buries every record of its incarnation or below (``swarm.membership``)."""
    version: int = 0
    """The peer's own count of the changes it published about itself: of two records of one
    incarnation, the higher version is the newer."""
    grad_norm: float = 0.0
    """The stage's latest post-clip gradient norm (CheckFree needs it)."""
    loss: float | None = None
    """Latest training loss, head-stage peers only."""
    head_backup_step: int = 0
    """Step of the head stage's weights this peer keeps a copy of (CheckFree+), 0 for none."""
    data_shard: int = -1
    """The train shard a head-stage peer reads (-1: not a head, or not chosen yet)."""
    movable: bool = False
    """True for a ``--stage auto`` block-stage peer that rebalancing may move."""
    step_s: float = 0.0
    """The peer's seconds per inner optimizer step, wall-clock time over its last rounds
    (``swarm.schedule.Pace``), 0 until measured: its stage derives the period of its outer
    rounds and its usual inner steps per round from it (``swarm.schedule``)."""
    round_s: float = 0.0
    """The period of the outer rounds this peer's stage schedule runs on (seconds; 0: none
    yet, or not on the clock schedule): its stage's replicas take the shortest period in use
    that fits, so that they agree on one (``swarm.schedule.round_period``)."""
    relays: list[str] = field(default_factory=list)
    """Addresses of the peers relaying for this one (empty: dial it directly); a sender tries
    the first few (``node.net.relay.MAX_RELAYS``)."""
    relay_slots: int = 0
    """Nodes this peer could still relay for (0: it does not relay)."""
    settling: bool = False
    """True while a joining ``--stage auto`` node has announced a stage and may still change
    it (``node.settle_s``): nodes that announced one stage at the same moment take turns,
    the lower peer ids first (``swarm.balance.settle_join``)."""

    def problem(self) -> str | None:
        """What no honest peer publishes (a negative or non-finite figure: routing divides
        by them, CheckFree weighs by them), or None; decoding refuses a record that has one."""
        for name in ("throughput", "grad_norm", "step_s", "round_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                return f"{name} {value} is not a finite number >= 0"
        counter = _counter_problem(
            self, "step", "queue", "incarnation", "version", "head_backup_step", "relay_slots"
        )
        if counter is not None:
            return counter
        if self.loss is not None and not math.isfinite(self.loss):
            return f"loss {self.loss} is not finite"
        return None


MAX_COUNTER = 2**53 - 1
"""The largest step, count, incarnation or version taken from a peer: far above any honest
one (an incarnation is a time in milliseconds, about 2**41), exact in a float and in the
page's JavaScript, and with room to count on without leaving msgpack's 64 bits (a peer that
pushed a node's incarnation past them would have made its every message unencodable)."""


def _counter_problem(record: Any, *names: str) -> str | None:
    """Which of ``record``'s counters ``names`` is negative or above ``MAX_COUNTER``,
    said, or None."""
    for name in names:
        value = getattr(record, name)
        if value < 0:
            return f"{name} {value} is negative"
        if value > MAX_COUNTER:
            return f"{name} {value} is above 2**53 - 1"
    return None


@dataclass(frozen=True)
class Message:
    """Base class: ``TYPE`` names the message on the wire; ``tensors`` travel in the frame tail."""

    TYPE: ClassVar[str] = ""
    tensors: _Tensors = field(default_factory=dict, kw_only=True, repr=False, compare=False)


@dataclass(frozen=True)
class Obituary:
    """News that a peer is gone: it left (``left``) or a prober could not reach it, in
    ``incarnation`` (its record's when it was found gone)."""

    peer_id: str
    incarnation: int
    left: bool = False

    def problem(self) -> str | None:
        """An incarnation out of range, or one that leaves its subject no higher one to
        answer with (``MAX_COUNTER``), or None."""
        if self.incarnation >= MAX_COUNTER:
            return f"incarnation {self.incarnation} leaves its subject no higher one"
        return _counter_problem(self, "incarnation")


@dataclass(frozen=True)
class StageSummary:
    """What a node that holds a stage's records says of that stage, for the nodes that do not
    hold them (``swarm.membership``: a table holds only the stages next to its own)."""

    stage: int
    replicas: int
    """Live replicas (ready or joining, not leaving), the summariser itself included."""
    ready: int
    """Of them, those ready for work."""
    throughput: float
    """Their summed throughput, samples per second."""
    step: int
    """The highest step among them."""
    age_s: float
    """Seconds since a holder of the stage computed it (grows as it is relayed)."""
    contact: str = ""
    """The address of one replica of the stage that can be dialled directly, to greet
    when joining or moving to it ("": none known)."""

    def problem(self) -> str | None:
        """A count or figure no honest node sends (negative, not finite, more ready than
        live), or None."""
        counter = _counter_problem(self, "stage", "replicas", "ready", "step")
        if counter is not None:
            return counter
        if self.ready > self.replicas:
            return f"ready {self.ready} is above replicas {self.replicas}"
        for name in ("throughput", "age_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                return f"{name} {value} is not a finite number >= 0"
        return None


@dataclass(frozen=True)
class Hello(Message):
    """Membership handshake (a first contact, a bootstrap, a partition healing, or an
    introduction to a member that has not heard of us yet): my record, the peers I know,
    and whether I want the receiver's table in its ``Welcome`` (an introduction does not)."""

    TYPE: ClassVar[str] = "hello"
    swarm: str
    fingerprint: str
    sender: PeerRecord
    peers: list[PeerRecord]
    want_table: bool = True
    stages: list[StageSummary] = field(default_factory=list)
    """The greeter's count of its own stage (a receiver outside its neighbourhood holds no
    records of it, and while no other node holds both, nobody else summarises it)."""


@dataclass(frozen=True)
class Welcome(Message):
    """Reply to ``Hello``: the receiver's record and table, and the host it saw us connect from."""

    TYPE: ClassVar[str] = "welcome"
    swarm: str
    fingerprint: str
    sender: PeerRecord
    peers: list[PeerRecord]
    observed_host: str
    deaths: list[Obituary] = field(default_factory=list)
    """The greeter's own obituary, if the receiver holds one: it answers with a higher
    version (``swarm.membership``)."""
    stages: list[StageSummary] = field(default_factory=list)
    """Summaries of the stages whose records ``peers`` leaves out (outside the greeter's
    neighbourhood)."""


@dataclass(frozen=True)
class Ping(Message):
    """Membership probe and push: are you there? plus the news the sender is spreading.

    Only a member may send it (a stranger says ``Hello`` first): news enters a table only
    from a ``Hello`` of the same swarm and model, or from a member that took it so.
    """

    TYPE: ClassVar[str] = "ping"
    sender: str
    news: list[PeerRecord] = field(default_factory=list)
    deaths: list[Obituary] = field(default_factory=list)
    ask_record: bool = True
    """Whether the reply should carry the replier's record (a probe); a push of news does
    not need it."""
    incarnation: int = 0
    version: int = 0
    """The sender's own record's incarnation and version: a receiver holding an older one
    pings it back for the record (a relayed record may not change the address or relays of
    a peer heard from directly, so only its own word brings them)."""
    pull: bool = False
    """A ping back for the replier's record alone: the reply carries no news (news rides
    on a few messages per node, and these would spend them on a node that just spoke)."""
    stages: list[StageSummary] = field(default_factory=list)
    """Summaries of a few stages outside the receiver's neighbourhood, in turn."""


@dataclass(frozen=True)
class Pong(Message):
    """Reply to ``Ping`` and ``Probe``: alive (with the replier's own record; none from a
    ``Probe``'s helper), and the replier's news."""

    TYPE: ClassVar[str] = "pong"
    sender: PeerRecord | None = None
    news: list[PeerRecord] = field(default_factory=list)
    deaths: list[Obituary] = field(default_factory=list)
    wall_ms: int = 0
    """The replier's wall clock as it replied, milliseconds since the Unix epoch (0: not
    said): the pinger estimates how far apart their clocks are (``swarm.schedule``)."""

    def problem(self) -> str | None:
        """A clock no honest replier reads, or None (decoding refuses it)."""
        return _counter_problem(self, "wall_ms")


@dataclass(frozen=True)
class Probe(Message):
    """Ask a member to ping ``target`` for us (an indirect probe: our own ping failed, maybe
    only on our path). Answered with the target's ``Pong``, or an ``unreachable`` error."""

    TYPE: ClassVar[str] = "probe"
    sender: str
    target: str
    """The peer id to ping, which the helper must hold (it dials the address it knows)."""


@dataclass(frozen=True)
class Leave(Message):
    """A peer announces it is shutting down; drop it from routing at once (and pass it on)."""

    TYPE: ClassVar[str] = "leave"
    peer_id: str
    incarnation: int = 0
    """The leaver's incarnation (0: the one the receiver holds)."""


@dataclass(frozen=True)
class Forward(Message):
    """Activations of microbatch ``mb_id`` for ``target_stage``; tensors encoded by ``meta``.

    ``path`` lists the hops so far, starting with the originating head node. A forward whose
    ``target_stage`` is 0 carries the last block stage's output home to ``path[0]``.
    ``route`` is the order of block stages this microbatch visits; empty means 1, 2, ..., N
    (CheckFree+ swaps the ends on odd microbatches).
    """

    TYPE: ClassVar[str] = "forward"
    mb_id: str
    target_stage: int
    path: list[Hop]
    eval: bool
    meta: dict[str, Any]
    route: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Backward(Message):
    """Gradient w.r.t. the output of hop ``path[index]``, sent back along the recorded path."""

    TYPE: ClassVar[str] = "backward"
    mb_id: str
    index: int
    path: list[Hop]
    meta: dict[str, Any]


@dataclass(frozen=True)
class Dropped(Message):
    """A replica could not pass microbatch ``mb_id`` on: its output or gradient at stage
    ``stage`` went nowhere (no replica of the next stage took it, or this node's uplink had
    no time left for it). Sent to the head that issued it (``path[0]``), which re-issues it
    now rather than at its deadline; answered ``Ack``. A microbatch's id carries random bits
    (``node.roles.head``), so only a peer that held the microbatch can name it."""

    TYPE: ClassVar[str] = "dropped"
    mb_id: str
    stage: int
    sender: str

    def problem(self) -> str | None:
        return _counter_problem(self, "stage")


@dataclass(frozen=True)
class Ack(Message):
    """Accepted for processing (work continues asynchronously)."""

    TYPE: ClassVar[str] = "ack"
    detail: str = ""
    rate: float = 0.0
    """Bytes per second at which the request's body arrived, as the receiver timed it (from
    its headers to its last byte): set on a microbatch's ack, 0 when not timed (a small or
    relayed body). Its sender picks its wire codec by it (``swarm.wirecodec``)."""
    queue: int = -1
    """On a microbatch's ack: the receiver's jobs queued or running, this one included (-1:
    not said). With ``service_rate``, its sender's router weighs the receiver by figures of
    the moment, not by its published record, which a large swarm refreshes rarely."""
    service_rate: float = 0.0
    """On a microbatch's ack: the receiver's samples per second of compute (0: not said)."""

    def problem(self) -> str | None:
        """A figure no honest receiver sends, or None (decoding refuses it)."""
        if not all(math.isfinite(v) and v >= 0 for v in (self.rate, self.service_rate)):
            return f"rate {self.rate} or service_rate {self.service_rate} is not finite >= 0"
        if self.queue < -1:
            return f"queue {self.queue} is below -1"
        return None


@dataclass(frozen=True)
class Error(Message):
    """A request was refused; ``code`` is stable and machine-readable."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str


@dataclass(frozen=True)
class FetchState(Message):
    """Ask a replica of ``stage`` for its current weights and optimizer state."""

    TYPE: ClassVar[str] = "fetch_state"
    stage: int


@dataclass(frozen=True)
class StageState(Message):
    """A stage replica's state: parameters and Adam moments as tensors, counters as fields."""

    TYPE: ClassVar[str] = "stage_state"
    stage: int
    step: int
    samples: int

    def problem(self) -> str | None:
        """Negative counters (the copier would publish them as its own step, and every peer
        would refuse its records), or None."""
        return _counter_problem(self, "step", "samples")


@dataclass(frozen=True)
class GossipRequest(Message):
    """NoLoCo: "pair with me for outer round ``round``". A proposal (``propose``) carries
    nothing and is answered by an empty ``GossipReply`` (a promise to take this sender's
    contribution next); otherwise it carries the sender's contribution (``swarm.gossip``)."""

    TYPE: ClassVar[str] = "gossip_request"
    stage: int
    round: int
    sender: str
    meta: dict[str, Any]
    propose: bool = False
    upload_s: float = 0.0
    """With a proposal: the seconds the sender expects its contribution to take to upload,
    at the rate its uploads get (0: not known). An accepting partner waits that long where
    it is longer than its usual allowance, up to a bound of its own (``swarm.gossip``)."""

    def problem(self) -> str | None:
        return _upload_problem(self.upload_s)


@dataclass(frozen=True)
class GossipFollow(Message):
    """NoLoCo: "let me follow you in outer round ``round``": the sender asks for the
    replier's contribution to that round and sends none of its own. A replica whose uplink
    cannot carry its contribution within a round sends it in the rounds it does not exchange
    in (``swarm.gossip``); answered by a ``GossipReply`` that carries the contribution, and
    the replier does not wait for, or pair with, the sender."""

    TYPE: ClassVar[str] = "gossip_follow"
    stage: int
    round: int
    sender: str


@dataclass(frozen=True)
class GossipReply(Message):
    """NoLoCo: the request is accepted; carries the replier's contribution (nothing, when
    it accepts a proposal)."""

    TYPE: ClassVar[str] = "gossip_reply"
    round: int
    meta: dict[str, Any]
    upload_s: float = 0.0
    """With a promise: the seconds the replier expects its own contribution, which comes
    back in the reply to the proposer's, to take to upload (0: not known). With
    ``incoming``: the seconds its sender keeps sending it."""
    incoming: bool = False
    """Instead of a promise, to a proposal: the replier's own contribution is on its way to
    the proposer already; wait for it rather than propose again."""

    def problem(self) -> str | None:
        return _upload_problem(self.upload_s)


def _upload_problem(upload_s: float) -> str | None:
    """An announced upload time no honest sender gives (negative or not finite), or None."""
    if not (math.isfinite(upload_s) and upload_s >= 0):
        return f"upload_s {upload_s} is not a finite number >= 0"
    return None


@dataclass(frozen=True)
class RingChunk(Message):
    """One step of a ring all-reduce: a chunk for the right-hand neighbour."""

    TYPE: ClassVar[str] = "ring_chunk"
    round_id: str
    members_hash: str
    phase: str
    step: int
    meta: dict[str, Any]
    side: list[float] = field(default_factory=list)
    """A few scalars summed exactly beside the chunks (``swarm.allreduce``): on a reduce
    step, the sum of the side values of the sender and the members before it; empty when
    the round carries none."""

    def problem(self) -> str | None:
        """Side values no honest member sends (too many, or not finite), or None."""
        if len(self.side) > MAX_RING_SIDE:
            return f"{len(self.side)} side values, more than {MAX_RING_SIDE}"
        if not all(math.isfinite(v) for v in self.side):
            return f"side values {self.side} are not all finite"
        return None


MAX_RING_SIDE = 8
"""Side values a ring chunk may carry (the daemon sends one: its schedule place)."""


@dataclass(frozen=True)
class HeadBackup(Message):
    """CheckFree+: a head node's embedding, norms and LM head, kept by a block-stage peer."""

    TYPE: ClassVar[str] = "head_backup"
    step: int
    sender: str
    """The head node whose weights these are (only head-stage peers we know may send them)."""

    def problem(self) -> str | None:
        return _counter_problem(self, "step")


@dataclass(frozen=True)
class Rollback(Message):
    """Checkpoint-restart baseline: a stage restarted from its checkpoint; reload yours."""

    TYPE: ClassVar[str] = "rollback"
    stage: int
    step: int
    sender: str
    """The restarted node asking for the rollback (only peers we know may ask)."""

    def problem(self) -> str | None:
        return _counter_problem(self, "step")


@dataclass(frozen=True)
class DialBack(Message):
    """Reachability check: "connect to me at ``address`` and say ``nonce``". The peer asked
    dials only the host it sees the request come from, so it cannot be made to connect
    anywhere else; it answers with a ``DialBackResult``."""

    TYPE: ClassVar[str] = "dial_back"
    address: str
    """HOST:PORT the sender announces, to be tested."""
    nonce: str
    sender: str


@dataclass(frozen=True)
class DialProbe(Message):
    """The dial-back itself, to the address under test; answered with ``Ack``."""

    TYPE: ClassVar[str] = "dial_probe"
    nonce: str


@dataclass(frozen=True)
class DialBackResult(Message):
    """Whether the peer asked could connect to the address under test."""

    TYPE: ClassVar[str] = "dial_back_result"
    reached: bool
    observed_host: str
    """The host the request came from, as the peer saw it."""
    detail: str


@dataclass(frozen=True)
class MoveRequest(Message):
    """Rebalancing: "may I leave stage ``stage`` for ``target``?", asked of each replica of
    both before the sender goes (``swarm.balance.MoveLock``); answered ``MoveAnswer``."""

    TYPE: ClassVar[str] = "move_request"
    stage: int
    target: int
    sender: str


@dataclass(frozen=True)
class MoveAnswer(Message):
    """Whether the asker may move now, and if not, why."""

    TYPE: ClassVar[str] = "move_answer"
    granted: bool
    reason: str = ""


MESSAGE_TYPES: Mapping[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Welcome,
        Leave,
        Ping,
        Pong,
        Probe,
        Forward,
        Backward,
        Dropped,
        Ack,
        Error,
        FetchState,
        StageState,
        GossipRequest,
        GossipFollow,
        GossipReply,
        RingChunk,
        HeadBackup,
        Rollback,
        DialBack,
        DialProbe,
        DialBackResult,
        MoveRequest,
        MoveAnswer,
    )
}

M = TypeVar("M", bound=Message)
R = TypeVar("R")


_FRAME = "_frame"
"""Where a message keeps its encoded frame: in its ``__dict__``, outside the dataclass fields
(so equality, ``repr`` and ``dataclasses.replace`` ignore it)."""


def encode_message(msg: Message) -> tuple[bytes | memoryview, ...]:
    """The frame buffers for ``msg``, tensors sent from their own memory.

    Encoded once per message and kept on it (a message is immutable, its tensors by
    contract): a frame ``prepare`` encoded where the message was made, off the event loop,
    costs the sender nothing, and a retry to another peer nothing again.
    """
    buffers: tuple[bytes | memoryview, ...] | None = msg.__dict__.get(_FRAME)
    if buffers is None:
        fields = {name: _to_wire(getattr(msg, name)) for name in _field_names(type(msg))}
        buffers = msg.__dict__[_FRAME] = tuple(encode_frame(msg.TYPE, fields, msg.tensors))
    return buffers


def prepare(msg: M) -> M:
    """``msg``, its frame encoded now and kept (``encode_message``); a frame of at most
    ``SMALL_FRAME_BYTES`` joined into one buffer, so sending it joins nothing.

    Call it where a message is made on a compute thread: encoding reads each tensor's memory
    through torch, the largest of our costs on the event loop when sending an activation
    (``bench/perf.py``, hop latency: "hop_encoding" against "hop").
    """
    buffers = encode_message(msg)
    if len(buffers) > 1 and frame_nbytes(buffers) <= SMALL_FRAME_BYTES:
        msg.__dict__[_FRAME] = (join_frame(buffers),)
    return msg


def decode_message(buf: bytes | bytearray | memoryview, limits: Limits | None = None) -> Message:
    """Decode and validate one frame into its typed message (tensors are zero-copy views)."""
    msg_type, fields, tensors = decode_frame(buf, limits or Limits())
    cls = MESSAGE_TYPES.get(msg_type)
    if cls is None:
        raise UnknownMessageType(f"unknown message type {msg_type!r}")
    return _from_fields(cls, fields, tensors)


def expect(msg: Message, cls: type[M]) -> M:
    """``msg`` as ``cls``; a peer answering with another type (or an ``Error``) is a protocol error."""
    if isinstance(msg, cls):
        return msg
    if isinstance(msg, Error):
        raise MalformedMessage(f"peer refused: {msg.code}: {msg.message}")
    raise MalformedMessage(f"expected {cls.TYPE!r} reply, got {msg.TYPE!r}")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """The wire fields of dataclass ``cls`` (all but ``tensors``), listed once per class."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(
            f.name for f in dataclasses.fields(cls) if f.name != "tensors"
        )
    return names


_SCALAR_TYPES = frozenset({type(None), bool, str, float, int})


def _to_wire(value: Any) -> Any:
    """``value`` with records (dataclasses) turned into maps; ``protocol.frames`` checks the rest."""
    kind = type(value)
    if kind in _SCALAR_TYPES or kind is dict:
        return value
    if kind is list or kind is tuple:
        return [v if type(v) in _SCALAR_TYPES else _to_wire(v) for v in value]
    names = _FIELD_NAMES.get(kind)  # a record type seen before: no dataclass test
    if names is None:
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            return value
        names = _field_names(kind)
    return {name: _to_wire(getattr(value, name)) for name in names}


class _Bad(Exception):
    """A decoded field value of the wrong shape. Raised without a location, which the
    containers it passes through add on its way up: a path is formatted only for a refused
    message, not for every field of every accepted one (``bench/perf.py``, hop latency)."""

    def __init__(self, problem: str, sep: str = ": ", of_value: bool = False) -> None:
        super().__init__(problem)
        self.problem = problem
        self.sep = sep
        self.of_value = of_value
        """A record of the right shape whose ``problem()`` refused a value in it."""
        self.where: list[str] = []
        """Location steps, innermost first (".name", "[3]")."""

    def located(self, outer: str) -> MalformedMessage:
        return MalformedMessage(f"{outer}{''.join(reversed(self.where))}{self.sep}{self.problem}")


Checker = Callable[[Any], Any]
"""Converts a decoded header value to its field's type, or raises ``_Bad``."""
_CHECKERS: dict[Any, Checker] = {}
_PLANS: dict[type, list[tuple[str, Checker, bool]]] = {}


def _plan(cls: type) -> list[tuple[str, Checker, bool]]:
    """``(name, checker, required)`` per wire field of ``cls``, built once per class:
    resolving annotations and dispatching on them per decode took most of a small message's
    decoding time (``bench/perf.py``, hop latency)."""
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        plan = _PLANS[cls] = [
            (
                f.name,
                _checker(hints[f.name]),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
            if f.name != "tensors"
        ]
    return plan


def _kwargs(cls: type, value: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor arguments of record ``cls`` from its decoded map."""
    kwargs: dict[str, Any] = {}
    for name, check, required in _plan(cls):
        if name in value:
            try:
                kwargs[name] = check(value[name])
            except _Bad as e:
                e.where.append(f".{name}")
                raise
        elif required:
            raise _Bad(f"lacks field {name!r}", sep=" ")
    return kwargs


def _from_fields(cls: type[M], fields: Mapping[str, Any], tensors: _Tensors) -> M:
    try:
        return _checked(cls(**_kwargs(cls, fields), tensors=tensors))
    except _Bad as e:
        raise e.located(cls.TYPE) from None


def _checked(value: R) -> R:
    """``value``, unless its ``problem()`` (where its class has one) names something wrong."""
    problem = getattr(value, "problem", None)
    reason = problem() if problem is not None else None
    if reason is not None:
        raise _Bad(reason, of_value=True)
    return value


def _checker(hint: Any) -> Checker:
    check = _CHECKERS.get(hint)
    if check is None:
        check = _CHECKERS[hint] = _make_checker(hint)
    return check


def _wrong(value: Any, hint: Any) -> _Bad:
    return _Bad(f"{type(value).__name__} is not {getattr(hint, '__name__', hint)}")


def _make_checker(hint: Any) -> Checker:
    """The checker of one field type: the wire carries only what msgpack gives (None, bool,
    int, float, str, list, str-keyed dict), so a value has its field's shape or is refused."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [_checker(option) for option in typing.get_args(hint)]

        def union(value: Any) -> Any:
            for option in options:
                try:
                    return option(value)
                except _Bad as e:
                    if e.of_value:  # the right shape, a wrong value: say which
                        raise
                    continue
            raise _Bad(f"{type(value).__name__} is not {hint}")

        return union
    if hint is type(None):

        def none(value: Any) -> Any:
            if value is None:
                return None
            raise _wrong(value, hint)

        return none
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        item = _checker(item_hint)

        def items(value: Any) -> Any:
            if not isinstance(value, list):
                raise _wrong(value, hint)
            try:
                return [item(v) for v in value]
            except _Bad as e:
                index = next(i for i, v in enumerate(value) if not _passes(item, v))
                e.where.append(f"[{index}]")
                raise

        return items
    if origin is dict:

        def mapping(value: Any) -> Any:
            # decode_frame has checked every key of the header to be a str
            if type(value) is dict:
                return value
            raise _wrong(value, hint)

        return mapping
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        record_cls: type = hint

        def record(value: Any) -> Any:
            if isinstance(value, dict):
                return _checked(record_cls(**_kwargs(record_cls, value)))
            raise _wrong(value, hint)

        return record
    if hint is float:

        def real(value: Any) -> Any:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
            raise _wrong(value, hint)

        return real
    if hint is int:

        def integer(value: Any) -> Any:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise _wrong(value, hint)

        return integer
    if hint is Any:
        return lambda value: value

    def instance(value: Any) -> Any:
        if isinstance(value, hint):
            return value
        raise _wrong(value, hint)

    return instance


def _passes(check: Checker, value: Any) -> bool:
    try:
        check(value)
    except _Bad:
        return False
    return True

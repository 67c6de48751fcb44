"""Who may speak in a keyed swarm, and who is speaking: proofs on requests and replies.

Owns peer identity and the proof that travels with every exchange of a keyed swarm.

- An identity is an Ed25519 key pair. The peer id is the first 32 hex digits (128 bits) of
  the SHA-256 of the raw public key, so nobody can claim an id without its private key.
- A proof is one HTTP header, ``X-Murmur-Auth: v=1,ts=..,nonce=..,key=..,to=..,mac=..,sig=..``:
  a wall-clock timestamp, a random nonce, the signer's public key, the peer id it is meant
  for (empty until the sender has heard that peer answer), an HMAC-SHA256 keyed with the
  swarm key (membership) and an Ed25519 signature (identity). MAC and signature cover the
  same canonical bytes: a msgpack array of the proof's fields, what is asked (method and
  path of a request; the request's nonce for a reply) and the SHA-256 of the frame
  (``frame_digest``: buffer by buffer, so tensors are never joined into one copy; the caller
  hashes, so a daemon can hash a large frame off its event loop).
- A receiver checks the cheap things first (present, well-formed, inside the clock-skew
  window, meant for it), so a stranger cannot make it read a large body; then MAC,
  signature and nonce (``ReplayCache``); then, once decoded, that the message names no
  sender other than its signer (``check_sender``).
- A reply is bound to its request's nonce, so it needs no replay memory. Error replies are
  not sealed (all they can do is fail a request, which anyone on the path can do anyway),
  except one: a refusal as stale (``seal_refusal``) carries the refusing member's time under
  its seal, so that a node whose clock is far off can learn the swarm's time from members
  alone, not from whoever answers at an address. The sealed time is all it adds, bound to
  the request's nonce: a replayed refusal fails the nonce, and a forged one the MAC. A relay
  that refuses a stale request for the node behind it seals as itself, and the sender reads
  that time only from the relay it sent the request to.
- Every seal's ``ts`` is its sealer's time (``Outgoing.sealed_ts``), which is how a node
  measures its peers' clocks for proofs; ``clock_offset_s``, set by the caller, is added to
  every ``now`` (stamping and checking alike), so a node whose own clock is off speaks the
  swarm's time (``node.net.swarmtime``).

Pure: the caller passes the wall-clock ``now`` and does the file and socket I/O. Does not
own key files (``node.identity``), HTTP (``node.net.transport``), what follows a refusal or
how the clock offset is estimated.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import hmac
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_pem_private_key,
)

from protocol.errors import (
    AuthBadMac,
    AuthBadSignature,
    AuthMalformed,
    AuthMisdirected,
    AuthMissing,
    AuthReplay,
    AuthStale,
    IdentityMismatch,
)
from protocol.messages import (
    Backward,
    DialBack,
    Dropped,
    Error,
    Forward,
    GossipFollow,
    GossipRequest,
    HeadBackup,
    Hello,
    Leave,
    Message,
    MoveRequest,
    Ping,
    Pong,
    Probe,
    Rollback,
    Welcome,
)

AUTH_HEADER = "X-Murmur-Auth"
PEER_ID_HEX = 32
"""Hex digits of a key-derived peer id (128 bits: no second key reaches the same id)."""
SKEW_WINDOW_S = 60.0
"""How far a request's timestamp may be from the receiver's clock, either way."""
MIN_SWARM_KEY_BYTES = 16
MAX_KNOWN_ADDRESSES = 4096
"""Addresses whose answering peer id a node remembers (for ``to=``) before starting over."""

Buffers = Iterable[bytes | bytearray | memoryview]

_PROOF = re.compile(
    r"v=1,ts=(?P<ts>\d{1,12}\.\d{3}),nonce=(?P<nonce>[0-9a-f]{32}),key=(?P<key>[0-9a-f]{64}),"
    r"to=(?P<to>(?:[0-9a-f]{32})?),mac=(?P<mac>[0-9a-f]{64}),sig=(?P<sig>[0-9a-f]{128})"
)


def peer_id_of(public_key: bytes) -> str:
    """The peer id that belongs to a raw 32-byte Ed25519 public key."""
    return hashlib.sha256(public_key).hexdigest()[:PEER_ID_HEX]


def frame_digest(buffers: Buffers) -> bytes:
    """SHA-256 of a frame given as its buffers (each hashed in place, none copied)."""
    h = hashlib.sha256()
    for buf in buffers:
        h.update(buf)
    return h.digest()


class Identity:
    """A peer's Ed25519 key pair and the peer id derived from its public key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte private key (tests and known-answer vectors)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def from_pem(cls, data: bytes) -> Identity:
        """The identity kept in a PEM (PKCS#8) file; ``ValueError`` for anything else."""
        try:
            key = load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a readable private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"a {type(key).__name__}, not an Ed25519 private key")
        return cls(key)

    def to_pem(self) -> bytes:
        return self._key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


@dataclass(frozen=True)
class Proof:
    """The fields of one ``X-Murmur-Auth`` header."""

    ts: str
    """Seconds since the epoch with three decimals, kept as sent (it is signed as text)."""
    nonce: str
    key: bytes
    """The signer's raw public key."""
    to: str
    """Peer id of the intended receiver; empty when the sender does not know it yet."""
    mac: bytes
    sig: bytes

    @property
    def signer(self) -> str:
        return peer_id_of(self.key)

    def header(self) -> str:
        return (
            f"v=1,ts={self.ts},nonce={self.nonce},key={self.key.hex()},to={self.to},"
            f"mac={self.mac.hex()},sig={self.sig.hex()}"
        )


def parse_proof(header: str | None) -> Proof:
    """The proof in a header value; ``AuthMissing`` or ``AuthMalformed`` when there is none."""
    if header is None:
        raise AuthMissing(f"no {AUTH_HEADER} header: this swarm needs its swarm key")
    m = _PROOF.fullmatch(header)
    if m is None:
        raise AuthMalformed(f"the {AUTH_HEADER} header is not v=1,ts=,nonce=,key=,to=,mac=,sig=")
    return Proof(
        ts=m["ts"],
        nonce=m["nonce"],
        key=bytes.fromhex(m["key"]),
        to=m["to"],
        mac=bytes.fromhex(m["mac"]),
        sig=bytes.fromhex(m["sig"]),
    )


def signed_bytes(
    context: Sequence[str], ts: str, nonce: str, key: bytes, to: str, digest: bytes
) -> bytes:
    """The canonical bytes MAC and signature cover (a msgpack array: unambiguous)."""
    fields = ["murmuration-auth/1", *context, ts, nonce, key, to, digest]
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def claimed_sender(msg: Message) -> str | None:
    """The peer id ``msg`` says it comes from, or None when it names no sender."""
    if isinstance(msg, Hello | Welcome):
        return msg.sender.peer_id
    if isinstance(msg, Leave):
        return msg.peer_id
    if isinstance(
        msg,
        GossipRequest
        | GossipFollow
        | HeadBackup
        | Rollback
        | DialBack
        | MoveRequest
        | Ping
        | Probe
        | Dropped,
    ):
        return msg.sender
    if isinstance(msg, Pong):
        return None if msg.sender is None else msg.sender.peer_id
    if isinstance(msg, Forward) and msg.path:
        return msg.path[-1].peer_id  # each hop appends itself before sending on
    if isinstance(msg, Backward) and 0 <= msg.index < len(msg.path):
        # hop index+1 sends the gradient back to hop index; the head (path[0]) sends the first
        return msg.path[(msg.index + 1) % len(msg.path)].peer_id
    return None


def check_sender(msg: Message, signer: str) -> None:
    """``IdentityMismatch`` unless ``msg`` names no sender or names ``signer``."""
    claimed = claimed_sender(msg)
    if claimed is not None and claimed != signer:
        raise IdentityMismatch(
            f"{msg.TYPE} claims to come from peer {claimed[:8]} but is signed by {signer[:8]}"
        )


class ReplayCache:
    """Nonces seen inside the clock-skew window, at most ``max_entries`` of them.

    A nonce is kept until its timestamp has left the window (a replay is stale after that).
    When full, the entry that would expire first is dropped and a floor rises to its
    timestamp: anything stamped at or before the floor is refused as stale, so forgetting a
    nonce never lets its request back in.
    """

    def __init__(self, window_s: float, max_entries: int) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self.floor_ts = float("-inf")
        self._heap: list[tuple[float, str]] = []
        self._seen: set[str] = set()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: str, ts: float, now: float) -> None:
        """Remember ``nonce``; ``AuthReplay`` if already seen, ``AuthStale`` below the floor."""
        while self._heap and self._heap[0][0] < now - self.window_s:
            self._seen.discard(heapq.heappop(self._heap)[1])
        if nonce in self._seen:
            raise AuthReplay(f"nonce {nonce[:8]}.. was already used: a replayed request")
        if len(self._seen) >= self.max_entries:
            oldest, dropped = heapq.heappop(self._heap)
            self._seen.discard(dropped)
            self.floor_ts = max(self.floor_ts, oldest)
        if ts <= self.floor_ts:
            raise AuthStale("request is older than this node's replay memory reaches")
        heapq.heappush(self._heap, (ts, nonce))
        self._seen.add(nonce)


class SwarmAuth:
    """One node's side of a keyed swarm: seals what it sends, checks what it receives."""

    def __init__(
        self,
        swarm_key: bytes,
        identity: Identity,
        *,
        window_s: float = SKEW_WINDOW_S,
        max_nonces: int = 1 << 17,
    ) -> None:
        if len(swarm_key) < MIN_SWARM_KEY_BYTES:
            raise ValueError(
                f"the swarm key must be at least {MIN_SWARM_KEY_BYTES} characters "
                "(for example: python -c 'import secrets; print(secrets.token_hex(32))')"
            )
        self._swarm_key = swarm_key
        self.identity = identity
        self.window_s = window_s
        self.replays = ReplayCache(window_s, max_nonces)
        self.clock_offset_s = 0.0
        """Added to every ``now`` given: how far the swarm's clock is ahead of the caller's
        (0 unless its clock is off; ``node.net.swarmtime`` sets it)."""
        self._peer_at: dict[str, str] = {}
        """Address -> peer id whose sealed reply last came from there (the next ``to``)."""

    # ---- client side ----------------------------------------------------------------------

    def sign_request(
        self,
        address: str,
        method: str,
        path: str,
        digest: bytes,
        now: float,
        nonce: str = "",
        peer_id: str = "",
    ) -> Outgoing:
        """Seal a request to ``address`` whose frame has ``digest``; the returned exchange
        then checks its reply. With ``peer_id`` the request is meant for that peer alone and
        only a reply it sealed is accepted; without, for whoever last answered there."""
        to = peer_id or self._peer_at.get(address, "")
        now += self.clock_offset_s
        proof = self._seal(("request", method, path), digest, now, to, nonce)
        return Outgoing(self, address, proof, peer_id)

    # ---- server side ----------------------------------------------------------------------

    def accept(self, header: str | None, method: str, path: str, now: float) -> Incoming:
        """The cheap checks on a request's proof, made before its body is read."""
        now += self.clock_offset_s
        proof = self._fresh(parse_proof(header), now)
        if proof.to and proof.to != self.identity.peer_id:
            raise AuthMisdirected(
                f"request meant for peer {proof.to[:8]}, this is {self.identity.peer_id[:8]}"
            )
        return Incoming(self, proof, ("request", method, path), now)

    def accept_for(
        self, peer_id: str, header: str | None, method: str, path: str, now: float
    ) -> Incoming:
        """A relay's cheap checks on a request it is to pass to ``peer_id``: the request must
        be meant for that peer (and fresh); ``Incoming.verify`` then checks MAC and signature,
        so a stranger cannot use this node as a relay."""
        now += self.clock_offset_s
        proof = self._fresh(parse_proof(header), now)
        if proof.to != peer_id:
            raise AuthMisdirected(
                f"request meant for peer {proof.to[:8] or '(nobody)'}, relayed to {peer_id[:8]}"
            )
        return Incoming(self, proof, ("request", method, path), now)

    def seal_refusal(self, header: str | None, digest: bytes, now: float) -> str | None:
        """The header for a refusal of a request as stale (``AuthStale``; the refusal's frame
        has ``digest``): this node's time, sealed for the request's claimed signer and bound
        to its nonce. None when the request's proof does not parse. The request itself is
        unchecked (it was refused before its MAC), so this tells nothing but the time, and
        only to the holder of the claimed key who chose that nonce."""
        try:
            proof = parse_proof(header)
        except (AuthMissing, AuthMalformed):
            return None
        context = ("reply", proof.nonce)
        return self._seal(context, digest, now + self.clock_offset_s, proof.signer).header()

    # ---- shared ---------------------------------------------------------------------------

    def _fresh(self, proof: Proof, now: float) -> Proof:
        skew = now - float(proof.ts)
        if abs(skew) > self.window_s:
            raise AuthStale(
                f"request stamped {abs(skew):.0f}s {'behind' if skew > 0 else 'ahead of'} this "
                f"node's clock, beyond the {self.window_s:.0f}s window (are both clocks set?)"
            )
        return proof

    def _seal(
        self, context: Sequence[str], digest: bytes, now: float, to: str, nonce: str = ""
    ) -> Proof:
        ts, nonce = f"{now:.3f}", nonce or secrets.token_hex(16)
        key = self.identity.public_key
        data = signed_bytes(context, ts, nonce, key, to, digest)
        mac = hmac.digest(self._swarm_key, data, "sha256")
        return Proof(ts=ts, nonce=nonce, key=key, to=to, mac=mac, sig=self.identity.sign(data))

    def _verify(self, proof: Proof, context: Sequence[str], digest: bytes) -> None:
        data = signed_bytes(context, proof.ts, proof.nonce, proof.key, proof.to, digest)
        if not hmac.compare_digest(proof.mac, hmac.digest(self._swarm_key, data, "sha256")):
            raise AuthBadMac("MAC mismatch: not this swarm's key, or altered on the way")
        try:
            Ed25519PublicKey.from_public_bytes(proof.key).verify(proof.sig, data)
        except (InvalidSignature, ValueError):
            raise AuthBadSignature(
                f"the signature does not verify under the key of peer {proof.signer[:8]}"
            ) from None


class Incoming:
    """A received request whose proof passed the cheap checks; the body's turn next."""

    def __init__(self, auth: SwarmAuth, proof: Proof, context: Sequence[str], now: float) -> None:
        self._auth = auth
        self.proof = proof
        self._context = context
        self._now = now
        self.signer = proof.signer

    def verify(self, digest: bytes) -> None:
        """MAC and signature over the body's ``digest``, then the nonce (only a genuine
        request may take a nonce)."""
        self._auth._verify(self.proof, self._context, digest)
        self._auth.replays.admit(self.proof.nonce, float(self.proof.ts), self._now)

    def check_sender(self, msg: Message) -> None:
        check_sender(msg, self.signer)

    def seal_reply(self, digest: bytes) -> str:
        """The header for a successful reply (frame ``digest``), bound to this request's
        nonce and signer."""
        context = ("reply", self.proof.nonce)
        return self._auth._seal(context, digest, self._now, self.signer).header()


class Outgoing:
    """A sent request: its header, and the checks its reply must pass."""

    def __init__(self, auth: SwarmAuth, address: str, proof: Proof, expect: str = "") -> None:
        self._auth = auth
        self._address = address
        self._expect = expect
        self.proof = proof
        self.header = proof.header()
        self.signer: str | None = None
        """Peer id that sealed the reply (set by ``open_reply`` for a successful reply)."""
        self.sealed_ts: float | None = None
        """The sealer's time, from a verified seal: every successful reply's, and a refusal's
        where it carries one (``SwarmAuth.seal_refusal``)."""
        self.sealed_by: str | None = None
        """Peer id that sealed a reply whose ``sealed_ts`` is set."""

    def open_reply(self, status: int, header: str | None, digest: bytes, relay: str = "") -> None:
        """Before decoding: a successful (200) reply (frame ``digest``) must be sealed by a
        swarm member. A refusal's seal, if any, is checked the same way; one that fails
        leaves the refusal as it is (refusals need no seal), without its time. For a request
        meant for a named peer, a refusal's time counts from that peer or from ``relay``, the
        peer id of the relay that carried the request (a relay refuses a stale request
        itself, sealed as itself): a member on the path cannot pass off times under other
        identities."""
        if status != 200:  # refusals are checked once decoded: they must be Error frames
            if header is not None:
                with contextlib.suppress(AuthMissing, AuthMalformed, AuthBadMac, AuthBadSignature):
                    proof = parse_proof(header)
                    if proof.to == self._auth.identity.peer_id:
                        self._auth._verify(proof, ("reply", self.proof.nonce), digest)
                        if not self._expect or proof.signer in (self._expect, relay):
                            self.sealed_ts, self.sealed_by = float(proof.ts), proof.signer
            return
        proof = parse_proof(header)
        if proof.to != self._auth.identity.peer_id:
            raise AuthMisdirected(f"reply sealed for peer {proof.to[:8] or '(nobody)'}, not us")
        self._auth._verify(proof, ("reply", self.proof.nonce), digest)
        if self._expect and proof.signer != self._expect:
            raise IdentityMismatch(
                f"the reply from {self._address} is sealed by peer {proof.signer[:8]}, not by "
                f"{self._expect[:8]} whom the request was for (a false address for that peer?)"
            )
        self.signer = self.sealed_by = proof.signer
        self.sealed_ts = float(proof.ts)
        if len(self._auth._peer_at) >= MAX_KNOWN_ADDRESSES:  # churn: forget, relearn on use
            self._auth._peer_at.clear()
        self._auth._peer_at[self._address] = proof.signer

    def check_reply(self, msg: Message) -> None:
        """After decoding: refusals are Error frames; others name no sender but the sealer."""
        if isinstance(msg, Error):
            if msg.code == AuthMisdirected.code:  # another node now answers at that address
                self._auth._peer_at.pop(self._address, None)
            return
        if self.signer is None:
            raise AuthMissing(f"a {msg.TYPE} reply with an error status and no seal")
        check_sender(msg, self.signer)

"""Unit tests of ``protocol.auth`` (proofs, replay memory, identity binding) and of the
key files behind them (``node.identity``), with hand-made keys, nonces and clocks."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from node.config import NetConfig, describe, resolve_config
from node.identity import IDENTITY_FILE, load_identity, load_swarm_key, swarm_auth
from protocol.auth import (
    AUTH_HEADER,
    Identity,
    Incoming,
    ReplayCache,
    SwarmAuth,
    claimed_sender,
    frame_digest,
    parse_proof,
    peer_id_of,
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
    Ack,
    Backward,
    Dropped,
    Error,
    FetchState,
    Forward,
    Hello,
    Hop,
    Leave,
    PeerRecord,
    Welcome,
    encode_message,
)

KEY = b"correct horse battery staple"
NOW = 1_700_000_000.0
ALICE = Identity.from_seed(bytes(range(32)))
BOB = Identity.from_seed(bytes(range(32, 64)))
MALLORY = Identity.from_seed(bytes(32 * [7]))
NONCE = "0123456789abcdef" * 2
EMPTY = frame_digest([])


def leave(peer_id: str) -> list[bytes | memoryview]:
    return encode_message(Leave(peer_id=peer_id))


def request(
    body: list[bytes | memoryview], key: bytes = KEY, who: Identity = ALICE, now: float = NOW
) -> str:
    """The header ``who`` puts on a ``POST /rpc`` of ``body`` (a fresh nonce each time)."""
    return SwarmAuth(key, who).sign_request("bob:1", "POST", "/rpc", frame_digest(body), now).header


@pytest.fixture
def bob() -> SwarmAuth:
    return SwarmAuth(KEY, BOB)


def receive(
    bob: SwarmAuth, header: str | None, body: list[bytes | memoryview], now: float = NOW
) -> str:
    """Bob's checks, in the daemon's order; returns the signer's peer id."""
    incoming = bob.accept(header, "POST", "/rpc", now)
    incoming.verify(frame_digest(body))
    return incoming.signer


# ---- identity ---------------------------------------------------------------------------


def test_peer_id_is_the_hash_of_the_public_key() -> None:
    assert len(ALICE.public_key) == 32
    assert ALICE.peer_id == hashlib.sha256(ALICE.public_key).hexdigest()[:32]
    assert peer_id_of(BOB.public_key) == BOB.peer_id != ALICE.peer_id
    again = Identity.from_pem(ALICE.to_pem())
    assert again.peer_id == ALICE.peer_id
    assert (
        Ed25519PublicKey.from_public_bytes(ALICE.public_key).verify(again.sign(b"x"), b"x") is None
    )


def test_a_pem_that_is_not_an_ed25519_key_is_refused() -> None:
    with pytest.raises(ValueError, match="not a readable private key"):
        Identity.from_pem(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    ec_pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
    )
    with pytest.raises(ValueError, match="not an Ed25519 private key"):
        Identity.from_pem(ec_pem)


def test_a_short_swarm_key_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        SwarmAuth(b"hunter2", ALICE)


# ---- the proof --------------------------------------------------------------------------


def test_known_answer_proof_matches_an_independent_computation() -> None:
    body = leave(ALICE.peer_id)
    header = (
        SwarmAuth(KEY, ALICE)
        .sign_request("b:1", "POST", "/rpc", frame_digest(body), NOW, NONCE)
        .header
    )
    proof = parse_proof(header)
    assert (proof.ts, proof.nonce, proof.key, proof.to) == (
        "1700000000.000",
        NONCE,
        ALICE.public_key,
        "",
    )
    digest = hashlib.sha256(b"".join(bytes(b) for b in body)).digest()
    signed = msgpack.packb(
        ["murmuration-auth/1", "request", "POST", "/rpc", "1700000000.000", NONCE]
        + [ALICE.public_key, "", digest],
        use_bin_type=True,
    )
    assert proof.mac == hmac.new(KEY, signed, hashlib.sha256).digest()
    Ed25519PublicKey.from_public_bytes(ALICE.public_key).verify(proof.sig, signed)
    assert header == (
        f"v=1,ts=1700000000.000,nonce={NONCE},key={ALICE.public_key.hex()},to=,"
        f"mac={proof.mac.hex()},sig={proof.sig.hex()}"
    )


def test_frame_digest_hashes_buffers_in_place() -> None:
    body = encode_message(FetchState(stage=1, tensors={"t": torch.arange(10.0)}))
    assert any(isinstance(b, memoryview) for b in body)
    assert frame_digest(body) == hashlib.sha256(b"".join(bytes(b) for b in body)).digest()


def test_a_good_request_is_accepted_and_names_its_signer(bob: SwarmAuth) -> None:
    body = leave(ALICE.peer_id)
    assert receive(bob, request(body), body) == ALICE.peer_id
    assert len(bob.replays) == 1


def test_a_request_without_a_proof_is_refused(bob: SwarmAuth) -> None:
    with pytest.raises(AuthMissing):
        receive(bob, None, leave(ALICE.peer_id))
    for bad in ["", "v=1", request(leave("x"))[:-2], request(leave("x")).replace("v=1", "v=2")]:
        with pytest.raises(AuthMalformed):
            receive(bob, bad, leave("x"))


def test_a_request_under_a_wrong_key_is_refused(bob: SwarmAuth) -> None:
    body = leave(ALICE.peer_id)
    with pytest.raises(AuthBadMac):
        receive(bob, request(body, key=b"another swarm's key!"), body)


def test_a_replayed_request_is_refused(bob: SwarmAuth) -> None:
    body = leave(ALICE.peer_id)
    header = request(body)
    receive(bob, header, body)
    with pytest.raises(AuthReplay):
        receive(bob, header, body, now=NOW + 5)


def test_a_stale_or_future_request_is_refused(bob: SwarmAuth) -> None:
    body = leave(ALICE.peer_id)
    with pytest.raises(AuthStale):
        receive(bob, request(body, now=NOW - 61), body)
    with pytest.raises(AuthStale):
        receive(bob, request(body, now=NOW + 61), body)
    receive(bob, request(body, now=NOW - 59), body)


def test_a_tampered_body_is_refused(bob: SwarmAuth) -> None:
    header = request(leave(ALICE.peer_id))
    with pytest.raises(AuthBadMac):
        receive(bob, header, leave(BOB.peer_id))
    with pytest.raises(AuthBadMac):
        receive(bob, header, [*leave(ALICE.peer_id), b"\0"])


def test_a_tampered_header_is_refused(bob: SwarmAuth) -> None:
    body = leave(ALICE.peer_id)
    header = request(body)
    proof = parse_proof(header)
    later = header.replace(f"ts={proof.ts}", "ts=1700000001.000")
    other_nonce = header.replace(proof.nonce, "f" * 32)  # a replay dressed up as new
    for bad in (later, other_nonce):
        with pytest.raises(AuthBadMac):
            receive(bob, bad, body)
    flipped = bytearray(proof.sig)
    flipped[0] ^= 1
    with pytest.raises(AuthBadSignature):
        receive(bob, header.replace(proof.sig.hex(), flipped.hex()), body)
    assert len(bob.replays) == 0  # no forgery took a nonce


def test_a_member_cannot_sign_with_another_peers_key(bob: SwarmAuth) -> None:
    """Mallory holds the swarm key, so she can make a valid MAC over Alice's public key,
    but not Alice's signature: the proof names Alice and fails."""
    body = leave(ALICE.peer_id)
    forged = SwarmAuth(KEY, MALLORY).sign_request("b:1", "POST", "/rpc", frame_digest(body), NOW)
    proof = forged.proof
    signed = msgpack.packb(
        ["murmuration-auth/1", "request", "POST", "/rpc", proof.ts, proof.nonce]
        + [ALICE.public_key, "", frame_digest(body)],
        use_bin_type=True,
    )
    mac = hmac.new(KEY, signed, hashlib.sha256).digest()
    header = forged.header.replace(MALLORY.public_key.hex(), ALICE.public_key.hex())
    header = header.replace(proof.mac.hex(), mac.hex())
    with pytest.raises(AuthBadSignature):
        receive(bob, header, body)


def test_a_member_cannot_claim_another_peer_id_in_the_message(bob: SwarmAuth) -> None:
    body = leave(ALICE.peer_id)  # Mallory asks Bob to forget Alice
    incoming = bob.accept(request(body, who=MALLORY), "POST", "/rpc", NOW)
    incoming.verify(frame_digest(body))
    with pytest.raises(IdentityMismatch) as e:
        incoming.check_sender(Leave(peer_id=ALICE.peer_id))
    assert e.value.http_status == 403
    incoming.check_sender(Leave(peer_id=MALLORY.peer_id))
    incoming.check_sender(FetchState(stage=1))  # names no sender


def test_claimed_sender_of_each_message_kind() -> None:
    a, b, c = (Hop(i, f"p{i}", f"h:{i}") for i in range(3))
    record = PeerRecord(peer_id="p9", address="h:9", stage=1)
    assert claimed_sender(Hello(swarm="s", fingerprint="f", sender=record, peers=[])) == "p9"
    welcome = Welcome(swarm="s", fingerprint="f", sender=record, peers=[], observed_host="h")
    assert claimed_sender(welcome) == "p9"
    fwd = Forward(mb_id="m", target_stage=2, path=[a, b], eval=False, meta={})
    assert claimed_sender(fwd) == "p1"
    # the head (p0) sends the first gradient to the last hop; hop i sends to hop i-1
    assert claimed_sender(Backward(mb_id="m", index=2, path=[a, b, c], meta={})) == "p0"
    assert claimed_sender(Backward(mb_id="m", index=0, path=[a, b, c], meta={})) == "p1"
    assert claimed_sender(Backward(mb_id="m", index=5, path=[a], meta={})) is None
    assert claimed_sender(Dropped(mb_id="m", stage=1, sender="p7")) == "p7"
    assert claimed_sender(Ack()) is None


# ---- replies and addressing -------------------------------------------------------------


def exchange(bob: SwarmAuth, alice: SwarmAuth, reply_msg: Welcome | Ack) -> None:
    """Alice asks Bob at "bob:1"; Bob seals ``reply_msg``; Alice checks it."""
    body = leave(ALICE.peer_id)
    sent = alice.sign_request("bob:1", "POST", "/rpc", frame_digest(body), NOW)
    incoming = bob.accept(sent.header, "POST", "/rpc", NOW)
    incoming.verify(frame_digest(body))
    reply = frame_digest(encode_message(reply_msg))
    sent.open_reply(200, incoming.seal_reply(reply), reply)
    sent.check_reply(reply_msg)


def test_a_sealed_reply_is_checked_and_teaches_who_answers_there(bob: SwarmAuth) -> None:
    alice = SwarmAuth(KEY, ALICE)
    exchange(bob, alice, Ack())
    nxt = alice.sign_request("bob:1", "POST", "/rpc", frame_digest(leave(ALICE.peer_id)), NOW)
    assert nxt.proof.to == BOB.peer_id  # now bound to Bob: replaying it to Carol fails
    carol = SwarmAuth(KEY, MALLORY)
    with pytest.raises(AuthMisdirected) as e:
        carol.accept(nxt.header, "POST", "/rpc", NOW)
    assert e.value.http_status == 421
    bob.accept(nxt.header, "POST", "/rpc", NOW)
    # Carol answers at Bob's old address now: Alice forgets the binding on her refusal
    nxt.check_reply(Error(code="auth_misdirected", message="not me"))
    assert alice.sign_request("bob:1", "POST", "/rpc", EMPTY, NOW).proof.to == ""


def test_a_request_for_a_named_peer_accepts_only_that_peers_reply() -> None:
    """A member relays a false address for Bob's id: work meant for Bob reaches Mallory,
    who can seal a reply only as herself, and Alice refuses it."""
    alice, mallory = SwarmAuth(KEY, ALICE), SwarmAuth(KEY, MALLORY)
    body = leave(ALICE.peer_id)
    sent = alice.sign_request(
        "mallory:1", "POST", "/rpc", frame_digest(body), NOW, peer_id=BOB.peer_id
    )
    assert sent.proof.to == BOB.peer_id  # sealed for Bob, even at an address never answered
    with pytest.raises(AuthMisdirected):  # an honest node there says it is not Bob
        mallory.accept(sent.header, "POST", "/rpc", NOW)
    # a dishonest one skips that check and answers as herself: the seal gives her away
    incoming = Incoming(mallory, parse_proof(sent.header), ("request", "POST", "/rpc"), NOW)
    incoming.verify(frame_digest(body))
    reply = frame_digest(encode_message(Ack()))
    with pytest.raises(IdentityMismatch, match="not by"):
        sent.open_reply(200, incoming.seal_reply(reply), reply)
    # Bob's own reply is accepted
    sent = alice.sign_request("bob:1", "POST", "/rpc", frame_digest(body), NOW, peer_id=BOB.peer_id)
    incoming = SwarmAuth(KEY, BOB).accept(sent.header, "POST", "/rpc", NOW)
    incoming.verify(frame_digest(body))
    sent.open_reply(200, incoming.seal_reply(reply), reply)
    assert sent.signer == BOB.peer_id


def test_a_reply_claiming_another_sender_is_refused(bob: SwarmAuth) -> None:
    imposter = PeerRecord(peer_id=ALICE.peer_id, address="bob:1", stage=1)
    with pytest.raises(IdentityMismatch):
        exchange(bob, SwarmAuth(KEY, ALICE), Welcome("s", "f", imposter, [], "h"))


def test_an_unsealed_or_foreign_reply_is_refused(bob: SwarmAuth) -> None:
    alice = SwarmAuth(KEY, ALICE)
    reply = frame_digest(encode_message(Ack()))
    sent = alice.sign_request("bob:1", "POST", "/rpc", frame_digest(leave(ALICE.peer_id)), NOW)
    with pytest.raises(AuthMissing):
        sent.open_reply(200, None, reply)
    # a reply Bob sealed for another request (another nonce) does not fit this one
    other = bob.accept(
        alice.sign_request("bob:1", "POST", "/rpc", EMPTY, NOW).header, "POST", "/rpc", NOW
    )
    with pytest.raises(AuthBadMac):
        sent.open_reply(200, other.seal_reply(reply), reply)
    with pytest.raises(AuthMissing):  # an error status on a non-error frame
        sent.open_reply(409, None, reply)
        sent.check_reply(Ack())
    refusal = Error(code="busy", message="queue full")
    sent.open_reply(503, None, frame_digest(encode_message(refusal)))
    sent.check_reply(refusal)  # refusals travel unsealed: they can only fail a request


def test_a_refusal_as_stale_carries_the_refusers_time_under_its_seal(bob: SwarmAuth) -> None:
    """Alice's clock is two hours behind: Bob refuses her request as stale, sealed with his
    time, for her nonce; she learns his time only from a seal that verifies."""
    alice = SwarmAuth(KEY, ALICE)
    body = leave(ALICE.peer_id)
    late = NOW - 7200.0
    sent = alice.sign_request("bob:1", "POST", "/rpc", frame_digest(body), late)
    with pytest.raises(AuthStale):
        bob.accept(sent.header, "POST", "/rpc", NOW)
    refusal = frame_digest(encode_message(Error(code="auth_stale", message="stale")))
    seal = bob.seal_refusal(sent.header, refusal, NOW)
    assert seal is not None and parse_proof(seal).to == ALICE.peer_id
    sent.open_reply(401, seal, refusal)
    assert (sent.sealed_by, sent.sealed_ts) == (BOB.peer_id, NOW)

    # what does not verify teaches nothing, and the refusal stands as it was
    def learned(seal_for: Callable[[str], str | None]) -> float | None:
        again = alice.sign_request("bob:1", "POST", "/rpc", frame_digest(body), late)
        again.open_reply(401, seal_for(again.header), refusal)
        return again.sealed_ts

    busy = frame_digest(encode_message(Error(code="busy", message="")))
    stranger = SwarmAuth(b"another swarm's key", BOB)
    assert learned(lambda h: bob.seal_refusal(h, refusal, NOW)) == NOW
    assert learned(lambda h: bob.seal_refusal(h, busy, NOW)) is None  # another frame
    assert learned(lambda h: stranger.seal_refusal(h, refusal, NOW)) is None
    assert learned(lambda h: bob.seal_refusal(request(body), refusal, NOW)) is None  # nonce
    assert learned(lambda h: None) is None
    assert learned(lambda h: "v=1,ts=1") is None
    # a request for a named peer learns the time only from that peer, or from the relay it
    # was sent through (which refuses a stale request itself, sealed as itself)
    named = alice.sign_request("x:1", "POST", "/rpc", EMPTY, late, peer_id=MALLORY.peer_id)
    named.open_reply(401, bob.seal_refusal(named.header, refusal, NOW), refusal)
    assert named.sealed_ts is None
    named.open_reply(401, bob.seal_refusal(named.header, refusal, NOW), refusal, "f" * 32)
    assert named.sealed_ts is None  # another relay's name
    named.open_reply(401, bob.seal_refusal(named.header, refusal, NOW), refusal, BOB.peer_id)
    assert (named.sealed_by, named.sealed_ts) == (BOB.peer_id, NOW)
    assert bob.seal_refusal("v=1,garbage", refusal, NOW) is None
    assert bob.seal_refusal(None, refusal, NOW) is None


def test_a_clock_offset_stamps_and_checks_proofs_in_the_swarms_time(bob: SwarmAuth) -> None:
    """Alice's machine reads two hours early; with the swarm's offset set, her requests are
    fresh to Bob, his to her, and her replies' seals carry the swarm's time."""
    alice = SwarmAuth(KEY, ALICE)
    alice.clock_offset_s = 7200.0
    late = NOW - 7200.0
    body = leave(ALICE.peer_id)
    sent = alice.sign_request("bob:1", "POST", "/rpc", frame_digest(body), late)
    assert float(sent.proof.ts) == NOW
    assert receive(bob, sent.header, body) == ALICE.peer_id
    incoming = alice.accept(request(body, who=BOB), "POST", "/rpc", late)
    incoming.verify(frame_digest(body))
    assert float(parse_proof(incoming.seal_reply(EMPTY)).ts) == NOW
    assert alice.accept_for(
        ALICE.peer_id,
        SwarmAuth(KEY, BOB)
        .sign_request("a:1", "POST", "/rpc", EMPTY, NOW, peer_id=ALICE.peer_id)
        .header,
        "POST",
        "/rpc",
        late,
    )
    alice.clock_offset_s = 0.0
    with pytest.raises(AuthStale):
        alice.accept(request(body, who=BOB), "POST", "/rpc", late)


def test_replay_memory_is_bounded_without_reopening_replays() -> None:
    cache = ReplayCache(window_s=60.0, max_entries=2)
    cache.admit("a", NOW, NOW)
    cache.admit("b", NOW + 1, NOW + 1)
    cache.admit("c", NOW + 2, NOW + 2)  # full: "a" is dropped, the floor rises to its time
    assert len(cache) == 2 and cache.floor_ts == NOW
    with pytest.raises(AuthStale):
        cache.admit("a", NOW, NOW + 3)
    with pytest.raises(AuthReplay):
        cache.admit("c", NOW + 2, NOW + 3)
    cache.admit("d", NOW + 200, NOW + 200)  # b and c left the window and are forgotten
    assert len(cache) == 1


# ---- key files ----------------------------------------------------------------------------


def test_identity_is_created_once_and_kept(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = load_identity(str(state))
    path = state / IDENTITY_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_identity(str(state)).peer_id == first.peer_id
    assert load_identity("").peer_id != load_identity("").peer_id  # ephemeral
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=IDENTITY_FILE):
        load_identity(str(state))


def test_swarm_key_from_flag_or_file(tmp_path: Path) -> None:
    key_file = tmp_path / "swarm.key"
    key_file.write_text("  0123456789abcdef0123  \n")

    def net(**settings: str) -> NetConfig:
        return resolve_config(overrides={f"net.{k}": v for k, v in settings.items()}).net

    assert load_swarm_key(net()) is None
    assert load_swarm_key(net(swarm_key_file=str(key_file))) == b"0123456789abcdef0123"
    assert load_swarm_key(net(swarm_key="k" * 16)) == b"k" * 16
    with pytest.raises(ValueError, match="not both"):
        load_swarm_key(net(swarm_key="k" * 16, swarm_key_file=str(key_file)))
    with pytest.raises(ValueError, match="cannot read"):
        load_swarm_key(net(swarm_key_file=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="at least 16"):
        swarm_auth(net(swarm_key="short"), ALICE)


def test_the_swarm_key_stays_out_of_logs_and_reprs() -> None:
    config = resolve_config(env={"MURMUR_NET_SWARM_KEY": "s3cret-s3cret-s3cret"})
    assert config.net.swarm_key == "s3cret-s3cret-s3cret"
    assert "s3cret" not in repr(config) and "s3cret" not in str(describe(config))
    assert describe(config)["net"]["swarm_key"] == "<set>"
    assert AUTH_HEADER == "X-Murmur-Auth"

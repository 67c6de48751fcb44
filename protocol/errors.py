"""Errors for bad frames and bad messages, one class per kind of fault.

Owns: the ``ProtocolError`` hierarchy. Each class carries a stable machine-readable
``code`` (sent back to the peer that sent the bad frame) and the HTTP status a server
answers with. All are ``ValueError`` subclasses: they describe bad input, never a bug here.
The message of each raised error says concretely what was wrong, for example
"frame declares header of 2000000 bytes, limit is 1048576".

Does not own: deciding what to do about a bad peer (banning, retrying) or any transport;
those live in ``swarm`` and ``node``.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AuthBadMac",
    "AuthBadSignature",
    "AuthError",
    "AuthMalformed",
    "AuthMisdirected",
    "AuthMissing",
    "AuthReplay",
    "AuthStale",
    "BadMagic",
    "BadTensorSpec",
    "FrameTooLarge",
    "HeaderTooLarge",
    "IdentityMismatch",
    "MalformedHeader",
    "MalformedMessage",
    "ProtocolError",
    "TruncatedFrame",
    "UnknownMessageType",
    "UnsupportedDtype",
    "UnsupportedVersion",
]


class ProtocolError(ValueError):
    """A frame or message from a peer that this node cannot accept."""

    code: ClassVar[str] = "protocol_error"
    """Stable machine-readable code, sent back to the peer."""
    http_status: ClassVar[int] = 400
    """HTTP status a server answers with when it rejects the request for this reason."""


class BadMagic(ProtocolError):
    """The frame does not start with the protocol's magic bytes."""

    code = "bad_magic"


class UnsupportedVersion(ProtocolError):
    """The frame's version byte (or a flag or reserved bit) is not one this node speaks."""

    code = "unsupported_version"


class FrameTooLarge(ProtocolError):
    """The whole frame is larger than the receiver's limit."""

    code = "frame_too_large"
    http_status = 413


class HeaderTooLarge(ProtocolError):
    """The frame declares a msgpack header larger than the receiver's limit."""

    code = "header_too_large"
    http_status = 413


class TruncatedFrame(ProtocolError):
    """The frame ends before the prefix, the header or a tensor it declares."""

    code = "truncated_frame"


class MalformedHeader(ProtocolError):
    """The header is not msgpack, not a map, or has missing or mistyped fields."""

    code = "malformed_header"


class BadTensorSpec(ProtocolError):
    """A tensor table entry is inconsistent: shape, offset or length, overlap, duplicate name."""

    code = "bad_tensor_spec"


class UnsupportedDtype(ProtocolError):
    """A tensor's dtype is not one the wire format carries."""

    code = "unsupported_dtype"


class UnknownMessageType(ProtocolError):
    """The frame's message type is not one this node knows."""

    code = "unknown_message_type"


class MalformedMessage(ProtocolError):
    """A message is missing a field or has a field of the wrong type (message layer)."""

    code = "malformed_message"


class AuthError(ProtocolError):
    """A request (or reply) of a keyed swarm whose proof is absent or does not hold."""

    code = "auth_error"
    http_status = 401


class AuthMissing(AuthError):
    """No proof: the sender does not know the swarm key (or an open node met a keyed one)."""

    code = "auth_missing"


class AuthMalformed(AuthError):
    """The proof header is there but not in the expected form."""

    code = "auth_malformed"


class AuthStale(AuthError):
    """The proof's timestamp lies outside the clock-skew window (or the replay memory)."""

    code = "auth_stale"


class AuthMisdirected(AuthError):
    """The proof names another peer as the receiver: a request replayed to the wrong node."""

    code = "auth_misdirected"
    http_status = 421


class AuthBadMac(AuthError):
    """The swarm-key MAC does not match: wrong key, or the frame or proof was altered."""

    code = "auth_bad_mac"


class AuthBadSignature(AuthError):
    """The signature does not verify under the public key the proof carries."""

    code = "auth_bad_signature"


class AuthReplay(AuthError):
    """The proof's nonce was seen before: a captured request sent again."""

    code = "auth_replay"


class IdentityMismatch(AuthError):
    """The message claims a sender other than the peer whose key signed it."""

    code = "identity_mismatch"
    http_status = 403

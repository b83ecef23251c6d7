"""Names and values of moe-ep's store keys, sealed with a per-run token once there is one.

Anyone who can connect to the rendezvous store can list, read and write its keys (torch's
TCPStore has no authentication; `list_keys` exists on torch 2.15). Once every rank holds a
random token that never enters the store (rank 0 makes it and broadcasts it over the new
process group), each key is named by an HMAC of its logical name, so no other process can
create a key before a rank does, and each value carries an HMAC over its key and payload, so
none can alter one unseen. Unsealed keys (before the group exists) are plain names.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["TOKEN_BYTES", "Keys", "new_token"]

TOKEN_BYTES = 32
_MAC_BYTES = 32


def new_token() -> bytes:
    """A fresh random run token."""
    return secrets.token_bytes(TOKEN_BYTES)


class Keys:
    """Key names under `namespace`; sealed (HMAC-named, HMAC-tagged values) with a token."""

    def __init__(self, namespace: str, token: bytes | None = None) -> None:
        self.namespace = namespace
        self.token = token

    @property
    def sealed(self) -> bool:
        return self.token is not None

    def child(self, name: str) -> Keys:
        """The same scheme one level down (`namespace/name`)."""
        return Keys(f"{self.namespace}/{name}", self.token)

    def _mac(self, label: bytes, data: bytes) -> bytes:
        assert self.token is not None
        return hmac.new(self.token, label + b"\0" + data, hashlib.sha256).digest()

    def key(self, name: str) -> str:
        """The store key of logical `name`."""
        if self.token is None:
            return f"{self.namespace}/{name}"
        mac = self._mac(b"key", f"{self.namespace}/{name}".encode()).hex()[:32]
        return f"{self.namespace}/{mac}"

    def pack(self, key: str, payload: bytes) -> bytes:
        """The value to store under `key` (a store key from `key()`)."""
        if self.token is None:
            return payload
        return self._mac(b"value", key.encode() + b"\0" + payload) + payload

    def unpack(self, key: str, value: bytes) -> bytes | None:
        """The payload of `value` read from `key`; None if its seal does not match."""
        if self.token is None:
            return value
        tag, payload = value[:_MAC_BYTES], value[_MAC_BYTES:]
        want = self._mac(b"value", key.encode() + b"\0" + payload)
        return payload if hmac.compare_digest(tag, want) else None

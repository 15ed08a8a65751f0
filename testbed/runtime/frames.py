"""Authenticated frames between the engine processes (API server, engine core, DP coordinator, replicas,
headless node launchers).

Every ZMQ frame is a 16-byte keyed BLAKE2b tag followed by the msgpack payload. The key is the
deployment's secret: `deployment_secret()` makes one at start and hands it to every local process
through the environment (TESTBED_RPC_SECRET); headless nodes must be given the same value. A frame
whose tag does not match, which is too short, or which does not decode as the socket's message union
is dropped and logged (at most one line a second per process, with a count), and the process carries on.
Invariant: `decode` never raises, so no frame from the network can end a process.

What this does not do: encrypt (the traffic is readable by anyone on the path) or stop a replay of a
captured frame; multi-node deployments keep --data-parallel-rpc-port and the API server's output port
on a private network (docs/data-parallel.md).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import sys
import time
from typing import Any

import msgspec

SECRET_ENV = "TESTBED_RPC_SECRET"
TAG_BYTES = 16
_encoder = msgspec.msgpack.Encoder()


def deployment_secret(required_for: str | None = None) -> str:
    """The deployment's secret: TESTBED_RPC_SECRET, or a new random one put into this process's
    environment (so every process it starts inherits it). `required_for`: a deployment whose processes
    start elsewhere (headless nodes) must be given the secret; RuntimeError saying how when it is not set."""
    value = os.environ.get(SECRET_ENV, "")
    if value:
        return value
    if required_for is not None:
        raise RuntimeError(f"{required_for} needs the deployment's secret: set the environment variable {SECRET_ENV} "
                           "to the same value on every node (e.g. `export "
                           f"{SECRET_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')`)")
    value = secrets.token_hex(32)
    os.environ[SECRET_ENV] = value
    return value


class Frames:
    """Signs what a process sends and checks what it receives, with one deployment secret.
    `where` names the process in the log line of a dropped frame."""

    def __init__(self, secret: str, where: str) -> None:
        self._key = hashlib.blake2b(secret.encode(), digest_size=32).digest()
        self.where = where
        self.dropped = 0
        self._logged_at = 0.0
        self._unlogged = 0

    @classmethod
    def from_env(cls, where: str) -> "Frames":
        """The Frames of a process started by another one of the deployment (the secret is in its environment)."""
        secret = os.environ.get(SECRET_ENV, "")
        if not secret:
            raise RuntimeError(f"{where}: {SECRET_ENV} is not set; this process is started by `testbed serve`, which "
                               "sets it (a headless node needs it set by hand, to the API server node's value)")
        return cls(secret, where)

    def _tag(self, payload) -> bytes:
        return hashlib.blake2b(payload, digest_size=TAG_BYTES, key=self._key).digest()

    def sign(self, payload: bytes) -> bytes:
        """A frame carrying `payload`."""
        return self._tag(payload) + payload

    def encode(self, msg: Any) -> bytes:
        """A frame carrying `msg` encoded as msgpack."""
        return self.sign(_encoder.encode(msg))

    def open(self, frame, socket_name: str) -> memoryview | None:
        """The payload of an authentic frame, or None (dropped and logged)."""
        view = memoryview(frame)
        if len(view) < TAG_BYTES:
            self.drop(socket_name, f"{len(view)} bytes, shorter than a tag")
            return None
        if not hmac.compare_digest(self._tag(view[TAG_BYTES:]), view[:TAG_BYTES]):
            self.drop(socket_name, "its tag does not match the deployment's secret")
            return None
        return view[TAG_BYTES:]

    def decode(self, frame, decoder: msgspec.msgpack.Decoder, socket_name: str) -> Any | None:
        """The message of an authentic, well-formed frame, or None (dropped and logged). Never raises."""
        payload = self.open(frame, socket_name)
        if payload is None:
            return None
        try:
            return decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:  # signed but not one of this socket's messages
            self.drop(socket_name, f"not a message this socket takes ({e})")
            return None

    def drop(self, socket_name: str, why: str) -> None:
        """Count a dropped frame; log at most one line a second (a flood must not flood the log)."""
        self.dropped += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            more = f" ({self._unlogged - 1} more dropped since the last report)" if self._unlogged > 1 else ""
            print(f"{self.where}: dropped a malformed frame on {socket_name}: {why}{more}", file=sys.stderr, flush=True)
            self._logged_at, self._unlogged = now, 0

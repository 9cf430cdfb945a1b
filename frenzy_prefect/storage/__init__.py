"""Object storage through fsspec/s3fs, with bounded stalls and errors that name the URI.

S3 endpoints and credentials come from the standard AWS environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...), so the same code reaches AWS, MinIO or the
local moto server. Credentials never appear in our messages.

Every S3 request is bounded, so a stalled endpoint (a frozen process, a black-holed network)
fails the operation instead of holding GPUs (see STALL_BOUND_S):

- connecting: ``CONNECT_TIMEOUT_S``;
- waiting for the answer: ``READ_TIMEOUT_S`` without a byte (aiohttp's sock_read, which
  only starts once the request body is sent);
- sending a body: at once (no 'Expect: 100-continue', which aiohttp awaits with no timeout),
  and ``SEND_TIMEOUT_S`` without the peer acknowledging a byte or opening its receive window
  (Linux's TCP_USER_TIMEOUT; aiohttp has no write timeout, and a body larger than the socket
  buffers otherwise waits forever on a frozen peer);
- ``ATTEMPTS`` tries of each request in botocore's standard retry mode (timeouts, 5xx and
  throttling, with backoff), and none on top of them in s3fs (``retries=1``): s3fs's own loop
  (5 tries by default) multiplies botocore's, and twice over for ranged reads.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from fsspec import AbstractFileSystem

from frenzy_prefect.errors import StorageUnreachable

CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 15
SEND_TIMEOUT_S = 8
ATTEMPTS = 3
_MAX_PUT_BYTES = 5 * 2**30  # S3's limit for one PUT
# Against a frozen peer (its kernel still acknowledging, with a closed window) Linux drops the
# connection about 2 x TCP_USER_TIMEOUT + 1 s after the send stalls (measured: 11 s for 5 s,
# 17 s for 8 s, 30.5 s for 15 s), not 1 x as against a silent one.
_SEND_STALL_S = 2 * SEND_TIMEOUT_S + 1
_BACKOFF_S = 1 + 2  # botocore's standard mode sleeps up to 1 s, then up to 2 s, between tries
# The longest one stalled operation waits before failing: every try times out, plus the backoff.
STALL_BOUND_S = ATTEMPTS * max(CONNECT_TIMEOUT_S, READ_TIMEOUT_S, _SEND_STALL_S) + _BACKOFF_S


def _socket_with_send_timeout(addr_info: tuple) -> socket.socket:
    """aiohttp's socket factory: a TCP socket whose unacknowledged sends time out."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    if hasattr(socket, "TCP_USER_TIMEOUT") and family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, SEND_TIMEOUT_S * 1000)
    return sock


@cache
def _s3_config() -> dict[str, Any]:
    """botocore's client config for every S3 filesystem (built once: fsspec caches filesystems
    by their arguments)."""
    from aiobotocore.httpsession import AIOHTTPSession

    class SendAtOnce(AIOHTTPSession):
        """botocore asks for '100 Continue' before every PUT body, and aiohttp waits for it with
        no timeout at all (its read timeout starts once the body is sent): a frozen endpoint
        held a checkpoint upload forever. Without the header the body goes at once, bounded by
        SEND_TIMEOUT_S, and the answer by READ_TIMEOUT_S. The header is not signed."""

        async def send(self, request):
            request.headers.pop("Expect", None)
            return await super().send(request)

    return {
        "connect_timeout": CONNECT_TIMEOUT_S,
        "read_timeout": READ_TIMEOUT_S,
        "retries": {"mode": "standard", "total_max_attempts": ATTEMPTS},
        "connector_args": {"socket_factory": _socket_with_send_timeout},
        "http_session_cls": SendAtOnce,
    }


def _is_s3(uri: str) -> bool:
    return fsspec.core.split_protocol(uri)[0] in ("s3", "s3a")


def filesystem_options(uri: str) -> dict[str, Any]:
    """The arguments ``uri``'s filesystem is opened with, for libraries that open it themselves
    (DCP's FsspecWriter): fsspec hands them the instance ``filesystem`` configured."""
    if not _is_s3(uri):
        return {}
    # The endpoint is passed explicitly so that cached filesystem instances follow the environment.
    return {"endpoint_url": os.environ.get("AWS_ENDPOINT_URL"), "config_kwargs": _s3_config()}


def filesystem(uri: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem holding ``uri`` and the path inside it (s3://, file paths, memory://, ...)."""
    fs, path = fsspec.core.url_to_fs(uri, **filesystem_options(uri))
    if _is_s3(uri):
        fs.retries = 1  # a class attribute, not a constructor argument: botocore alone retries
    return fs, path


@cache
def _stall_errors() -> tuple[type[BaseException], ...]:
    """What a stalled or unreachable endpoint raises: our timeouts, connection failures."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]  # TimeoutError covers asyncio's and fsspec's
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError  # ReadTimeoutError, ConnectionClosedError, ...

        errors += [BotoConnectionError, HTTPClientError]  # EndpointConnectionError, ConnectTimeoutError, ...
    except ImportError:  # no S3 support installed: nothing S3-specific to translate
        pass
    return tuple(errors)


def _stall_in(exc: BaseException) -> BaseException | None:
    """The stall or connection failure ``exc`` is or wraps (s3fs re-raises some as OSError)."""
    stall, seen = _stall_errors(), set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, stall) or getattr(exc, "errno", None) == errno.ETIMEDOUT:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _describe(exc: BaseException) -> tuple[bool, str]:
    """Whether ``exc`` means the endpoint stopped answering (rather than refused or failed to
    resolve), and its name with the system's reason: ``EndpointConnectionError (Connection
    timed out)``."""
    inner = getattr(exc, "kwargs", {}).get("error")  # botocore keeps aiohttp's error here
    chain = [e for e in (exc, inner) if e is not None]
    codes = [e.errno for e in chain if isinstance(getattr(e, "errno", None), int)]
    timed_out = any(isinstance(e, TimeoutError) or "Timeout" in type(e).__name__ for e in chain) or errno.ETIMEDOUT in codes
    return timed_out, type(exc).__name__ + (f" ({os.strerror(codes[0])})" if codes else "")


def _endpoint_shown() -> str:
    """The S3 endpoint in use, without any user:password it may carry."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return "the default AWS endpoint"
    parts = urlsplit(endpoint)
    return urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else ""))) if parts.hostname else endpoint


@contextmanager
def reaching(uri: str) -> Iterator[None]:
    """Turn a stalled or unreachable endpoint into a StorageUnreachable naming the URI and endpoint."""
    started = time.monotonic()
    try:
        yield
    except Exception as exc:
        cause = _stall_in(exc)
        if cause is None:
            raise
        where = f"the object store holding {uri} (endpoint {_endpoint_shown()})"
        timed_out, what = _describe(cause)
        if timed_out:
            raise StorageUnreachable(f"{where} did not answer within {time.monotonic() - started:.0f} s: {what}") from None
        raise StorageUnreachable(f"cannot reach {where}: {what}") from None


@contextmanager
def open_uri(uri: str, mode: str = "rb", **kwargs: Any) -> Iterator[IO[Any]]:
    fs, path = filesystem(uri)
    with reaching(uri), fs.open(path, mode, **kwargs) as f:
        yield f


def write_bytes(uri: str, data: bytes) -> None:
    """One PUT, up to S3's 5 GiB limit (s3fs would go multipart from 100 MiB, and after a stall
    spend another STALL_BOUND_S aborting the upload): the object appears whole or not at all."""
    fs, path = filesystem(uri)
    one_put = {"chunksize": _MAX_PUT_BYTES} if _is_s3(uri) else {}
    with reaching(uri):
        fs.pipe_file(path, data, **one_put)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    with reaching(uri):
        return fs.exists(path)

"""Object storage through fsspec/s3fs, with bounded stalls and errors that name the URI.

S3 endpoints and credentials come from the standard AWS environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...), so the same code reaches AWS, MinIO or the
local moto server. Credentials never appear in our messages.

Every S3 request is bounded, so a stalled endpoint (a frozen process, a black-holed network)
fails the operation instead of holding GPUs (see Bounds.stall_s); each bound is settable
through the environment (Bounds.from_env):

- connecting: ``FRENZY_S3_CONNECT_TIMEOUT_S`` (5 s);
- waiting for the answer: ``FRENZY_S3_READ_TIMEOUT_S`` (15 s) without a byte (aiohttp's
  sock_read, which only starts once the request body is sent);
- sending a body: at once (no 'Expect: 100-continue', which aiohttp awaits with no timeout),
  and ``FRENZY_S3_SEND_TIMEOUT_S`` (8 s) without the peer acknowledging a byte or opening its
  receive window (Linux's TCP_USER_TIMEOUT; aiohttp has no write timeout, and a body larger
  than the socket buffers otherwise waits forever on a frozen peer);
- ``FRENZY_S3_ATTEMPTS`` (3) tries of each request in botocore's standard retry mode
  (timeouts, 5xx and throttling, with backoff), and none on top of them in s3fs
  (``retries=1``): s3fs's own loop (5 tries by default) multiplies botocore's, and twice over
  for ranged reads.

A sequence of operations that must end as one (a checkpoint's write: every file, the metadata,
the manifest, the pruning) gets one bound for all of them (Deadline), not one per request in
turn.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import fsspec
import fsspec.asyn
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from frenzy_prefect.errors import FrenzyError, StorageUnreachable, exception_chain
from frenzy_prefect.units import duration

T = TypeVar("T")

_MAX_PUT_BYTES = 5 * 2**30  # S3's limit for one PUT
CHECKPOINT_WRITE_TIMEOUT_ENV = "FRENZY_CHECKPOINT_WRITE_TIMEOUT_S"
# A whole write's default bound: one stalled request's, plus the bytes at this slow a rate.
SLOWEST_WRITE_BYTES_PER_S = 20e6


def _env_number(name: str, default: float, *, integer: bool = False) -> float:
    """Environment variable ``name`` as a number > 0 (``default`` when unset)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = 0
    if not value > 0 or value == float("inf"):
        kind = "a whole number" if integer else "a number of seconds"
        raise FrenzyError(f"{name}={raw!r} is not {kind} > 0 (unset, it is {default:g})")
    return value


@dataclass(frozen=True)
class Bounds:
    """How long one S3 request may stall (see the module doc)."""

    connect_s: float = 5
    read_s: float = 15
    send_s: float = 8
    attempts: int = 3

    @classmethod
    def from_env(cls) -> Bounds:
        d = cls()
        return cls(
            connect_s=_env_number("FRENZY_S3_CONNECT_TIMEOUT_S", d.connect_s),
            read_s=_env_number("FRENZY_S3_READ_TIMEOUT_S", d.read_s),
            send_s=_env_number("FRENZY_S3_SEND_TIMEOUT_S", d.send_s),
            attempts=int(_env_number("FRENZY_S3_ATTEMPTS", d.attempts, integer=True)),
        )

    @property
    def stall_s(self) -> float:
        """The longest one stalled operation waits before failing: every try times out, plus
        botocore's backoff between tries (up to 1 s, 2 s, 4 s, ...). Against a frozen peer (its
        kernel still acknowledging, with a closed window) Linux drops the connection about
        2 x TCP_USER_TIMEOUT + 1 s after a send stalls (measured: 11 s for 5 s, 17 s for 8 s,
        30.5 s for 15 s), not 1 x as against a silent one."""
        per_try = max(self.connect_s, self.read_s, 2 * self.send_s + 1)
        return self.attempts * per_try + self.backoff_s

    @property
    def backoff_s(self) -> float:
        """The most botocore's standard mode sleeps between the tries (up to 1 s, 2 s, 4 s, ...)."""
        return sum(2.0**i for i in range(self.attempts - 1))


def stall_bound_s() -> float:
    """How long one stalled S3 operation waits before it fails, under the environment's bounds."""
    return Bounds.from_env().stall_s


def write_bound_s(nbytes: float) -> float:
    """The bound for writing ``nbytes`` as one operation of many requests (a checkpoint):
    FRENZY_CHECKPOINT_WRITE_TIMEOUT_S, else one stalled request's bound plus the bytes at
    SLOWEST_WRITE_BYTES_PER_S."""
    return _env_number(CHECKPOINT_WRITE_TIMEOUT_ENV, stall_bound_s() + nbytes / SLOWEST_WRITE_BYTES_PER_S)


def _socket_factory(send_s: float) -> Callable[[tuple], socket.socket]:
    def socket_with_send_timeout(addr_info: tuple) -> socket.socket:
        """aiohttp's socket factory: a TCP socket whose unacknowledged sends time out."""
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        if hasattr(socket, "TCP_USER_TIMEOUT") and family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(send_s * 1000))
        return sock

    return socket_with_send_timeout


@cache
def _s3_config(bounds: Bounds) -> dict[str, Any]:
    """botocore's client config for every S3 filesystem under ``bounds`` (built once for each:
    fsspec caches filesystems by their arguments)."""
    from aiobotocore.httpsession import AIOHTTPSession

    class SendAtOnce(AIOHTTPSession):
        """botocore asks for '100 Continue' before every PUT body, and aiohttp waits for it with
        no timeout at all (its read timeout starts once the body is sent): a frozen endpoint
        held a checkpoint upload forever. Without the header the body goes at once, bounded by
        the send timeout, and the answer by the read timeout. The header is not signed."""

        async def send(self, request):
            request.headers.pop("Expect", None)
            return await super().send(request)

    return {
        "connect_timeout": bounds.connect_s,
        "read_timeout": bounds.read_s,
        "retries": {"mode": "standard", "total_max_attempts": bounds.attempts},
        "connector_args": {"socket_factory": _socket_factory(bounds.send_s)},
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
    return {"endpoint_url": os.environ.get("AWS_ENDPOINT_URL"), "config_kwargs": _s3_config(Bounds.from_env())}


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
    stall = _stall_errors()
    return next((e for e in exception_chain(exc) if isinstance(e, stall) or getattr(e, "errno", None) == errno.ETIMEDOUT), None)


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


def _where(uri: str) -> str:
    return f"the object store holding {uri} (endpoint {_endpoint_shown()})"


@contextmanager
def reaching(uri: str, started: float | None = None) -> Iterator[None]:
    """Turn a stalled or unreachable endpoint into a StorageUnreachable naming the URI and the
    endpoint, and how long since ``started`` (``time.monotonic()``; default: now) it was waited for."""
    started = time.monotonic() if started is None else started
    try:
        yield
    except Exception as exc:
        cause = _stall_in(exc)
        if cause is None:
            raise
        timed_out, what = _describe(cause)
        if timed_out:
            raise StorageUnreachable(f"{_where(uri)} did not answer within {time.monotonic() - started:.0f} s: {what}") from None
        raise StorageUnreachable(f"cannot reach {_where(uri)}: {what}") from None


class Deadline:
    """One bound for a sequence of storage operations that ends as one (a checkpoint's write):
    each runs in a thread of its own and is given up once the bound is spent, however many
    requests it makes. A given-up operation's thread is left to its requests' own bounds (a
    daemon: it never holds the process's exit); what it still writes belongs to a write that
    failed."""

    def __init__(self, uri: str, bound_s: float, doing: str = "writing it") -> None:
        self.uri, self.bound_s, self.doing = uri, bound_s, doing
        self.started = time.monotonic()

    def run(self, operation: Callable[[], T]) -> T:
        """``operation()``, or StorageUnreachable once the bound is spent (its stalls and
        connection failures too, with the time since the first operation began)."""
        outcome: list = []

        def attempt() -> None:
            try:
                with reaching(self.uri, self.started):
                    outcome.append((True, operation()))
            except BaseException as exc:  # handed to the waiting thread
                outcome.append((False, exc))

        worker = threading.Thread(target=attempt, name="frenzy-bounded-storage", daemon=True)
        worker.start()
        worker.join(max(0.0, self.bound_s - (time.monotonic() - self.started)))
        if not outcome:
            took = time.monotonic() - self.started
            raise StorageUnreachable(f"{_where(self.uri)} did not finish {self.doing} within {took:.0f} s, its bound ({self._bound()})")
        done, value = outcome[0]
        if not done:
            raise value
        return value

    def _bound(self) -> str:
        """Where the bound came from: the setting as given, or the default's own figure."""
        if raw := os.environ.get(CHECKPOINT_WRITE_TIMEOUT_ENV, "").strip():
            return f"{CHECKPOINT_WRITE_TIMEOUT_ENV}={raw}"
        return f"{duration(self.bound_s)} by default; {CHECKPOINT_WRITE_TIMEOUT_ENV} sets another"


@contextmanager
def open_uri(uri: str, mode: str = "rb", **kwargs: Any) -> Iterator[IO[Any]]:
    fs, path = filesystem(uri)
    with reaching(uri), fs.open(path, mode, **kwargs) as f:
        yield f


def write_bytes(uri: str, data: bytes) -> None:
    """One PUT, up to S3's 5 GiB limit (s3fs would go multipart from 100 MiB, and after a stall
    spend another stall bound aborting the upload): the object appears whole or not at all."""
    fs, path = filesystem(uri)
    one_put = {"chunksize": _MAX_PUT_BYTES} if _is_s3(uri) else {}
    with reaching(uri):
        fs.pipe_file(path, data, **one_put)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    with reaching(uri):
        return fs.exists(path)


# Conditional writes: one small object changed only by whoever read its current version (a
# compare-and-swap), so that of two writers that read the same version one fails. S3 decides
# with a conditional PUT (If-Match / If-None-Match: *); a local path with a lock file held
# around the compare and an atomic rename; memory:// (tests) with a lock in this process.

_MEMORY_LOCK = threading.Lock()


class WriteConflict(FrenzyError):
    """A conditional write refused: the object is no longer the version it was read as (or it
    exists where it was to be created, or is gone)."""


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_versioned(uri: str) -> tuple[bytes, str] | None:
    """The object at ``uri`` and its version tag (S3's ETag), read as one; None if there is none."""
    fs, path = filesystem(uri)
    with reaching(uri):
        if _is_s3(uri):
            return fsspec.asyn.sync(fs.loop, _s3_get, fs, path)
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            return None
        return data, _etag(data)


async def _s3_get(fs: AbstractFileSystem, path: str) -> tuple[bytes, str] | None:
    bucket, key, _ = fs.split_path(path)
    try:
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    try:
        return await response["Body"].read(), response["ETag"]
    finally:
        response["Body"].close()


def write_if(uri: str, data: bytes, etag: str | None) -> str:
    """Write ``data`` to ``uri`` if the object there is still version ``etag`` (None: if there is
    none); returns the new version's tag. WriteConflict if not, with nothing written."""
    fs, path = filesystem(uri)
    with reaching(uri):
        if _is_s3(uri):
            return _s3_put_if(fs, uri, path, data, etag)
        if isinstance(fs, LocalFileSystem):
            return _local_put_if(path, data, etag)
        if isinstance(fs, MemoryFileSystem):
            with _MEMORY_LOCK:
                now = fs.cat_file(path) if fs.exists(path) else None
                if (None if now is None else _etag(now)) != etag:
                    raise WriteConflict(f"{uri} changed since it was read")
                fs.pipe_file(path, data)
                return _etag(data)
    raise FrenzyError(f"{uri}: a run's checkpoints need storage with conditional writes: s3://, or a local path")


def _s3_put_if(fs: AbstractFileSystem, uri: str, path: str, data: bytes, etag: str | None) -> str:
    bucket, key, _ = fs.split_path(path)
    condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
    try:
        response = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
    except OSError as exc:  # s3fs's translation of the ClientError, which it keeps as the cause
        if isinstance(exc, (FileExistsError, FileNotFoundError)) or _refused_condition(exc):
            raise WriteConflict(f"{uri} changed since it was read ({type(exc).__name__}: {exc})") from None
        raise
    fs.invalidate_cache(path)
    return response["ETag"]


def _refused_condition(exc: BaseException) -> bool:
    """``exc`` comes from S3 refusing a conditional request: 412, or 409 for a concurrent one."""
    codes = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409"}
    return any(getattr(e, "response", {}).get("Error", {}).get("Code") in codes for e in exception_chain(exc))


def _local_put_if(path: str, data: bytes, etag: str | None) -> str:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            with open(path, "rb") as f:
                now: str | None = _etag(f.read())
        except FileNotFoundError:
            now = None
        if now != etag:
            raise WriteConflict(f"{path} changed since it was read")
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=".head-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    return _etag(data)

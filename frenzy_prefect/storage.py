"""Object storage through fsspec/s3fs, with short timeouts and errors that name the URI.

S3 endpoints and credentials come from the standard AWS environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...), so the same code reaches AWS, MinIO or the
local moto server. Credentials never appear in our messages.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec
from fsspec import AbstractFileSystem

from frenzy_prefect.errors import StorageUnreachable

# Fail in seconds rather than hang when an endpoint is down or unroutable.
_S3_CONFIG: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}


def filesystem(uri: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem holding ``uri`` and the path inside it (s3://, file paths, memory://, ...)."""
    if fsspec.core.split_protocol(uri)[0] not in ("s3", "s3a"):
        return fsspec.core.url_to_fs(uri)
    # The endpoint is passed explicitly so that cached filesystem instances follow the environment.
    return fsspec.core.url_to_fs(uri, endpoint_url=os.environ.get("AWS_ENDPOINT_URL"), config_kwargs=_S3_CONFIG)


def _connection_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError]
    try:
        from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError

        errors += [EndpointConnectionError, ConnectTimeoutError]
    except ImportError:  # no S3 support installed: nothing S3-specific to translate
        pass
    return tuple(errors)


@contextmanager
def reaching(uri: str) -> Iterator[None]:
    """Turn 'endpoint unreachable' into a StorageUnreachable naming the URI and endpoint."""
    try:
        yield
    except _connection_errors() as exc:
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "the default AWS endpoint")
        raise StorageUnreachable(
            f"cannot reach the object store holding {uri} (endpoint {endpoint}): {type(exc).__name__}"
        ) from None


@contextmanager
def open_uri(uri: str, mode: str = "rb", **kwargs: Any) -> Iterator[IO[Any]]:
    fs, path = filesystem(uri)
    with reaching(uri), fs.open(path, mode, **kwargs) as f:
        yield f


def write_bytes(uri: str, data: bytes) -> None:
    """One PUT: the object appears whole or not at all."""
    fs, path = filesystem(uri)
    with reaching(uri):
        fs.pipe_file(path, data)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    with reaching(uri):
        return fs.exists(path)

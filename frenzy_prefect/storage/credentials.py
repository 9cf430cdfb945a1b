"""S3 credentials from a prefect-aws block, as the environment the storage layer reads.

The `frenzy` pool's ``storage_credentials`` variable names an ``aws-credentials/NAME``,
``minio-credentials/NAME`` or ``s3-bucket/NAME`` block (prefect-aws: `pip install
frenzy-prefect[aws]`). The worker resolves it when it starts a run's processes and puts the keys
in their environment only (AWS_ACCESS_KEY_ID, ...), which storage.py, s3fs and botocore read:
the ranks need no Prefect client, and the secret never passes through a flow run's parameters,
its logs or an error message. Without the variable a run gets the worker's own environment.
"""

from __future__ import annotations

from typing import Any

from frenzy_prefect.errors import FrenzyError

# What a block replaces in the worker's environment: keys of two sources never mix.
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
KINDS = ("aws-credentials", "minio-credentials", "s3-bucket")


def _block_classes() -> dict[str, Any]:
    try:
        from prefect_aws import AwsCredentials, MinIOCredentials, S3Bucket
    except ImportError:
        raise FrenzyError("storage_credentials names a prefect-aws block; install it: pip install 'frenzy-prefect[aws]'") from None
    return dict(zip(KINDS, (AwsCredentials, MinIOCredentials, S3Bucket), strict=True))


def _secret(value: Any) -> str | None:
    return value.get_secret_value() if value is not None else None


def _env_of(credentials: Any) -> dict[str, str]:
    """The environment an AwsCredentials or MinIOCredentials block stands for."""
    if getattr(credentials, "assume_role_arn", None):
        raise FrenzyError("storage_credentials: assume_role_arn is not supported; give the block the role's keys or a profile_name")
    if hasattr(credentials, "minio_root_user"):
        keys = (credentials.minio_root_user, _secret(credentials.minio_root_password), None, None)
    else:
        keys = (
            credentials.aws_access_key_id,
            _secret(credentials.aws_secret_access_key),
            credentials.aws_session_token,
            credentials.profile_name,
        )
    env = dict(zip(CREDENTIAL_ENV, keys, strict=True))
    env["AWS_DEFAULT_REGION"] = credentials.region_name
    env["AWS_ENDPOINT_URL"] = credentials.aws_client_parameters.endpoint_url
    return {k: v for k, v in env.items() if v}


async def credentials_env(ref: str) -> dict[str, str]:
    """The environment variables block ``ref`` (``KIND/NAME``) stands for."""
    kind, _, name = ref.partition("/")
    if kind not in KINDS or not name:
        raise FrenzyError(f"storage_credentials {ref!r}: expected one of {', '.join(k + '/NAME' for k in KINDS)}")
    cls = _block_classes()[kind]
    try:
        block = await cls.aload(name)
    except ValueError:
        raise FrenzyError(f"storage_credentials: no {kind} block named {name!r}") from None
    return _env_of(block.credentials if kind == "s3-bucket" else block)


def with_credentials(env: dict[str, str], credentials: dict[str, str]) -> dict[str, str]:
    """``env`` with the keys it had replaced by ``credentials`` (an endpoint or region the block
    does not set stays the worker's)."""
    return {k: v for k, v in env.items() if k not in CREDENTIAL_ENV} | credentials

"""Datasets and object storage through a real S3 endpoint (moto's server) and s3fs."""

import pytest

from frenzy_prefect.errors import DatasetError, StorageUnreachable
from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.storage import filesystem, open_uri
from frenzy_prefect.training.distributed import free_port

from .conftest import BUCKET


def test_a_text_dataset_is_profiled_as_byte_tokens(dataset):
    info = profile_dataset(dataset, seq_len=64, vocab_size=256)
    assert info.format == "bytes" and info.tokens == info.size_bytes >= 64_000


def test_a_uint16_dataset_counts_two_bytes_a_token(s3):
    uri = f"s3://{BUCKET}/data/tokens.bin"
    fs, path = filesystem(uri)
    fs.pipe_file(path, bytes(2 * 1000))
    assert profile_dataset(uri, seq_len=64, vocab_size=50257).tokens == 1000


def test_a_missing_dataset_is_named(s3):
    uri = f"s3://{BUCKET}/data/absent.txt"
    with pytest.raises(DatasetError, match=f"dataset {uri} does not exist"):
        profile_dataset(uri, seq_len=64, vocab_size=256)


@pytest.mark.parametrize(
    ("name", "content", "vocab", "message"),
    [
        ("data.csv", b"a,b", 256, r"unknown format; accepted: \*.txt \(bytes\), \*.bin \(uint16\)"),
        ("short.txt", b"tiny", 256, "holds 4 tokens; seq_len 64 needs at least 65"),
        ("bytes.txt", b"x" * 100, 100, "byte-level text .* vocab_size is 100"),
    ],
)
def test_unusable_datasets_say_why(s3, name, content, vocab, message):
    uri = f"s3://{BUCKET}/data/{name}"
    fs, path = filesystem(uri)
    fs.pipe_file(path, content)
    with pytest.raises(DatasetError, match=message):
        profile_dataset(uri, seq_len=64, vocab_size=vocab)


def test_an_unreachable_endpoint_fails_fast_naming_uri_and_endpoint_not_the_secret(s3, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-print-me")
    uri = f"s3://{BUCKET}/data/sentences.txt"
    with pytest.raises(StorageUnreachable) as exc:
        profile_dataset(uri, seq_len=64, vocab_size=256)
    assert uri in str(exc.value) and dead in str(exc.value)
    assert "do-not-print-me" not in str(exc.value)


def test_open_uri_round_trips_through_s3(s3):
    uri = f"s3://{BUCKET}/misc/hello.json"
    with open_uri(uri, "w") as f:
        f.write('{"ok": true}')
    with open_uri(uri, "r") as f:
        assert f.read() == '{"ok": true}'

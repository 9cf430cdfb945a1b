"""Datasets and object storage through a real S3 endpoint (moto's server) and s3fs."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from frenzy_prefect.errors import DatasetError, StorageUnreachable
from frenzy_prefect.profiling.dataset import profile_dataset
from frenzy_prefect.profiling.token_sample import EDGE_BYTES
from frenzy_prefect.storage import Bounds, filesystem, open_uri, stall_bound_s, write_bytes
from frenzy_prefect.training.data import TokenWindows
from frenzy_prefect.training.distributed import free_port
from tests.support.stack import BUCKET, frozen, moto_server
from tests.support.storage import SHORT_BOUNDS


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


def test_a_uint16_file_of_an_odd_size_is_refused_naming_it_and_its_size(s3):
    uri = f"s3://{BUCKET}/data/odd.bin"
    fs, path = filesystem(uri)
    fs.pipe_file(path, bytes(2 * 1000 + 1))
    with pytest.raises(DatasetError, match=rf"dataset {uri} is 2,001 bytes, not a whole number of uint16 token ids \(2 bytes each\)"):
        profile_dataset(uri, seq_len=64, vocab_size=50257)


GPT2_VOCAB = 50257


@pytest.mark.parametrize(
    ("where", "position"),
    [
        ("tail", 99_999),  # the last id: a file with something appended, or the next tokenizer's ids
        ("middle", None),  # all but the head and the tail: only the seeded blocks between see it
    ],
)
def test_a_uint16_file_with_ids_beyond_the_vocabulary_is_refused_naming_the_id_and_its_position(s3, where, position):
    ids = np.arange(100_000, dtype=np.uint16) % GPT2_VOCAB
    edge = EDGE_BYTES // 2
    if where == "tail":
        ids[-1] = 50_300
    else:
        ids[edge:-edge] = 50_300
    uri = f"s3://{BUCKET}/data/beyond-{where}.bin"
    fs, path = filesystem(uri)
    fs.pipe_file(path, ids.tobytes())
    with pytest.raises(DatasetError) as exc:
        profile_dataset(uri, seq_len=64, vocab_size=GPT2_VOCAB)
    message = str(exc.value)
    found = int(message.split(" at position ")[1].split(" ")[0].replace(",", ""))
    assert message.startswith(f"dataset file {uri}: token id 50300 at position {found:,} (of 100,000) is not below the model's vocab_size")
    assert found == position if position is not None else edge <= found < 100_000 - edge
    assert "accepted: ids 0 to 50256" in message and "use a model whose vocab_size is above 50300" in message
    assert profile_dataset(uri, seq_len=64, vocab_size=50_301).tokens == 100_000  # a larger vocabulary takes it


def test_an_unreachable_endpoint_fails_fast_naming_uri_and_endpoint_not_the_secret(s3, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-print-me")
    uri = f"s3://{BUCKET}/data/sentences.txt"
    asked = time.monotonic()
    with pytest.raises(StorageUnreachable) as exc:
        profile_dataset(uri, seq_len=64, vocab_size=256)
    took = time.monotonic() - asked
    # Fast: the attempts' refused connections, botocore's backoff between them (3-5 s measured on
    # 2 busy cores), within the connect timeouts' bound and far from a stalled request's.
    print(f"an unreachable endpoint failed in {took:.1f} s")
    b = Bounds.from_env()
    assert took < b.attempts * b.connect_s + b.backoff_s < b.stall_s, f"{took:.1f} s to fail"
    assert uri in str(exc.value) and dead in str(exc.value)
    assert "do-not-print-me" not in str(exc.value)


def test_open_uri_round_trips_through_s3(s3):
    uri = f"s3://{BUCKET}/misc/hello.json"
    with open_uri(uri, "w") as f:
        f.write('{"ok": true}')
    with open_uri(uri, "r") as f:
        assert f.read() == '{"ok": true}'


SECRET = "stalled-endpoint-secret-do-not-print"


@pytest.mark.timeout(300)
def test_a_stalled_endpoint_fails_reads_and_writes_in_bounded_time_naming_uri_and_endpoint(s3, tmp_path, monkeypatch):
    """The endpoint's process stopped (SIGSTOP): connections and bytes are still accepted by its
    kernel, nothing answers. A rank's next batch from a dataset opened before the stall, a small
    PUT (waits for the answer) and a checkpoint-sized PUT (its body fills the socket buffers) each fail with
    StorageUnreachable naming the URI and the endpoint, never the secret; the three run at once,
    under the environment's shorter bounds."""
    for name, value in SHORT_BOUNDS.items():
        monkeypatch.setenv(name, value)
    with moto_server(tmp_path / "moto.log") as (endpoint, server):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        data = f"s3://{BUCKET}/data/stalled.txt"
        fs, path = filesystem(data)
        fs.mkdir(BUCKET)
        fs.pipe_file(path, b"tokens " * 1000)
        windows = TokenWindows(profile_dataset(data, seq_len=16, vocab_size=256), seq_len=16)  # opened (HEAD) as a rank does
        ops = {
            "read": (data, lambda: windows.batch(torch.Generator().manual_seed(0), 4)),  # a GET, as a rank's next batch
            "small PUT": (small := f"s3://{BUCKET}/runs/stalled/metrics.json", lambda: write_bytes(small, b"{}")),
            "16 MiB PUT": (big := f"s3://{BUCKET}/runs/stalled/checkpoint.pt", lambda: write_bytes(big, os.urandom(16 * 2**20))),
        }

        def timed(op):
            started = time.monotonic()
            try:
                op()
            except Exception as exc:
                return exc, time.monotonic() - started
            return None, time.monotonic() - started

        with frozen(server), ThreadPoolExecutor(len(ops)) as pool:
            outcomes = dict(zip(ops, pool.map(timed, [op for _, op in ops.values()]), strict=True))
        took = {name: f"{seconds:.1f} s" for name, (_, seconds) in outcomes.items()}
        for name, (uri, _) in ops.items():
            error, seconds = outcomes[name]
            assert isinstance(error, StorageUnreachable), f"{name}: {error!r} after {seconds:.1f} s"
            message = str(error)
            assert uri in message and endpoint in message and "did not answer within" in message, message
            assert SECRET not in message
        # Each op gives up on its own, within its bound (11 s here; 47-52 s measured under the
        # default 54 s bound); the pytest timeout is the hard limit.
        assert all(seconds < 2 * stall_bound_s() for _, seconds in outcomes.values()), took
        inputs, _ = windows.batch(torch.Generator().manual_seed(0), 4)  # the endpoint back, the same file reads again
        assert inputs.shape == (4, 16)

"""Dataset preparation on a real S3 endpoint (moto's server, through s3fs): raw text, JSONL and
Parquet under a prefix -> token shards and a manifest, cached by content hash, read by training."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from frenzy_prefect.datasets.prepare import default_root, for_model, prepare
from frenzy_prefect.datasets.tokenizer import train_bpe
from frenzy_prefect.errors import DatasetError
from frenzy_prefect.profiling.dataset import is_token_data, profile_dataset
from frenzy_prefect.spec.dataset import Preparation
from frenzy_prefect.storage import filesystem, open_uri
from frenzy_prefect.training.data import TokenWindows
from tests.support.datasets import TINY_BPE_MODEL, put, texts
from tests.support.stack import BUCKET, sentences

pytestmark = pytest.mark.pipelines

BPE = Preparation(vocab_size=400)


def objects(prefix: str) -> dict[str, tuple[int, object]]:
    """Every object under ``prefix`` with its size and last-modified time."""
    fs, path = filesystem(prefix)
    fs.invalidate_cache()
    return {p: (i["size"], i.get("LastModified")) for p, i in fs.find(path, detail=True).items()}


def shard_ids(prepared) -> np.ndarray:
    folder = prepared.manifest_uri.rsplit("/", 1)[0]
    parts = []
    for shard in prepared.manifest.shards:
        with open_uri(f"{folder}/{shard.name}") as f:
            parts.append(np.frombuffer(f.read(), dtype=prepared.manifest.format))
    return np.concatenate(parts)


def documents(prepared) -> list[str]:
    """The prepared documents decoded with the tokenizer.json saved beside the shards."""
    folder = prepared.manifest_uri.rsplit("/", 1)[0]
    with open_uri(f"{folder}/{prepared.manifest.tokenizer}", "r") as f:
        tokenizer = Tokenizer.from_str(f.read())
    ids = shard_ids(prepared).tolist()
    eos, docs, start = prepared.manifest.eos_id, [], 0
    for i, token in enumerate(ids):
        if token == eos:
            docs.append(tokenizer.decode(ids[start:i]))
            start = i + 1
    assert start == len(ids), "every document ends with the end-of-text token"
    return docs


def test_text_files_become_uint16_shards_that_decode_back_to_the_files(s3):
    prefix = f"s3://{BUCKET}/raw-txt/"
    docs = texts(3, seed=1)
    for i, doc in enumerate(docs):
        put(f"{prefix}part-{i}.txt", doc.encode())
    prepared = prepare(prefix, BPE)
    m = prepared.manifest
    assert not prepared.cached
    assert default_root(prefix) == f"s3://{BUCKET}/frenzy-prepared"
    assert prepared.manifest_uri == f"s3://{BUCKET}/frenzy-prepared/{m.content_hash}/manifest.json"
    assert m.format == "uint16" and m.documents == 3 and [f.path for f in m.files] == ["part-0.txt", "part-1.txt", "part-2.txt"]
    assert documents(prepared) == docs
    assert m.tokens < sum(len(d) for d in docs) + 3, "the BPE merges: fewer tokens than bytes"


def test_preparing_the_same_data_again_does_no_work_and_changed_data_prepares_afresh(s3):
    prefix = f"s3://{BUCKET}/raw-cache/"
    put(f"{prefix}a.txt", texts(1, seed=2)[0].encode())
    first = prepare(prefix, BPE)
    before = objects(f"s3://{BUCKET}/frenzy-prepared/")
    again = prepare(prefix, BPE)
    assert again.cached and again.manifest_uri == first.manifest_uri and again.manifest == first.manifest
    assert objects(f"s3://{BUCKET}/frenzy-prepared/") == before, "a cache hit writes nothing"
    put(f"{prefix}b.txt", texts(1, seed=3)[0].encode())
    grown = prepare(prefix, BPE)
    assert not grown.cached and grown.manifest.content_hash != first.manifest.content_hash and grown.manifest.documents == 2
    other = prepare(prefix, Preparation(vocab_size=300))
    assert not other.cached and other.manifest.content_hash != grown.manifest.content_hash, "the tokenizer is part of the hash"


def test_jsonl_lines_are_documents_from_their_text_field(s3):
    prefix = f"s3://{BUCKET}/raw-jsonl/"
    docs = texts(4, seed=4)
    lines = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs[:2])] + ["", json.dumps({"body": None})]
    put(f"{prefix}a.jsonl", "\n".join(lines).encode())
    put(f"{prefix}b.jsonl", "\n".join(json.dumps({"body": d}) for d in docs[2:]).encode())
    prepared = prepare(prefix, Preparation(vocab_size=400, text_field="body"))
    assert prepared.manifest.documents == 4 and documents(prepared) == docs


def parquet(table: pa.Table) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=2)
    return out.getvalue()


def test_parquet_rows_are_documents_from_their_text_column(s3):
    uri = f"s3://{BUCKET}/raw-parquet/docs.parquet"  # a single file works as a prefix does
    docs = texts(5, seed=5)
    put(uri, parquet(pa.table({"text": docs[:2] + [None] + docs[2:], "n": list(range(6))})))
    prepared = prepare(uri, BPE)
    assert prepared.manifest.documents == 5 and documents(prepared) == docs
    assert prepared.manifest_uri.startswith(f"s3://{BUCKET}/raw-parquet/frenzy-prepared/"), "beside a single file"


def test_a_tokenizer_json_from_a_uri_is_used_as_it_is(s3):
    docs = texts(3, seed=6)
    tokenizer = train_bpe(docs, 350)
    put(tok := f"s3://{BUCKET}/tokenizers/mine.json", tokenizer.to_str().encode())
    prefix = f"s3://{BUCKET}/raw-tok/"
    put(f"{prefix}a.jsonl", "\n".join(json.dumps({"text": d}) for d in docs).encode())
    prepared = prepare(prefix, Preparation(tokenizer=tok))
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [i for d in docs for i in [*tokenizer.encode(d, add_special_tokens=False).ids, eos]]
    assert shard_ids(prepared).tolist() == expected and prepared.manifest.eos_id == eos


def word_tokenizer(words: list[str], size: int) -> Tokenizer:
    """A word-level tokenizer of ``size`` ids: the words, </s>, and fillers to make up the size."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
    vocab |= {f"filler{i}": i for i in range(len(vocab), size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def test_a_vocabulary_over_65536_gives_uint32_shards_cut_at_shard_tokens_that_training_reads(s3):
    words = sorted(set(sentences(2000, seed=7).decode().split()))
    tokenizer = word_tokenizer(words, 70_000)
    put(tok := f"s3://{BUCKET}/tokenizers/big.json", tokenizer.to_str().encode())
    prefix = f"s3://{BUCKET}/raw-big/"
    docs = texts(4, seed=8)
    put(f"{prefix}a.txt", "\n".join(docs).encode())
    prepared = prepare(prefix, Preparation(tokenizer=tok, shard_tokens=50))
    m = prepared.manifest
    assert m.format == "uint32" and m.vocab_size == 70_000 and m.eos_id == 1
    assert [s.tokens for s in m.shards[:-1]] == [50] * (len(m.shards) - 1) and 0 < m.shards[-1].tokens <= 50
    ids = shard_ids(prepared)
    assert ids.tolist() == [*tokenizer.encode("\n".join(docs)).ids, 1]

    with pytest.raises(DatasetError, match="vocabulary of 70000 tokens but the model's vocab_size is 50304"):
        profile_dataset(prefix.replace("raw-big/", f"frenzy-prepared/{m.content_hash}/"), seq_len=16, vocab_size=50304)
    info = profile_dataset(prepared.manifest_uri, seq_len=16, vocab_size=70_000)
    assert info.format == "uint32" and info.tokens == m.tokens and len(info.shards) == len(m.shards)
    windows = TokenWindows(info, seq_len=16)
    try:
        per_shard = [max(0, s.tokens - 16) for s in m.shards]  # window starts each shard holds (a short last one: none)
        bounds = np.cumsum([0, *per_shard])
        for shard, first in enumerate(bounds[:-1]):
            for offset in (0, per_shard[shard] - 1) if per_shard[shard] else ():
                inputs, targets = windows.windows([int(first + offset)])
                base = shard * 50 + offset
                assert inputs[0].tolist() == ids[base : base + 16].tolist() and targets[0].tolist() == ids[base + 1 : base + 17].tolist()
        starts = windows.starts(torch.Generator().manual_seed(0), 2000)
        assert min(starts) >= 0 and max(starts) < bounds[-1]
        hit = np.searchsorted(bounds, starts, side="right") - 1
        assert set(hit.tolist()) == {i for i, n in enumerate(per_shard) if n}, "every shard with a window is sampled"
    finally:
        windows.close()


def test_a_prepared_shard_of_the_wrong_size_or_with_ids_beyond_the_vocabulary_is_named(s3):
    # A shard overwritten since (by another tokenizer's preparation, a truncated copy): the
    # manifest still says complete, and training would fail on its first window there.
    prefix = f"s3://{BUCKET}/raw-tampered/"
    put(f"{prefix}a.txt", "\n".join(texts(4, seed=11)).encode())
    prepared = prepare(prefix, Preparation(vocab_size=400, shard_tokens=100))
    assert profile_dataset(prepared.manifest_uri, seq_len=16, vocab_size=400).shards
    folder = prepared.manifest_uri.rsplit("/", 1)[0]
    second = f"{folder}/{prepared.manifest.shards[1].name}"
    with open_uri(second) as f:
        ids = np.frombuffer(f.read(), dtype=np.uint16)

    put(second, (ids + 400).tobytes())
    assert len(ids) == 100
    with pytest.raises(DatasetError, match=rf"dataset file {second}: token id {ids[0] + 400} at position 0 \(of 100\) is not below"):
        profile_dataset(prepared.manifest_uri, seq_len=16, vocab_size=400)
    put(second, ids[:-1].tobytes())
    with pytest.raises(DatasetError, match=rf"its shard {second} is 198 bytes, not the 200 of the 100 uint16 ids its manifest says"):
        profile_dataset(prepared.manifest_uri, seq_len=16, vocab_size=400)
    filesystem(second)[0].rm(filesystem(second)[1])
    with pytest.raises(DatasetError, match=rf"its shard {second} does not exist"):
        profile_dataset(prepared.manifest_uri, seq_len=16, vocab_size=400)


def test_raw_data_is_told_from_token_data(s3, dataset):
    put(f"s3://{BUCKET}/raw-kind/a.txt", b"hello there. " * 50)
    prepared = prepare(f"s3://{BUCKET}/raw-kind/", BPE)
    folder = prepared.manifest_uri.rsplit("/", 1)[0]
    assert is_token_data(dataset) and is_token_data(f"s3://{BUCKET}/x/tokens.bin")
    assert is_token_data(prepared.manifest_uri) and is_token_data(folder) and is_token_data(folder + "/")
    assert not is_token_data(f"s3://{BUCKET}/raw-kind/") and not is_token_data(f"s3://{BUCKET}/raw-kind/docs.jsonl")
    assert for_model(None, 512).vocab_size == 512 and for_model(Preparation(vocab_size=300), 512).vocab_size == 300
    assert for_model(Preparation(tokenizer="s3://t.json"), 512).vocab_size is None


@pytest.mark.parametrize(
    ("files", "options", "message"),
    [
        ({"a.jsonl": b'{"text": "fine"}\n{"body": "no text"}\n'}, BPE, r"raw-bad-\d/a.jsonl line 2 has no 'text' field \(it has: body\)"),
        ({"a.jsonl": b'{"text": "fine"}\nnot json\n'}, BPE, r"raw-bad-\d/a.jsonl line 2 is not JSON"),
        ({"a.jsonl": b'{"text": 7}\n'}, BPE, r"raw-bad-\d/a.jsonl line 1: 'text' is a int, not a string"),
        ({"b.parquet": parquet(pa.table({"body": ["x"]}))}, BPE, r"raw-bad-\d/b.parquet has no column 'text' \(it has: body\)"),
        ({"b.parquet": b"PAR1 not really"}, BPE, r"raw-bad-\d/b.parquet is not a Parquet file"),
        ({"a.txt": b"fine", "c.csv": b"a,b"}, BPE, r"raw-bad-\d/c.csv has an unknown format; accepted: \*.txt, \*.jsonl, \*.parquet"),
        ({"a.txt": b"\xff\xfe bytes"}, BPE, r"raw-bad-\d/a.txt is not UTF-8 text"),
        ({"a.txt": b"fine"}, Preparation(), "needs its vocab_size"),
        ({"a.txt": b"fine"}, Preparation(tokenizer=f"s3://{BUCKET}/tokenizers/absent.json"), "tokenizer s3://.*absent.json does not exist"),
        ({"a.txt": b"fine"}, Preparation(vocab_size=100), "a byte-level BPE needs vocab_size >= 257"),
    ],
)
def test_bad_files_are_named_in_one_line_and_nothing_is_marked_complete(s3, files, options, message, request):
    prefix = f"s3://{BUCKET}/raw-bad-{request.node.callspec.indices['files']}/"
    for name, data in files.items():
        put(prefix + name, data)
    root = f"s3://{BUCKET}/bad-out-{request.node.callspec.indices['files']}"
    with pytest.raises(DatasetError, match=message) as exc:
        prepare(prefix, options.model_copy(update={"output": root}))
    assert "\n" not in str(exc.value)
    assert not [p for p in objects(root + "/") if p.endswith("manifest.json")]


def test_an_empty_prefix_says_what_it_accepts(s3):
    with pytest.raises(DatasetError, match=r"holds no files; accepted: \*.txt, \*.jsonl, \*.parquet"):
        prepare(f"s3://{BUCKET}/nothing-here/", BPE)


def test_a_rank_trains_on_prepared_shards_and_learns(s3):
    """The trainer reads a prepared dataset (uint16 shards of a BPE trained on the data) as it reads
    a token file: a lone rank's loss falls well below the uniform guess over the vocabulary."""
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.spec.plan import ParallelPlan, Placement
    from frenzy_prefect.training.distributed import DistributedContext
    from frenzy_prefect.training.trainer import train
    from tests.support.training import make_job

    prefix = f"s3://{BUCKET}/raw-train/"
    put(f"{prefix}a.jsonl", "\n".join(json.dumps({"text": t}) for t in texts(40, seed=9)).encode())
    prepared = prepare(prefix, Preparation(vocab_size=320, shard_tokens=1500))
    assert len(prepared.manifest.shards) > 1
    model = resolve_model({"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 320, "n_positions": 64})
    info = profile_dataset(prepared.manifest_uri, 32, model.vocab_size)
    job = make_job(info, f"s3://{BUCKET}/runs/prepared", ParallelPlan(micro_batch=8), [Placement(node="n0", host="127.0.0.1", gpus=[0])])
    job = job.model_copy(update={"model": model, "request": job.request.model_copy(update={"steps": 30, "seq_len": 32})})
    result = train(job, DistributedContext(), log=lambda line: None)
    assert result.losses[0] > 5.0 and result.losses[-1] < result.losses[0] - 1.0  # uniform over 320 ids: 5.77; measured 4.05 after 30 steps


def test_the_prepare_dataset_flow_prepares_then_finds_its_work_done(stack, prefect_api, s3):
    from prefect import get_client

    from frenzy_prefect.flows import prepare_dataset_flow

    prefix = f"s3://{BUCKET}/raw-flow/"
    put(f"{prefix}a.txt", texts(1, seed=10)[0].encode())
    with stack.client_settings():
        first = prepare_dataset_flow(prefix, BPE)
        second = prepare_dataset_flow(prefix, BPE)
        with get_client(sync_client=True) as client:
            artifacts = client.read_artifacts()
    assert not first.cached and second.cached and second.manifest_uri == first.manifest_uri
    assert first.manifest.documents == 1 and profile_dataset(first.manifest_uri, 16, 400).shards
    notes = [a.data for a in artifacts if a.key == "dataset-preparation"]
    assert any("Dataset prepared" in n for n in notes) and any("Dataset found prepared" in n for n in notes)


@pytest.mark.e2e
def test_train_llm_prepares_a_raw_prefix_then_trains_on_its_shards(stack, worker_pool, s3):
    """Through the deployment and the worker: a raw JSONL prefix is prepared (a BPE of the model's
    vocab_size), then trained on; a model whose vocabulary cannot hold a byte-level BPE is refused
    in one line before any GPU is asked for."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.deployments import run_deployment

    from frenzy_prefect.flows.training import default_output
    from frenzy_prefect.spec.result import TrainingReport
    from tests.support.runs import children, wait_final

    prefix = f"s3://{BUCKET}/raw-e2e/"
    put(f"{prefix}a.jsonl", "\n".join(json.dumps({"text": t}) for t in texts(40, seed=11)).encode())
    base = {"dataset": prefix, "global_batch": 16, "seq_len": 32, "steps": 20, "precision": "fp32"}
    requests = {"raw": base | {"model": TINY_BPE_MODEL}, "bytes-model": base | {"model": "gpt-nano"}}
    with stack.client_settings():
        ids = {name: run_deployment("train-llm/frenzy", parameters={"request": r}, timeout=0).id for name, r in requests.items()}
        runs = {name: wait_final(run_id) for name, run_id in ids.items()}
        with get_client(sync_client=True) as client:
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[runs["raw"].id])))

    run = runs["raw"]
    assert run.state.is_completed(), run.state.message
    (training,) = children(stack, run)
    assert training.parameters["job"]["dataset"]["uri"].startswith(f"s3://{BUCKET}/frenzy-prepared/")
    assert training.parameters["job"]["dataset"]["format"] == "uint16" and training.parameters["job"]["dataset"]["shards"]
    assert "dataset-preparation" in {a.key for a in artifacts}
    with open_uri(f"{default_output(prefix, run.name)}/report.json", "r") as f:
        report = TrainingReport.model_validate_json(f.read())
    assert default_output(prefix, run.name).startswith(f"s3://{BUCKET}/frenzy-runs/"), "beside the raw prefix, not inside it"
    assert report.loss_end < report.loss_start - 0.5

    refused = runs["bytes-model"]
    assert refused.state.is_failed() and "a byte-level BPE needs vocab_size >= 257" in refused.state.message
    assert children(stack, refused) == []


def test_a_file_another_process_added_is_seen_though_this_one_listed_the_prefix_before(s3):
    """s3fs caches listings per filesystem instance, and a worker keeps its instance: the listing
    that decides the content hash must be fresh, or new data would be a cache hit on the old."""
    import fsspec

    from frenzy_prefect.storage import filesystem_options

    prefix = f"s3://{BUCKET}/raw-stale/"
    put(f"{prefix}a.txt", texts(1, seed=12)[0].encode())
    first = prepare(prefix, BPE)
    elsewhere = fsspec.filesystem("s3", skip_instance_cache=True, **filesystem_options(prefix))
    elsewhere.pipe_file(f"{BUCKET}/raw-stale/b.txt", texts(1, seed=13)[0].encode())
    second = prepare(prefix, BPE)
    assert not second.cached and second.manifest.documents == 2 and second.manifest.content_hash != first.manifest.content_hash

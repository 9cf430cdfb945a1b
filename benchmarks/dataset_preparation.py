"""How fast raw text becomes token shards: the Python standard library's sources (a few MB of
real text) as *.txt, *.jsonl and *.parquet files on a local S3 endpoint (moto's server), prepared
with a byte-level BPE trained on them and then with that tokenizer loaded from a tokenizer.json;
and what preparing the same data again costs (the cache hit). Tokenising dominates: the
`tokenizers` library's own encode_batch of the same text takes most of the "loaded" time.

    python -m benchmarks.dataset_preparation [--megabytes 8] [--vocab-size 8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks import write_result

BUCKET = "frenzy-bench"


def corpus(megabytes: float) -> list[str]:
    """Standard-library modules, one document each, until ``megabytes`` of text."""
    docs, size = [], 0
    for path in sorted(Path(os.__file__).parent.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        size += len(text.encode())
        if size >= megabytes * 2**20:
            break
    return docs


def upload(fmt: str, docs: list[str], prefix: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from frenzy_prefect.storage import write_bytes

    half = len(docs) // 2
    for part, chunk in enumerate((docs[:half], docs[half:])):
        uri = f"{prefix}part-{part}.{fmt}"
        if fmt == "txt":
            write_bytes(uri, "".join(chunk).encode())
        elif fmt == "jsonl":
            write_bytes(uri, "\n".join(json.dumps({"text": d}) for d in chunk).encode())
        else:
            out = io.BytesIO()
            pq.write_table(pa.table({"text": chunk}), out)
            write_bytes(uri, out.getvalue())


def timed(prefix: str, options) -> tuple[float, object]:
    from frenzy_prefect.datasets.prepare import prepare

    started = time.perf_counter()
    prepared = prepare(prefix, options)
    return time.perf_counter() - started, prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=8)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/dataset_preparation.json"))
    args = parser.parse_args()

    from frenzy_prefect.localstack import LocalStack
    from frenzy_prefect.spec.dataset import Preparation
    from frenzy_prefect.storage import filesystem

    docs = corpus(args.megabytes)
    megabytes = sum(len(d.encode()) for d in docs) / 2**20
    rows = []
    with tempfile.TemporaryDirectory() as home, LocalStack(Path(home)) as stack:
        stack.start_s3()
        filesystem(f"s3://{BUCKET}")[0].mkdir(BUCKET)
        for fmt in ("txt", "jsonl", "parquet"):
            prefix = f"s3://{BUCKET}/{fmt}/raw/"
            upload(fmt, docs, prefix)
            bpe_s, trained = timed(prefix, Preparation(vocab_size=args.vocab_size))
            tokenizer = f"{trained.manifest_uri.rsplit('/', 1)[0]}/tokenizer.json"
            loaded_s, loaded = timed(prefix, Preparation(tokenizer=tokenizer, output=f"s3://{BUCKET}/{fmt}/loaded"))
            hit_s, hit = timed(prefix, Preparation(vocab_size=args.vocab_size))
            assert hit.cached and not trained.cached and not loaded.cached
            assert loaded.manifest.tokens == trained.manifest.tokens, "the loaded tokenizer encodes as the trained one did"
            rows.append(
                {
                    "format": fmt,
                    "documents": trained.manifest.documents,
                    "tokens": trained.manifest.tokens,
                    "bpe_trained_s": round(bpe_s, 3),
                    "bpe_trained_mb_per_s": round(megabytes / bpe_s, 2),
                    "tokenizer_loaded_s": round(loaded_s, 3),
                    "tokenizer_loaded_mb_per_s": round(megabytes / loaded_s, 2),
                    "cache_hit_s": round(hit_s, 3),
                }
            )
    load = round(os.getloadavg()[0], 1)  # the numbers scale with the CPU share the tokenizer gets
    print(f"{megabytes:.1f} MB of text, {len(docs)} documents, byte-level BPE of {args.vocab_size} tokens")
    print(f"{os.cpu_count()} CPUs, load average {load}")
    print(f"{'format':<8}{'tokens':>11}{'BPE trained s':>15}{'MB/s':>7}{'loaded s':>10}{'MB/s':>7}{'cache hit s':>13}")
    for r in rows:
        print(
            f"{r['format']:<8}{r['tokens']:>11,}{r['bpe_trained_s']:>15.2f}{r['bpe_trained_mb_per_s']:>7.2f}"
            f"{r['tokenizer_loaded_s']:>10.2f}{r['tokenizer_loaded_mb_per_s']:>7.2f}{r['cache_hit_s']:>13.3f}"
        )
    summary = {"megabytes": round(megabytes, 2), "vocab_size": args.vocab_size, "cpus": os.cpu_count(), "load": load}
    write_result(summary | {"rows": rows}, args.json)


if __name__ == "__main__":
    main()

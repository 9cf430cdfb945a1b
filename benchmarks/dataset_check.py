"""What checking a token file's ids costs before training (profile_dataset: its size, then a
bounded sample of its ids against the vocabulary): *.bin files of uint16 ids of growing size, as
local files and on a local S3 endpoint (moto's server), each profiled a few times; beside it, the
time to read the whole file once, which a check of every id would at least take. moto reads the
whole object to answer a ranged GET, so its times grow with the file though the bytes sampled
do not; a local file's show the check's own cost.

    python -m benchmarks.dataset_check [--megabytes 4 64 512] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import write_result

BUCKET = "frenzy-bench"
VOCAB = 50257  # GPT-2's


def sampled_bytes(tokens: int) -> int:
    """The bytes the check reads of a file of ``tokens`` uint16 ids (its ranges merged)."""
    from fsspec.utils import merge_offset_ranges

    from frenzy_prefect.profiling.token_sample import sample_ranges
    from frenzy_prefect.spec.dataset import TokenFile

    ranges = sample_ranges((TokenFile(uri="s3://b/x.bin", tokens=tokens),), 2)
    _, starts, ends = merge_offset_ranges(["x"] * len(ranges), [2 * s for _, s, _ in ranges], [2 * (s + n) for _, s, n in ranges])
    return sum(e - s for s, e in zip(starts, ends, strict=True))


def timed_check(uri: str, repeats: int) -> tuple[float, float]:
    """(median, max) seconds of profile_dataset on ``uri``."""
    from frenzy_prefect.profiling.dataset import profile_dataset

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        profile_dataset(uri, seq_len=1024, vocab_size=VOCAB)
        times.append(time.perf_counter() - started)
    return statistics.median(times), max(times)


def whole_read_s(uri: str) -> float:
    from frenzy_prefect.storage import filesystem

    fs, path = filesystem(uri)
    started = time.perf_counter()
    fs.cat_file(path)
    return time.perf_counter() - started


def measure(megabytes: int, local: Path, s3_uri: str, repeats: int) -> dict:
    from frenzy_prefect.storage import filesystem, write_bytes

    ids = np.random.default_rng(megabytes).integers(0, VOCAB, megabytes * 2**19).astype(np.uint16)
    ids.tofile(local)
    write_bytes(s3_uri, ids.tobytes())  # one PUT (moto's multipart completion fails at this size)
    local_s, local_max = timed_check(str(local), repeats)
    s3_s, s3_max = timed_check(s3_uri, repeats)
    row = {
        "megabytes": megabytes,
        "tokens": len(ids),
        "sampled_bytes": sampled_bytes(len(ids)),
        "local_check_median_s": round(local_s, 4),
        "local_check_max_s": round(local_max, 4),
        "local_whole_read_s": round(whole_read_s(str(local)), 3),
        "moto_check_median_s": round(s3_s, 3),
        "moto_check_max_s": round(s3_max, 3),
        "moto_whole_read_s": round(whole_read_s(s3_uri), 3),
    }
    local.unlink()
    fs, path = filesystem(s3_uri)
    fs.rm(path)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, nargs="+", default=[4, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/dataset_check.json"))
    args = parser.parse_args()

    from frenzy_prefect.localstack import LocalStack
    from frenzy_prefect.storage import filesystem

    with tempfile.TemporaryDirectory() as home, LocalStack(Path(home)) as stack:
        stack.start_s3()
        filesystem(f"s3://{BUCKET}")[0].mkdir(BUCKET)
        rows = [measure(mb, Path(home) / f"tokens-{mb}.bin", f"s3://{BUCKET}/tokens-{mb}.bin", args.repeats) for mb in args.megabytes]
    load = round(os.getloadavg()[0], 1)
    print(f"profile_dataset of uint16 *.bin files, vocab_size {VOCAB}, {args.repeats} runs each; {os.cpu_count()} CPUs, load {load}")
    print("(moto reads the whole object for every ranged GET, so its column grows with the file; S3 and a local file do not)")
    print(f"{'MB':>6}{'sampled KiB':>13}{'local check s':>15}{'local read s':>14}{'moto check s':>14}{'moto read s':>13}")
    for r in rows:
        print(
            f"{r['megabytes']:>6}{r['sampled_bytes'] / 1024:>13.0f}{r['local_check_median_s']:>15.4f}"
            f"{r['local_whole_read_s']:>14.3f}{r['moto_check_median_s']:>14.3f}{r['moto_whole_read_s']:>13.3f}"
        )
    write_result({"vocab_size": VOCAB, "repeats": args.repeats, "cpus": os.cpu_count(), "load": load, "rows": rows}, args.json)


if __name__ == "__main__":
    main()

"""The dataset flows: `prepare-dataset` (raw text to token shards, which `train-llm` also does first
when given raw text) and `watch-datasets` (announces each new version of a raw dataset once, for the
deployments it triggers)."""

from __future__ import annotations

import hashlib
import time

from prefect import flow
from prefect.events import emit_event
from prefect.logging import get_run_logger
from prefect.variables import Variable

from frenzy_prefect.datasets.landing import Watch, fingerprint, listing_now, observe
from frenzy_prefect.datasets.prepare import Prepared
from frenzy_prefect.flows.tasks import prepare_dataset
from frenzy_prefect.spec.dataset import Preparation, RawSource


@flow(name="prepare-dataset")
def prepare_dataset_flow(source: RawSource, options: Preparation | None = None) -> Prepared:
    """Tokenise the raw text under ``source`` (*.txt, *.jsonl, *.parquet) into token shards and a
    manifest, once per content; ``train-llm`` trains on the manifest's URI. ``options`` names the
    tokenizer, or the vocab_size of a BPE trained on the data."""
    return prepare_dataset(source, options or Preparation())


@flow(name="watch-datasets")
def watch_datasets(prefix: RawSource, settle_s: float = 60.0) -> str | None:
    """Poll the raw dataset under ``prefix`` (run it on a schedule): once a new version's files
    have stood still for ``settle_s``, emit one ``frenzy.dataset.landed`` event about it (resource
    ``frenzy.dataset.<prefix>``; payload: prefix, version, files, bytes) and return its version.
    What it saw is kept between runs in the Prefect variable ``frenzy-watch-<hash>``."""
    key = "frenzy-watch-" + hashlib.sha256(prefix.encode()).hexdigest()[:16]
    watch = Watch.model_validate(Variable.get(key, default=None) or {})
    listing = listing_now(prefix)
    version = fingerprint(listing) if listing else None
    watch, landed = observe(watch, version, time.time(), settle_s)
    if landed:
        emit_event(
            event="frenzy.dataset.landed",
            resource={"prefect.resource.id": f"frenzy.dataset.{prefix}", "frenzy.prefix": prefix},
            payload={"prefix": prefix, "version": version, "files": len(listing.files), "bytes": sum(f.size for f in listing.files)},
        )
        get_run_logger().info(f"dataset {prefix} landed: version {version}, {len(listing.files)} files")
    Variable.set(key, watch.model_dump(), overwrite=True)
    return version if landed else None

"""When a dataset has landed: a new version under a prefix, announced once, after its files have
stopped changing for a settle time (an upload of many files, or of one file in several parts, is
one version, not one per file).

A watcher polls the prefix (``watch-datasets``, on a schedule) and keeps a ``Watch`` between polls:
the listing's fingerprint (every file's path, size and ETag), since when it has been unchanged,
and the last fingerprint it announced. The caller stores it."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict

from frenzy_prefect.datasets.sources import Listing, list_sources
from frenzy_prefect.errors import NoRawFiles


class Watch(BaseModel):
    model_config = ConfigDict(frozen=True)

    fingerprint: str | None = None
    since: float = 0.0  # when the listing last changed (the watcher's clock, seconds)
    announced: str | None = None  # the last version announced


def fingerprint(listing: Listing) -> str:
    """The version of a prefix's content: its files' paths, sizes and versions (ETags)."""
    digest = hashlib.sha256()
    for file in listing.files:
        digest.update(f"{file.path}\0{file.size}\0{file.version}\n".encode())
    return digest.hexdigest()[:16]


def listing_now(prefix: str) -> Listing | None:
    """The raw files under ``prefix`` now, or None while there are none (yet)."""
    try:
        return list_sources(prefix)
    except NoRawFiles:
        return None


def observe(watch: Watch, current: str | None, now: float, settle_s: float) -> tuple[Watch, bool]:
    """The watch after a poll that found ``current`` (None: nothing there), and whether to announce
    it now: it has stood still for ``settle_s`` and was not announced before."""
    if current != watch.fingerprint:
        return watch.model_copy(update={"fingerprint": current, "since": now}), False
    if current is None or current == watch.announced or now - watch.since < settle_s:
        return watch, False
    return watch.model_copy(update={"announced": current}), True

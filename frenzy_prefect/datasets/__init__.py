"""Dataset preparation: raw text under a prefix (plain text, JSONL, Parquet) tokenised into
token shards and a manifest, cached by content hash. Imports neither torch nor Prefect."""

"""The tokenizer a preparation uses: a Hugging Face ``tokenizer.json`` from a URI, or a byte-level
BPE (GPT-2's scheme: bytes as the base alphabet, so any text encodes) trained on the data itself,
offline. Both through the `tokenizers` library."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from frenzy_prefect.errors import DatasetError
from frenzy_prefect.storage import open_uri

BPE_EOS = "<|endoftext|>"
EOS_CANDIDATES = (BPE_EOS, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


def load(uri: str) -> tuple[Tokenizer, str]:
    """The tokenizer at ``uri`` and its identity (the sha256 of its tokenizer.json)."""
    try:
        with open_uri(uri, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise DatasetError(f"tokenizer {uri} does not exist") from None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises plain Exception
        raise DatasetError(f"tokenizer {uri} is not a Hugging Face tokenizer.json: {str(exc).splitlines()[0]}") from None
    return tokenizer, "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def bpe_identity(vocab_size: int) -> str:
    """What a BPE trained on the data depends on besides the data: its size and the trainer."""
    return f"byte-level-bpe:{vocab_size}:tokenizers-{tokenizers.__version__}"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of (at most) ``vocab_size`` tokens, <|endoftext|> first, trained on ``texts``."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DatasetError(f"a byte-level BPE needs vocab_size >= {len(alphabet) + 1} (256 bytes and {BPE_EOS}); got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def vocab_size(tokenizer: Tokenizer) -> int:
    """The embedding rows its ids need: one more than the largest id."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def eos_id(tokenizer: Tokenizer, eos_token: str | None) -> int:
    """The id put after every document: ``eos_token``'s, or the first known end-of-text token's."""
    candidates = (eos_token,) if eos_token else EOS_CANDIDATES
    for token in candidates:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    raise DatasetError(f"the tokenizer has no token {' or '.join(candidates)} to end documents with; set eos_token to one it has")

"""A character-level tokenizer covering every built-in task.

One token per character, built with the HF ``tokenizers`` library and wrapped as a
``transformers.PreTrainedTokenizerFast`` so that it saves and reloads through
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` like any other tokenizer.

Ids: ``<pad>``=0, ``<s>``=1, ``</s>``=2, ``<unk>``=3, then one id per character of
:data:`CHARS` in order. Encoding with ``add_special_tokens=True`` prepends ``<s>`` and
adds no ``</s>``; decoding joins tokens with nothing in between, so
``decode(encode(s), skip_special_tokens=True) == s`` for every string over ``CHARS``.
"""

from __future__ import annotations

import os

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CHARS: str = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:,<>|"
"""The character vocabulary: digits, lowercase letters, then `` +-*=:,<>|``."""

SPECIAL: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")
"""Special tokens, with ids 0, 1, 2, 3 in this order."""

PAD, BOS, EOS, UNK = SPECIAL


def vocab() -> dict[str, int]:
    """The token -> id map: the special tokens first, then one id per character."""
    tokens = SPECIAL + tuple(CHARS)
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Build the character-level tokenizer (left padding, ``<s>`` prepended, no ``</s>``)."""
    table = vocab()
    backend = Tokenizer(models.WordLevel(vocab=table, unk_token=UNK))
    backend.add_special_tokens(list(SPECIAL))
    # Every character, space included, becomes its own pre-token.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Fuse concatenates the tokens: no spaces are inserted when decoding.
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B",
        special_tokens=[(BOS, table[BOS])],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(path: str | os.PathLike[str]) -> None:
    """Build the tokenizer and write it to directory ``path`` (created if missing)."""
    os.makedirs(path, exist_ok=True)
    build_tokenizer().save_pretrained(os.fspath(path))

"""The character-level tokenizer of the built-in tiny models, saved in Hugging Face format."""
from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
# Every printable ASCII character except form feeds, so user prompts in plain text encode.
CHARACTERS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character plus <pad> (0), <bos> (1), <eos> (2)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")

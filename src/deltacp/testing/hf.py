"""A byte-level Hugging Face tokenizer built in memory (no download): for the trainer examples and tests."""

from __future__ import annotations


def byte_tokenizer(pad_token: str = "<|pad|>", eos_token: str = "<|eos|>"):
    """One token per UTF-8 byte (ids 0..255, GPT-2's byte-to-character map sorted), then the pad and end-of-text
    tokens (256, 257): a `PreTrainedTokenizerBase` that TRL and transformers accept, and `save_pretrained` writes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad_token, eos_token=eos_token)

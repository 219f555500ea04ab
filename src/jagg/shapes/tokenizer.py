"""A word-level tokenizer over the shapes-world vocabulary.

Id 0 is padding; words take ids 1..len(VOCAB) in `VOCAB` order. There is no unknown token: a word outside
the vocabulary raises ValueError. The empty prompt "" encodes to all padding, which is what the
unconditional branch of classifier-free guidance uses.
"""

from __future__ import annotations

import torch

from .scene import VOCAB, split_words

PAD_ID = 0
WORD_TO_ID: dict[str, int] = {w: i + 1 for i, w in enumerate(VOCAB)}
ID_TO_WORD: dict[int, str] = {i: w for w, i in WORD_TO_ID.items()}
vocab_size: int = len(VOCAB) + 1


def encode(prompts: list[str], max_len: int = 16) -> torch.Tensor:
    """Prompts -> LongTensor [N, max_len], left-aligned, padded with PAD_ID."""
    if isinstance(prompts, str):
        raise TypeError("encode takes a list of prompts; wrap a single prompt in a list")
    out = torch.full((len(prompts), max_len), PAD_ID, dtype=torch.long)
    for n, text in enumerate(prompts):
        words = split_words(text)
        if len(words) > max_len:
            head = " ".join(words[:8]) + (" ..." if len(words) > 8 else "")
            raise ValueError(f"prompt {head!r} has {len(words)} words, more than the {max_len} the model reads (its "
                             "max_text_len); shorten the prompt")
        for w in words:
            if w not in WORD_TO_ID:
                raise ValueError(f"unknown word {w!r} in prompt {text!r}; the tokenizer knows only: {' '.join(VOCAB)}")
        out[n, :len(words)] = torch.tensor([WORD_TO_ID[w] for w in words], dtype=torch.long)
    return out


def decode(ids: torch.Tensor) -> list[str]:
    """LongTensor [N, L] (or nested lists) -> prompts; padding is dropped."""
    rows = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    bad = [i for row in rows for i in row if i != PAD_ID and i not in ID_TO_WORD]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return [" ".join(ID_TO_WORD[i] for i in row if i != PAD_ID) for row in rows]

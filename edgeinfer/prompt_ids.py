"""A prompt given as text or token ids, checked and turned into a list of ids (`Model.encode_prompt`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgeinfer.errors import InvalidArgumentError, InvalidArgumentTypeError


def prompt_ids(prompt, tokenizer, vocab_size: int, name: str = "prompt") -> list[int]:
    """The ids of `prompt` (str: tokenized by `tokenizer`; a Sequence of ints or a 1-D integer numpy
    array: as they are), each in [0, vocab_size). Errors name the argument `name`: InvalidArgumentTypeError
    for a wrong type (bytes, bool or float ids), InvalidArgumentError for an empty prompt or an id
    outside the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError(f"the {name} is empty: give text, or [bos_id] to generate from nothing")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise InvalidArgumentTypeError(f"{name} must be text or token ids, not bytes: decode it first, "
                                       f"e.g. {name}.decode('utf-8')")
    elif isinstance(prompt, np.ndarray) and prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer):
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise InvalidArgumentTypeError(f"{name} must be a string, a list of token ids (ints) or a 1-D integer "
                                       f"numpy array, got {type(prompt).__name__}"
                                       + (f" of {prompt.dtype} shape {prompt.shape}"
                                          if isinstance(prompt, np.ndarray) else ""))
    if not ids:
        raise InvalidArgumentError(f"the {name} is empty (no tokens): give text or at least one token id")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids

"""The converter's last step for `--ngram-tokens N`: the converted model writes N tokens of its own
text and the n-gram table counted on it joins the folder (`edgeinfer/ngram_table.py` says what the
table is and how speculative decoding drafts from it)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from edgeinfer.errors import ConvertError
from edgeinfer.integrity import STAMP_FILE, sha256_file
from edgeinfer.manifest import Manifest, TokenizerInfo
from edgeinfer.ngram_table import FILE, MAX_CONTEXTS, NgramInfo, NgramTable, contexts_in, count_ngrams, sample_text

MAX_TOKENS = 2_000_000  # about 4 minutes for the 260K model on two cores, hours for a 100M one


def check_can_sample(tokenizer: TokenizerInfo) -> None:
    """Before any work: the model's own text starts from its BOS, else its first EOS id."""
    if tokenizer.bos_token_id is None and not tokenizer.eos_token_ids:
        raise ConvertError("--ngram-tokens: the model has no BOS or EOS id to start its own text from")


def add_ngram_table(folder: Path, manifest: Manifest, tokens: int, log) -> Manifest:
    """Load the finished folder, sample `tokens` of its text, write the table and the manifest naming
    it; the manifest written is returned. The stamp the load leaves is removed (the folder is not yet
    published: its first real load verifies it whole)."""
    import edgeinfer

    t0 = time.perf_counter()
    model = edgeinfer.load(folder, provider="cpu")
    try:
        texts = sample_text(model, tokens, log)
    finally:
        model.close()
        (folder / STAMP_FILE).unlink(missing_ok=True)
    arrays = count_ngrams(texts)
    contexts, sampled = contexts_in(arrays), sum(len(t) - 1 for t in texts)
    if not contexts:
        raise ConvertError(f"--ngram-tokens {tokens}: the model's {sampled} tokens of its own text hold no context "
                           "followed twice by the same token: give more tokens (the model may end its text at once)")
    if contexts > MAX_CONTEXTS:
        raise ConvertError(f"--ngram-tokens {tokens}: {contexts:,} contexts, more than a table may hold "
                           f"({MAX_CONTEXTS:,}): give fewer tokens")
    NgramTable.from_arrays(arrays, manifest.arch.vocab_size)  # what load will check
    np.savez_compressed(folder / FILE, **arrays)
    files = {**manifest.files, FILE: {"bytes": (folder / FILE).stat().st_size, "sha256": sha256_file(folder / FILE)}}
    manifest = dataclasses.replace(manifest, files=files, ngrams=NgramInfo(tokens=sampled, contexts=contexts))
    manifest.write(folder)
    log(f"n-gram table: {contexts:,} contexts from {sampled:,} tokens of the model's own text in "
        f"{time.perf_counter() - t0:.1f} s")
    return manifest

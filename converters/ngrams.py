"""The converter's last step for `--ngram-tokens N`: the converted model writes N tokens of its own
text and the n-gram table counted on it joins the folder (`edgeinfer/ngram_table.py` says what the
table is and how speculative decoding drafts from it)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from edgeinfer.integrity import STAMP_FILE, sha256_file
from edgeinfer.manifest import Manifest
from edgeinfer.ngram_table import FILE, NgramInfo, NgramTable, sample_text

MAX_TOKENS = 10_000_000  # about 20 minutes for the 260K model on two cores: more is surely a typo


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
    table = NgramTable.build(texts, manifest.arch.vocab_size)
    table.save(folder / FILE)
    files = {**manifest.files, FILE: {"bytes": (folder / FILE).stat().st_size, "sha256": sha256_file(folder / FILE)}}
    manifest = dataclasses.replace(manifest, files=files,
                                   ngrams=NgramInfo(tokens=sum(len(t) - 1 for t in texts), contexts=len(table)))
    manifest.write(folder)
    log(f"n-gram table: {len(table):,} contexts from {tokens:,} tokens of the model's own text in "
        f"{time.perf_counter() - t0:.1f} s")
    return manifest

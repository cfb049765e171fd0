"""`small_files.read_bytes`: a bounded file read as it is, not `limit` bytes at once."""

from __future__ import annotations

import tracemalloc

import pytest

from edgeinfer.errors import ModelFormatError
from edgeinfer.small_files import read_bytes


def test_a_small_file_is_read_without_reserving_its_limit(tmp_path):
    """read(limit + 1) reserved the whole limit: 256 MiB for a 19 KB tokenizer.json, so the bundled
    model failed to load under a 450 MB memory limit (a hostile round). Reading a 1 MB file under a
    256 MiB limit now allocates about the file (the end-of-file read is small too: a review)."""
    f = tmp_path / "tokenizer.json"
    f.write_bytes(b"x" * 1_000_000)
    tracemalloc.start()
    try:
        data = read_bytes(f, 256 << 20, ModelFormatError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data == b"x" * 1_000_000
    assert peak < 1_500_000, peak  # about the file (one part: its join is itself), not the limit
    assert read_bytes(f, 1_000_000, ModelFormatError) == b"x" * 1_000_000
    with pytest.raises(ModelFormatError, match="is 1000000 bytes: a file of at most 999999 bytes"):
        read_bytes(f, 999_999, ModelFormatError)
    (tmp_path / "empty").write_bytes(b"")
    assert read_bytes(tmp_path / "empty", 256 << 20, ModelFormatError) == b""

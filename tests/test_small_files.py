"""`small_files.read_bytes`: a bounded file read as it is, not `limit` bytes at once."""

from __future__ import annotations

import pytest

from edgeinfer.errors import ModelFormatError
from edgeinfer.small_files import read_bytes


def test_a_small_file_is_read_without_reserving_its_limit(tmp_path):
    """read(limit + 1) reserved the whole limit: 256 MiB for a 19 KB tokenizer.json, so the bundled
    model failed to load under a 450 MB memory limit (a hostile round). A limit no memory could hold
    now reads a small file as well as a small limit does."""
    f = tmp_path / "tokenizer.json"
    f.write_bytes(b"x" * 19_000)
    assert read_bytes(f, 2**40, ModelFormatError) == b"x" * 19_000
    assert read_bytes(f, 19_000, ModelFormatError) == b"x" * 19_000
    with pytest.raises(ModelFormatError, match="is 19000 bytes: a file of at most 18999 bytes"):
        read_bytes(f, 18_999, ModelFormatError)
    (tmp_path / "empty").write_bytes(b"")
    assert read_bytes(tmp_path / "empty", 2**40, ModelFormatError) == b""

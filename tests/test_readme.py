"""The README's Python API block runs as written (a docs audit found its `set_draft` line naming a
folder that does not exist, so the snippet stopped there with ModelFormatError)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_the_python_api_block_runs_as_written(tmp_path):
    text = README.read_text()
    section = text[text.index("## Python API"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "edgeinfer.load()" in block and "snapshot(" in block  # the block meant, not another
    out = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "system.npz").is_file()  # its snapshot, written where it says
    assert "Traceback" not in out.stderr

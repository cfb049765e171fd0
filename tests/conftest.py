"""Shared fixtures: paths to the committed models, and converted folders cached per session."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TINY = FIXTURES / "tiny"
STORIES_SRC = ROOT / "models" / "stories260K"
STORIES_FIX = FIXTURES / "stories260K"
TINY_MODELS = sorted(p.name for p in TINY.iterdir() if (p / "config.json").exists())


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(src, quant, **kw) -> folder; each (src, quant, kw) is converted once per test session."""
    from edgeinfer.converters import convert, default_scheme

    cache: dict = {}

    def get(src: Path, quant: str = "fp32", **kw) -> Path:
        key = (str(src), quant, tuple(sorted(kw.items())))
        if key not in cache:
            dst = tmp_path_factory.mktemp("converted") / f"{Path(src).name}-{quant}"
            convert(src, dst, scheme=default_scheme(quant, **kw))
            cache[key] = dst
        return cache[key]

    return get

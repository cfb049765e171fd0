"""Run the test suite with the oldest dependency versions pyproject.toml allows, so its floors stay true.

    python scripts/check_min_versions.py [--venv DIR] [--python PYTHON] [-- PYTEST_ARGS...]

Each runtime dependency `name>=X` in pyproject.toml is installed as `name==X` (a marker such as
`python_version < '3.11'` is kept), into a fresh virtual environment (`--venv`, default
/tmp/edgeinfer-min-versions, made anew), with the test extras at whatever pip picks (they are not
runtime floors; httpx may pull a newer h11). Then edgeinfer is installed from this checkout without
its dependencies, and `pip check` and pytest run there; the exit status is pytest's (or pip's, if an
install fails). Not run by CI (it doubles CI's time); run it when a floor changes. It found
onnxruntime 1.20-1.22 refusing the bundled model, tokenizers 0.19 unable to read stories260K's
tokenizer.json, and jinja2 3.1.0's sandbox missing str.format (2026-12-03).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib  # the script's own interpreter: 3.11 or newer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pinned_floors(pyproject: Path) -> list[str]:
    """Each `name>=X[; marker]` dependency as `name==X[; marker]`; any other form is refused, so a
    floor that cannot be pinned is seen."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out = []
    for dep in deps:
        spec, _, marker = dep.partition(";")
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", spec)
        if m is None:
            raise SystemExit(f"cannot pin {dep!r}: only name>=X floors are read")
        out.append(f"{m[1]}=={m[2]}" + (f";{marker}" if marker else ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=Path("/tmp/edgeinfer-min-versions"))
    ap.add_argument("--python", default=sys.executable, help="the interpreter the environment is made from")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (default: the whole suite, quietly)")
    a = ap.parse_args()
    pins = pinned_floors(ROOT / "pyproject.toml")
    shutil.rmtree(a.venv, ignore_errors=True)
    subprocess.run([a.python, "-m", "venv", str(a.venv)], check=True)
    py = str(a.venv / "bin" / "python")
    steps = [[py, "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [py, "-m", "pip", "install", "-q", *pins],
             [py, "-m", "pip", "install", "-q", "pytest>=8", "hypothesis>=6", "openai>=1.40", "httpx>=0.27", "gguf>=0.19"],
             [py, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
             [py, "-m", "pip", "check"]]
    print("pinned:", " ".join(pins), flush=True)
    for cmd in steps:
        rc = subprocess.run(cmd).returncode
        if rc:
            print(f"failed ({rc}): {' '.join(cmd)}", file=sys.stderr)
            return rc
    return subprocess.run([py, "-m", "pytest", *(a.pytest_args or ["-q", "-p", "no:warnings"])], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())

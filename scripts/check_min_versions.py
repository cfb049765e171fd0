"""Run the test suite with the oldest dependency versions pyproject.toml allows, so its floors stay true.

    python scripts/check_min_versions.py [--venv DIR] [--python PYTHON] [-- PYTEST_ARGS...]

Each runtime dependency `name>=X` in pyproject.toml is pinned as `name==X` (a marker such as
`python_version < '3.11'` is kept) in a constraints file, and installed with the test extras (which
pyproject.toml names; pip picks their versions, within those pins: httpx's h11 is let through, the one
runtime floor a test extra raises) into a fresh virtual environment (`--venv`, default
/tmp/edgeinfer-min-versions, made anew; a folder that exists must be a venv). Then edgeinfer is installed
from this checkout without its dependencies (editable, so it rebuilds the compiled sampler in this
checkout's edgeinfer/sampling/ with that venv's tools, and rewrites edgeinfer.egg-info: afterwards,
`pip install --no-deps -e .` in your own venv builds it again there); `pip check`, the versions installed, and pytest. The exit
status is pytest's, or the failing step's. Not run by CI (it doubles CI's time); run it when a floor
changes. The floors are old: use Python 3.11 (or `--python python3.10`) with a C compiler (psutil 5.9.0
has no 3.11 wheel; numpy 1.24.0 has none for 3.12, onnx 1.16.0 none for 3.13). It found onnxruntime
1.20-1.22 refusing the bundled model, tokenizers 0.19 unable to read stories260K's tokenizer.json, and
jinja2 3.1.0's sandbox missing str.format (2026-12-03).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (an edgeinfer dependency there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def pinned_floors(project: dict) -> list[str]:
    """Each `name>=X[; marker]` dependency as `name==X[; marker]`; any other form is refused, so a
    floor that cannot be pinned is seen."""
    out = []
    for dep in project["dependencies"]:
        spec, _, marker = dep.partition(";")
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", spec)
        if m is None:
            raise SystemExit(f"cannot pin {dep!r}: only name>=X floors are read")
        out.append(f"{m[1]}=={m[2]}" + (f";{marker}" if marker else ""))
    return out


LET_THROUGH = {"h11"}  # httpx (a test extra) needs a newer h11 than the daemon's floor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=Path("/tmp/edgeinfer-min-versions"))
    ap.add_argument("--python", default=sys.executable, help="the interpreter the environment is made from")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (default: the whole suite, quietly)")
    a = ap.parse_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = pinned_floors(project)
    if a.venv.exists() and not (a.venv / "pyvenv.cfg").is_file():
        raise SystemExit(f"{a.venv} exists and is not a virtual environment: give another --venv")
    shutil.rmtree(a.venv, ignore_errors=True)
    held = [p for p in pins if re.split(r"[=;]", p)[0] not in LET_THROUGH]
    py = str(a.venv / "bin" / "python")
    print("floors:", " ".join(held), flush=True)
    if subprocess.run([a.python, "-m", "venv", str(a.venv)]).returncode:
        return 1
    constraints = a.venv / "floors.txt"
    constraints.write_text("".join(f"{p}\n" for p in held))
    steps = [[py, "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [py, "-m", "pip", "install", "-q", "-c", str(constraints), *held, *project["optional-dependencies"]["test"]],
             [py, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
             [py, "-m", "pip", "check"],
             [py, "-m", "pip", "list", "--format=freeze"]]
    for cmd in steps:
        rc = subprocess.run(cmd).returncode
        if rc:
            print(f"failed ({rc}): {' '.join(cmd)}", file=sys.stderr)
            return rc
    return subprocess.run([py, "-m", "pytest", *(a.pytest_args or ["-q", "-p", "no:warnings"])], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())

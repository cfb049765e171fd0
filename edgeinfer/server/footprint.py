"""What a served model holds in memory, for the systemd unit's MemoryMax (`serve --print-systemd-unit`).

`footprint_bytes(config, folders)` = `loaded_bytes(config, folders)`, measured, plus
`held_per_request(...)` of each folder and the bodies in hand, computed:

1. Measured: a child process, started as the service is (from /, isolated), loads the model as the
   service does (`server.run.load_served`: its draft model attached; no power controller, no slots),
   checks --speculative against it, and reports the
   growth of its anonymous resident memory (RssAnon; elsewhere all resident memory). That counts the
   weights as ONNX Runtime holds them, which is not their size on disk: SmolLM2-135M's int4 folder
   (76 MiB) held 135 MiB (its blocks prepacked), its fp16 one (258 MiB) 538 MiB (cast to float32);
   a unit that counted the folder was killed by its own MemoryMax as the fp16 service started (a
   docs round). A child, so that the measure starts from a fresh heap (a process that has freed
   memory reuses it, and measured a load at less than it takes) and the printing process does not
   keep the model. The child raises what the service's start would (a capacity past the trained
   length, a draft model of another tokenizer, --speculative on a portable graph), here. Then it
   tokenizes a prompt of max_body_bytes digits (`BODY_TEXT`; at most MEASURED_BODY_BYTES of it, the
   peak scaled) and adds the peak growth: the daemon tokenizes one body at a time, and the most a
   body's tokens can take is many times its bytes (SmolLM2: 1 MiB of digits, 417 MiB; the bundled
   model: 55 MiB).
2. Computed, per folder: one KV ring per slot (each request holds one, of the draft model too),
   committed as the server starts or as requests come; the scores of a prefill call's attention,
   which ONNX Runtime's arena keeps at their largest (heads x chunk x ring rows x 4 bytes: 38 MiB for
   SmolLM2's default ring); for the served model under --speculative, each slot's verify buffer and
   prompt-lookup index (a request's last 2 x `NgramDrafter.window` tokens at most), and with ngram
   its n-gram table read and its memo full.
3. Computed: slots + queue bodies of max_body_bytes, the most the daemon holds unparsed before
   admission (server/app.py, `body.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edgeinfer import errors
from edgeinfer.errors import EdgeInferError

FIELDS = ("model", "threads", "capacity", "overflow", "draft_model", "speculative",  # what loading reads
          "max_body_bytes")  # (and the body the child tokenizes)
BODY_TEXT = "0123456789"  # the text of the body the child tokenizes: digits, a token each in SmolLM2's vocabulary,
# so the most tokens a body can give (1 MiB of them took its tokenizing to 417 MiB; of "the cat sat on a mat",
# 169 MiB; of punctuation, 154 MiB; the bundled model's 55, 43 MiB)


def footprint_bytes(config, folders: list[Path]) -> int:
    """The served model's memory (folders[0]; folders[1], its draft model: absolute paths) as the
    module doc says."""
    return (loaded_bytes(config, folders) + held_per_request(folders[0], config, served=True)
            + sum(held_per_request(f, config, served=False) for f in folders[1:])
            + config.body_budget_bytes)  # the bodies in hand (server/body.py)


def loaded_bytes(config, folders: list[Path]) -> int:
    """Step 1: what loading the model took, and then the most that tokenizing a body of max_body_bytes
    took (the daemon tokenizes one at a time), measured in a child process started as the service is (the
    same interpreter, from /, in isolated mode: no PYTHONPATH, no user site, no current folder on the
    path), so that an edgeinfer the service could not import is said here (a review: the child found
    it through the current folder, and the unit printed was for a service that failed to start); its
    refusal raised here as the same error."""
    fields = {k: getattr(config, k) for k in FIELDS}
    fields.update(model=str(folders[0]), draft_model=str(folders[1]) if len(folders) > 1 else None)
    done = subprocess.run([sys.executable, "-I", "-c", "from edgeinfer.server.footprint import _child; _child()"],
                          input=json.dumps(fields, default=str), capture_output=True, text=True, cwd="/")
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        if "No module named 'edgeinfer" in last:
            raise EdgeInferError(f"{sys.executable}, started as the service will be (from /, no PYTHONPATH), cannot "
                                 "import edgeinfer: install it into that environment (pip install, not a source "
                                 "folder on the path)") from None
        raise EdgeInferError(f"measuring the model's memory failed: {last}") from None
    if "error" in answer:
        kind = getattr(errors, answer["error"], EdgeInferError)
        raise (kind if isinstance(kind, type) and issubclass(kind, EdgeInferError) else EdgeInferError)(
            answer["message"])
    return answer["bytes"]


def _child() -> None:
    """The child of `loaded_bytes`: the fields on standard input, one JSON line out."""
    from types import SimpleNamespace

    import onnxruntime  # noqa: F401  (the libraries before the measure: the unit's margin counts them)

    from edgeinfer.server.run import check_speculative, load_served

    config = SimpleNamespace(**json.loads(sys.stdin.read()))
    before = _anon_bytes()
    try:
        model = load_served(config, power=False)
        try:
            check_speculative(config, model)
            answer = {"bytes": max(0, _anon_bytes() - before) + _tokenizing_bytes(model, config.max_body_bytes)}
        finally:
            model.close()
    except EdgeInferError as e:
        answer = {"error": type(e).__name__, "message": str(e)}
    print(json.dumps(answer), flush=True)


MEASURED_BODY_BYTES = 1 << 20  # a larger max-body-bytes is measured on this much and scaled: the cost is linear
# in the text (the bundled model: 1 MiB 58 MiB, 8 MiB 552 MiB measured), and measuring 64 MiB of SmolLM2's
# would take 27 GB on the device being set up (a review)


def _tokenizing_bytes(model, body_bytes: int) -> int:
    """The peak growth of resident memory while `model` tokenizes a prompt of `body_bytes` (BODY_TEXT),
    measured on at most MEASURED_BODY_BYTES of it and scaled: the peak reset through
    /proc/self/clear_refs (Linux); where that cannot be, the growth of RssAnon while the ids are
    still held."""
    sample = min(body_bytes, MEASURED_BODY_BYTES)
    text = (BODY_TEXT * (sample // len(BODY_TEXT) + 1))[:sample]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        start, key = _status_bytes("VmHWM"), "VmHWM"
    except OSError:
        start, key = _anon_bytes(), None
    ids = model.encode_prompt(text)
    grown = (_status_bytes(key) if key else _anon_bytes()) - start
    del ids
    return -(-max(0, grown) * body_bytes // sample)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _anon_bytes() -> int:
    try:
        return _status_bytes("RssAnon")
    except (OSError, StopIteration, ValueError, IndexError):
        import psutil

        return psutil.Process().memory_info().rss


def held_per_request(folder: Path, config, served: bool) -> int:
    """Step 2 for one folder (`served`: the served model, else its draft model)."""
    from edgeinfer.drafting import NgramDrafter
    from edgeinfer.inspect import kv_at_load
    from edgeinfer.manifest import read_manifest
    from edgeinfer.ngram_table import memory_bytes
    from edgeinfer.overflow import DEFAULT_PREFILL_CHUNK, resolve_capacity
    from edgeinfer.platforms import device_capacity_tokens
    from edgeinfer.speculative import verify_buffer_bytes

    manifest = read_manifest(folder)
    spec = manifest.arch
    cap = resolve_capacity(manifest.default_capacity_tokens, spec, config.capacity if served else None,
                           device_capacity_tokens(manifest.portable is not None))
    rows, ring = kv_at_load(manifest, cap)  # (a float16 ring, a portable graph's R)
    chunk = manifest.portable.prefill_tokens if manifest.portable is not None else min(DEFAULT_PREFILL_CHUNK, cap)
    scores = spec.num_heads * chunk * rows * 4
    speculation = 0
    if served and config.speculative != "off":
        index = 2 * NgramDrafter.window * NgramDrafter.BYTES_PER_TOKEN if config.speculative == "ngram" else 0
        speculation = config.slots * (verify_buffer_bytes(spec.vocab_size) + index)
        if config.speculative == "ngram" and manifest.ngrams is not None:
            speculation += memory_bytes(manifest.ngrams.contexts)
    return config.slots * ring + scores + speculation

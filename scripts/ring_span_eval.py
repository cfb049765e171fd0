"""Perplexity through a full ring, by call size: does a long text stay as good whatever the calls?

    python scripts/ring_span_eval.py -m MODEL [--capacity C ...] [--sinks N] [--out FILE.json]

The eval text (stories260K's, tests/fixtures, by default: `--text`) is fed twice through one ring of
each capacity, in one-token calls (as generation feeds its tokens) and in prefill calls of up to 256
tokens (as a long prompt enters a full ring, planned by `chunked.prefill_chunks`; a ring smaller
than that takes calls of its capacity, as `load` plans them: the JSON's `prefill_call_tokens`); the second
copy is scored (teacher forcing). A ring whose calls attend past the model's trained length scores
worse in the larger calls. Reports each capacity's two perplexities and the highest position
written. `--sinks`: default the model's own. The default capacities a model refuses (a sliding
window's) are skipped with a line saying why; none scored is an error. JSON out.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path

import edgeinfer
from edgeinfer.engine import prefill_chunks
from edgeinfer.evaluate import _nll

TEXT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "stories260K" / "eval.txt"


def score(m, stream: list[int], first_scored: int, chunk: int) -> tuple[float, int]:
    cache, total, count, pos, top = m.new_cache(), 0.0, 0, 0, 0
    while pos < len(stream) - 1:
        n = min(chunk, len(stream) - 1 - pos)
        for a, b in prefill_chunks(n, chunk, cache):
            logits = m.engine.forward(cache, stream[pos + a:pos + b], all_logits=True).reshape(b - a, -1)
            skip = max(0, first_scored - (pos + a))  # the same tokens scored whatever the calls
            if skip < b - a:
                total, count = total + _nll(logits[skip:], stream[pos + a + skip + 1:pos + b + 1]), count + b - a - skip
            top = max(top, cache.next_position - 1)
        pos += n
    return math.exp(total / count), top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--capacity", type=int, action="append", default=None,
                    help="ring capacities (default: the model's default, its trained length, and half that)")
    ap.add_argument("--sinks", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    base = edgeinfer.load(a.model)
    trained = base.manifest.arch.max_position_embeddings
    stories = [line for line in a.text.read_text().splitlines() if line.strip()]
    ids = [t for s in stories for t in base.tokenizer.encode(s, add_bos=True)]
    rows = []
    for cap in a.capacity or [base.capacity_tokens, trained, trained // 2]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a ring of the trained length warns that it re-bases often
            try:
                m = edgeinfer.load(a.model, capacity_tokens=cap, n_sink=a.sinks)
            except edgeinfer.InvalidArgumentError as e:
                if a.capacity:  # asked for: the refusal is the answer
                    raise SystemExit(f"ring_span_eval: capacity {cap}: {e}") from None
                print(json.dumps({"capacity": cap, "skipped": str(e)}), flush=True)
                continue
        chunk = min(256, m.engine.max_chunk)  # (a smaller ring's calls are at most its capacity)
        one, top1 = score(m, ids * 2, len(ids), 1)
        big, top_big = score(m, ids * 2, len(ids), chunk)
        row = {"capacity": cap, "rebase_every_tokens": m.cache.rebase_every_tokens, "ppl_1_token_calls": round(one, 4),
               "ppl_prefill_calls": round(big, 4), "prefill_call_tokens": chunk, "max_position": max(top1, top_big),
               "trained_length": trained}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not rows:
        raise SystemExit("ring_span_eval: no capacity was scored (each was refused, above)")
    if a.out:
        a.out.write_text(json.dumps({"model": str(base.folder), "text": str(a.text), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

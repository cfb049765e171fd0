"""What our code costs per generated token around the graph: the graph replaced by a replay.

    python scripts/bench_python_overhead.py -m MODEL [-m MODEL ...] [--tokens 200] [--rounds 7] [--text EVAL_TXT]
        [--out FILE.json]

On a tiny model the graph is a few hundred microseconds a token and this box's noise moves it by
tens, so the Python around it (sampling, detokenizing, the ring's bookkeeping, speculation's
stepper) cannot be told apart in a timed run. Here each of `bench_speculative.py`'s repeat prompts is
first decoded for real (greedy, EOS ignored, `--tokens` new tokens); then `Engine._run` is replaced
by a replay that runs nothing: for each row that wants logits it writes a row whose argmax is the
recorded next token, and commits rows as `_run` does. `Model.stream` then gives the same tokens, and
its time per token (first token to last) is our code's alone: plain, and with speculative="ngram"
(whose verify calls then cost nothing, so its figure is the stepper's Python, not a speed-up). The
replay's own cost (a row written per logits row, timed alone) is taken off. Medians over rounds of
the median over prompts, microseconds per token. JSON out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import edgeinfer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import repeat_prompts  # noqa: E402


class Replay:
    """Stands in for `Engine._run`: the recorded continuation's next token as each row's argmax."""

    def __init__(self, engine, ids: list[int]):
        self.engine, self.ids, self.rows = engine, ids, 0

    def __call__(self, io, cache, s: int, logits: np.ndarray) -> np.ndarray:
        n = logits.shape[1]
        first = cache.next_position + (s - n if s else 0)  # position of the first row that wants logits
        for j in range(n):
            row = logits[0, j]
            row.fill(0.0)
            i = first + j + 1
            row[self.ids[i] if i < len(self.ids) else 0] = 1.0
        self.rows += n
        if s:
            cache.commit(s)
        self.engine.calls += 1
        return logits[0]


def row_cost_s(vocab: int, n: int = 20000) -> float:
    """Seconds the replay spends per logits row (fill and one store), timed alone."""
    out = np.zeros((1, 1, vocab), np.float32)
    t0 = time.perf_counter()
    for _ in range(n):
        row = out[0, 0]
        row.fill(0.0)
        row[1] = 1.0
    return (time.perf_counter() - t0) / n


def started(m, prompt: list[int], n_new: int, spec):
    g = m.stream(prompt, max_new_tokens=n_new, temperature=0, ignore_eos=True, speculative=spec)
    it = iter(g)
    next(it)  # the prefill and the first token
    return it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--text", type=Path, default=None, help="paragraphs for a chat model's tasks (as bench_speculative)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for path in args.model:
        m = edgeinfer.load(path, threads=2)
        engine = m.engine
        prompts = repeat_prompts(m, args.text, args.tokens)
        recorded = []
        for p in prompts:
            c = m.generate(p, max_new_tokens=args.tokens, temperature=0, ignore_eos=True)
            recorded.append(list(p) + list(c.token_ids))
        real_run, per_row = engine._run, row_cost_s(engine.spec.vocab_size)
        us: dict = {None: [], "ngram": []}
        try:
            for r in range(args.rounds):
                for spec in ((None, "ngram") if r % 2 == 0 else ("ngram", None)):
                    per = []
                    for p, ids in zip(prompts, recorded):
                        replay = Replay(engine, ids)
                        engine._run = replay
                        it = started(m, p, args.tokens, spec)
                        rows0, t0, got = replay.rows, time.perf_counter(), []
                        for ch in it:
                            if ch.token_id is not None:
                                got.append(ch.token_id)
                        dt = time.perf_counter() - t0 - (replay.rows - rows0) * per_row
                        if got != ids[len(p) + 1:]:
                            raise SystemExit(f"the replay gave other tokens than the recorded ones ({path}, {spec})")
                        per.append(dt / len(got) * 1e6)
                    us[spec].append(statistics.median(per))
        finally:
            engine._run = real_run
        row = {"model": str(path), "tokens": args.tokens, "replay_row_us": round(per_row * 1e6, 2),
               "plain_us_per_token": round(statistics.median(us[None]), 2),
               "ngram_us_per_token": round(statistics.median(us["ngram"]), 2),
               "plain_rounds": [round(x, 2) for x in us[None]], "ngram_rounds": [round(x, 2) for x in us["ngram"]]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())

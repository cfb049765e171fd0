"""Free generation far past the ring's capacity, judged block by block: does the output stay good?

    python scripts/long_generation.py -m FOLDER [--judge FOLDER] [--tokens 20000] [--capacity 64] \
        [--block 1000] [--seed 1] [--out FILE]

1. Generates `--tokens` tokens from "Once upon a time" through a ring of `--capacity` slots (4 sinks,
   overflow shift), sampling at the defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05),
   EOS ignored so that one stream runs the whole length.
2. Cuts the generated ids into blocks of `--block` tokens and scores each block on its own under the
   judge model (default: the same folder; use the fp32 model) the way `edgeinfer eval` does: [BOS] +
   the block, windows of 512 tokens, each from position 0 with an empty cache.
3. Also reports per block the share of distinct 4-grams (a text collapsed into "ororor..." has
   almost none) and the first 60 characters of the block's text.
JSON out. A healthy ring gives flat perplexities and distinct-4-gram shares within noise.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import edgeinfer
from edgeinfer.engine import Engine
from edgeinfer.evaluate import window_nll
from edgeinfer.session import DecoderSession


def distinct_4grams(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / max(1, len(grams))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--judge", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--block", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    m = edgeinfer.load(args.model, capacity_tokens=args.capacity, n_sink=4, overflow="shift")
    t0 = time.perf_counter()
    c = m.generate("Once upon a time", max_new_tokens=args.tokens, seed=args.seed, ignore_eos=True)
    gen_s = time.perf_counter() - t0
    ids = list(c.token_ids)
    judge = Engine(DecoderSession(args.judge or args.model), max_chunk=512)
    window = min(512, judge.spec.max_position_embeddings)  # a window never passes the judge's trained length
    judge = Engine(judge.session, max_chunk=window)
    judge_cache = judge.new_cache(window, 0)
    bos = m.tokenizer.bos_id
    blocks = []
    for start in range(0, len(ids), args.block):
        block = ids[start:start + args.block]
        seq = [bos] + block
        total, count = 0.0, 0
        for w in range(0, len(seq), window):
            nll, n = window_nll(judge, judge_cache, seq[w:w + window])
            total, count = total + nll, count + n
        blocks.append({"tokens": f"{start + 1}-{start + len(block)}", "perplexity": round(math.exp(total / count), 3),
                       "distinct_4grams": round(distinct_4grams(block), 3),
                       "text": m.tokenizer.decode(block)[:60]})
    ppl = [b["perplexity"] for b in blocks]
    report = {"model": str(args.model), "judge": str(args.judge or args.model), "capacity_tokens": args.capacity,
              "n_sink": 4, "tokens": len(ids), "seed": args.seed, "generate_s": round(gen_s, 1),
              "ring_dropped_tokens": c.usage.dropped_tokens,
              "perplexity_first_block": ppl[0], "perplexity_median": sorted(ppl)[len(ppl) // 2],
              "perplexity_max": max(ppl), "perplexity_last_block": ppl[-1], "blocks": blocks}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

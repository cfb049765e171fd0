"""Decode speed with speculation against plain decoding, side by side in one run.

    python scripts/bench_speculative.py -m MODEL [-m MODEL ...] [--rounds 9] [--tokens 200]
        [--text EVAL_TXT] [--temperature T] [--draft DRAFT_MODEL] [--openings N] [--out FILE.json]

Per model, three kinds of prompt, each run plain and with speculative="ngram" (with --draft:
speculative="draft", that folder drafting) in alternating order
(greedy, or `--temperature` T with each prompt's own seed on both sides; `--tokens` new tokens, EOS
ignored, except where a chat model answers):
  repeat   text that repeats its input: a chat model (one with a chat template) is asked to repeat,
           fix the typos of, or add type hints to text it is given (paragraphs of `--text`), and its
           reply ends at EOS (past it, the model writes another conversation that copies nothing: with
           EOS ignored, 200 tokens of SmolLM2's 43-112-token replies were mostly that); a story
           model continues its own story (its greedy story, then the story's prompt again), one
           for each of the first `--openings` openings (default 3)
  random   random token ids (64): nothing repeats, so speculation should cost nothing
  text     a story model given `--text`: the first 48 tokens of three of its paragraphs (text the model
           did not write), continued
Reports, per model and kind, the median over rounds of decode tokens/s (`Completion.timings`) for
both, their ratio, the lowest, median and highest of the per-round ratios (the two sides of one
round run within a second of each other: their spread is the box's noise, which on a tiny model
moves the ratio by more than the differences sought; give more rounds there; the first prompt of
each kind runs once each way first, uncounted), speculation's
acceptance rate and mean accepted drafts per verify call, whether the tokens were identical, and
`copyable`: the share of plain decoding's tokens that prompt lookup's next draft would have got
right (the n-gram drafter replayed over prompt and output, without the model's n-gram table: how
much the text repeats its input, which bounds what prompt lookup alone can gain). JSON out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

import edgeinfer
from edgeinfer.drafting import NgramDrafter

TASKS = ("Repeat the following text exactly, word for word:\n\n{text}",
         "Fix the spelling mistakes in this text and write it out again in full:\n\n{typos}",
         "Add type hints to this Python function and write the whole function again:\n\n"
         "```python\ndef mean_and_spread(values, weights=None):\n    if weights is None:\n"
         "        weights = [1.0] * len(values)\n    total = sum(weights)\n"
         "    mean = sum(v * w for v, w in zip(values, weights)) / total\n"
         "    spread = sum(w * (v - mean) ** 2 for v, w in zip(values, weights)) / total\n"
         "    return mean, spread ** 0.5\n```")

OPENINGS = ("Once upon a time", "Lily and Ben", "The little dog",  # a story model's repeat prompts: the first
            "One day, a girl named Sue", "Tom was a boy who", "There was a big cat",  # `--openings` of these
            "The sun was shining", "Mia had a red", "A little bird")


def typos(text: str, rng: np.random.Generator) -> str:
    words = text.split()
    for i in rng.choice(len(words), size=max(1, len(words) // 8), replace=False):
        w = words[i]
        if len(w) > 3:
            j = int(rng.integers(1, len(w) - 1))
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def repeat_prompts(m, text_file: Path | None, n_new: int, openings: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(0)
    if m.manifest.tokenizer.chat_template:
        if text_file is None:
            raise SystemExit(f"{m.folder}: a chat model's repeat prompts are tasks on paragraphs of --text (e.g. "
                             "../shared/models/SmolLM2-135M-Instruct/eval.txt)")
        lines = [ln for ln in Path(text_file).read_text().splitlines() if len(ln.split()) > 40]
        out = []
        for i, task in enumerate(TASKS):
            para = lines[i % len(lines)]
            msg = task.format(text=para, typos=typos(para, rng))
            out.append(m.encode_chat([{"role": "user", "content": msg}]))
        return out
    out = []
    for start in OPENINGS[:openings]:
        ids = m.tokenizer.encode(start)
        story = m.generate(ids, max_new_tokens=n_new, temperature=0, ignore_eos=True).token_ids
        out.append(ids + list(story) + ids[1:])
    return out


def random_prompts(m) -> list[list[int]]:
    rng = np.random.default_rng(1)
    v = m.manifest.arch.vocab_size
    return [rng.integers(3, v, 64).tolist() for _ in range(3)]


def text_prompts(m, text_file: Path) -> list[list[int]]:
    lines = [ln for ln in Path(text_file).read_text().splitlines() if len(ln.split()) > 40]
    return [m.tokenizer.encode(ln)[:48] for ln in lines[:3]]


def run(m, prompt, n_new, spec, temperature=0.0, seed=0, ignore_eos=True):
    g = m.stream(prompt, max_new_tokens=n_new, temperature=temperature, seed=seed, ignore_eos=ignore_eos,
                 speculative=spec)
    c = g.run_to_end()
    return c, g.speculation


def copyable(prompt: list[int], tokens: list[int]) -> float:
    """The share of `tokens` that the n-gram drafter, fed the prompt and the tokens before, drafts
    first."""
    d, hits = NgramDrafter(prompt), 0
    for t in tokens:
        hits += d.draft(1) == [t]
        d.push(t)
    return hits / max(1, len(tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", type=Path, default=None,
                    help="paragraphs for a chat model's tasks, or a story model's 'text' prompts")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--draft", default=None, help="a draft model folder: measure speculative='draft'")
    ap.add_argument("--openings", type=int, default=3, choices=range(1, len(OPENINGS) + 1), metavar="N",
                    help=f"a story model's repeat prompts: its stories from the first N of {len(OPENINGS)} openings "
                         "(default 3; a chat model's repeat prompts are its three tasks, whatever N)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    drafter = "draft" if args.draft else "ngram"
    rows = []
    for path in args.model:
        m = edgeinfer.load(path, threads=args.threads)  # the model's default ring
        if args.draft:
            m.set_draft(args.draft)
        kinds = [("repeat", repeat_prompts(m, args.text, args.tokens, args.openings)), ("random", random_prompts(m))]
        if args.text and not m.manifest.tokenizer.chat_template:
            kinds.append(("text", text_prompts(m, args.text)))
        for kind, prompts in kinds:
            ignore_eos = not (kind == "repeat" and m.manifest.tokenizer.chat_template)  # a chat reply ends at EOS
            new_tokens = []
            tps: dict = {None: [], drafter: []}
            drafted = accepted = calls = 0
            same = True
            copied = []
            for spec in (None, drafter):  # a warm-up, not counted: the first speculative request measures the
                run(m, prompts[0], args.tokens, spec, args.temperature, 0, ignore_eos)  # engine's verify ratios and
                # reads the n-gram table (~0.5 s: round 1's ratio was 0.3x with them in it)
            for r in range(args.rounds):
                for spec in ((None, drafter) if r % 2 == 0 else (drafter, None)):
                    per = []
                    for i, p in enumerate(prompts):
                        c, st = run(m, p, args.tokens, spec, args.temperature, i, ignore_eos)
                        per.append(c.timings.decode_tok_s)
                        if spec and r == 0:
                            drafted, accepted, calls = drafted + st.drafted_tokens, accepted + st.accepted_tokens, \
                                calls + st.verify_calls
                            plain_ids = list(run(m, p, args.tokens, None, args.temperature, i, ignore_eos)[0].token_ids)
                            new_tokens.append(len(plain_ids))
                            same &= list(c.token_ids) == plain_ids
                            copied.append(copyable(list(p), plain_ids))
                    tps[spec].append(statistics.median(per))
            plain, spec = statistics.median(tps[None]), statistics.median(tps[drafter])
            per_round = sorted(b / a for a, b in zip(tps[None], tps[drafter]))
            row = {"model": str(path), "kind": kind, "prompts": len(prompts), "tokens": args.tokens,
                   "temperature": args.temperature, "ignore_eos": ignore_eos,
                   "new_tokens_per_prompt": new_tokens,
                   "plain_tok_s": round(plain, 1), f"{drafter}_tok_s": round(spec, 1), "speedup": round(spec / plain, 3),
                   "round_speedups": [round(per_round[0], 3), round(statistics.median(per_round), 3),
                                      round(per_round[-1], 3)],
                   "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                   "mean_accepted_per_verify": round(accepted / calls, 2) if calls else 0.0,
                   "identical_tokens": same, "copyable": round(statistics.mean(copied), 3) if copied else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "draft": args.draft,
                                        "openings": args.openings,
                                        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""Prompt-lookup speculative decoding (edgeinfer/speculative.py): the same tokens as plain decoding.

Exactness is asserted on fp32 stories260K (accuracy level 0, where a graph call of several rows
computes the logits of one-row calls up to float rounding): greedy and seeded sampling, the six
golden prompts, across a ring wrap, with stop strings and EOS. Each case also asserts that drafts
were verified and accepted, so that it cannot pass by never speculating.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC
from edgeinfer.errors import InvalidArgumentError
from edgeinfer import speculative
from edgeinfer.drafting import NgramDrafter
from edgeinfer.speculative import Tuning

GOLDEN = json.loads((STORIES_FIX / "golden.json").read_text())
NO_ENGINE = SimpleNamespace(ngram_table=lambda: None)  # the engine a hand-computed rule reads nothing else from
SAMPLINGS = [dict(temperature=0), dict(temperature=0.8, seed=3), dict(temperature=1.0, top_p=0.9, top_k=40, seed=11,
                                                                      repetition_penalty=1.1)]


def test_drafter_takes_the_latest_occurrence_of_the_longest_ngram():
    d = NgramDrafter([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], max_n=3, min_n=2)
    # "2 3" last occurred at index 6 (followed by 7 5 2 3), "x 2 3" with x=5 never: the bigram decides
    assert d.draft(3) == [7, 5, 2]
    d.push(7)  # now "3 7": occurred at 6..7, followed by 5 2 3 7
    assert d.draft(8) == [5, 2, 3, 7]  # a continuation runs up to the end of the history, no further
    d = NgramDrafter([4, 1, 2, 3, 8, 0, 1, 2, 3, 6, 1, 2, 3], max_n=3, min_n=2)
    assert d.draft(2) == [6, 1]  # "1 2 3" twice before: the most recent one (followed by 6)


def test_drafter_reports_how_far_the_text_agrees_before_its_match():
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 3, 4, 5])
    # "3 4 5" occurred at 2..4, preceded by 2; now preceded by 9: the agreement is the trigram only
    assert (d.draft(4), d.match) == ([9, 3, 4, 5], 3)
    d = NgramDrafter([7, 1, 2, 3, 4, 7, 1, 2, 3])
    assert (d.draft(2), d.match) == ([4, 7], 4)  # "7 1 2 3" agrees, back to the start of the history
    d = NgramDrafter(list(range(50)) * 2)
    assert (d.draft(3), d.match) == ([0, 1, 2], NgramDrafter.max_match)  # a long copy: capped
    d.push(99)
    assert (d.draft(3), d.match) == ([], 0)


def test_the_prompts_index_is_what_pushing_it_token_by_token_leaves():
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 3, 4, 50, 400):
        ids = rng.integers(0, 6, n).tolist()  # a small vocabulary: n-grams recur
        pushed = NgramDrafter([])
        for t in ids:
            pushed.push(t)
        for max_n, min_n in ((3, 2), (1, 1), (4, 1)):
            a, b = NgramDrafter(ids, max_n, min_n), NgramDrafter([], max_n, min_n)
            for t in ids:
                b.push(t)
            assert a.index == b.index and a.history == b.history
        assert NgramDrafter(ids).index == pushed.index



def reference_draft(history: list[int], k: int, max_n: int = 3, min_n: int = 2, max_match: int = 32,
                    discount: int = 2) -> tuple[list[int], int, list[float]]:
    """The drafter's copy as its docstring defines it, searched afresh: (drafts, match, chances)."""
    for n in range(max_n, min_n - 1, -1):
        ends = [e for e in range(n - 1, len(history) - 1) if history[e - n + 1:e + 1] == history[len(history) - n:]]
        if len(history) >= n and ends:
            end, m = ends[-1], n
            while m < max_match and m <= end and history[end - m] == history[-1 - m]:
                m += 1
            copied = history[end + 1:end + 1 + k]
            r = max(0, m - discount) + 1
            return copied, m, [r / (r + j) for j in range(1, len(copied) + 1)]
    return [], 0, []


def test_the_drafter_drafts_what_a_fresh_search_finds_whatever_was_pushed_between():
    """`_copy` carries a copy's agreement over from its last draft (d tokens pushed since, the same
    occurrence moved on by d): the drafts, match and chances must be those of a search from scratch,
    for any run of pushes between drafts (a verify call's accepted drafts are pushed one by one, then
    one draft), through long exact copies (the cap), copies that break, and the window's cuts."""
    rng = np.random.default_rng(7)
    for trial in range(40):
        base = rng.integers(0, 4 if trial % 2 else 30, int(rng.integers(5, 60))).tolist()
        ids = base * int(rng.integers(1, 6))  # long copies, and their agreement past the cap
        for i in rng.choice(len(ids), size=len(ids) // 15, replace=False):
            ids[i] = int(rng.integers(0, 30))  # broken here and there
        max_n, min_n = ((3, 2), (4, 1), (2, 2))[trial % 3]
        d = NgramDrafter(ids[:3], max_n, min_n)
        if trial % 4 == 0:
            d.window = 40  # cuts at 80 tokens
        at = 3
        while at < len(ids):
            step = int(rng.choice([1, 1, 1, 2, 3, 5, 9]))
            for t in ids[at:at + step]:
                d.push(t)
            at += step
            k = int(rng.integers(0, 10))
            want = reference_draft(d.history, k, max_n, min_n)
            assert (d.draft(k), d.match, d.chances) == want, (trial, at)
            if rng.random() < 0.2:  # drafted twice with nothing pushed between
                assert (d.draft(k), d.match, d.chances) == want


def test_a_long_history_is_cut_to_the_window():
    """The drafter indexed every n-gram of everything a request had seen, ~250 bytes a token for as long
    as it ran (a review: 270 MB for a million-token reply). It keeps the last `window` tokens to twice
    as many, and drafts as a drafter made from those tokens would."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 5, 400).tolist()
    assert NgramDrafter(ids).history == ids and NgramDrafter(ids * 50).history == (ids * 50)[-NgramDrafter.window:]
    d = NgramDrafter(ids[:130])
    d.window = 50  # (a small window for the test: the cut comes at 100 tokens)
    longest = 0
    for i, t in enumerate(ids[130:], 131):
        d.push(t)
        longest = max(longest, len(d.history))
        assert d.history == ids[:i][-len(d.history):] and 50 <= len(d.history) < 100
        fresh = NgramDrafter(d.history)
        assert (d.draft(4), d.match) == (fresh.draft(4), fresh.match) and d.index == fresh.index
    assert longest == 99

def test_drafter_without_a_match_or_history_drafts_nothing():
    assert NgramDrafter([]).draft(4) == []
    assert NgramDrafter([5]).draft(4) == []  # shorter than n
    assert NgramDrafter([1, 2, 3, 4]).draft(4) == []  # no n-gram repeats
    assert NgramDrafter([1, 2, 1, 2]).draft(0) == []
    with pytest.raises(InvalidArgumentError):
        NgramDrafter([], max_n=1, min_n=2)


def test_speculative_option_is_checked():
    m = edgeinfer.load()
    with pytest.raises(InvalidArgumentError, match="speculative"):
        m.generate("Once", speculative="medusa")
    with pytest.raises(InvalidArgumentError, match="speculative"):
        m.generate("Once", speculative=True)


@pytest.fixture(scope="module")
def fp32(converted):
    return converted(STORIES_SRC, "fp32")


@pytest.fixture(autouse=True, params=[4, 8])
def always_draft(request, monkeypatch):
    """Draft k tokens whenever a draft exists: which drafts run must not depend on timing (the adaptive
    rule measures calls, so under a loaded CI machine it might draft nothing and test nothing)."""
    monkeypatch.setattr(speculative, "TUNING", Tuning(fixed_k=request.param))


def both(m, prompt, **kw):
    """Plain, then speculative, each from an empty cache (no prefix reuse between them)."""
    m.held = None
    plain = m.stream(prompt, **kw)
    a = plain.run_to_end()
    m.held = None
    spec = m.stream(prompt, speculative="ngram", **kw)
    b = spec.run_to_end()
    return a, b, spec.speculation


@pytest.mark.parametrize("capacity", [512, 64])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "top_p+penalty"])
def test_identical_to_plain_decoding_on_the_golden_prompts(fp32, capacity, sampling):
    m = edgeinfer.load(fp32, capacity_tokens=capacity, threads=2)
    verified = accepted = 0
    for case in GOLDEN["cases"]:
        a, b, st = both(m, case["prompt_ids"], max_new_tokens=200, ignore_eos=True, **sampling)
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        assert b.usage == a.usage
        verified, accepted = verified + st.verify_calls, accepted + st.accepted_tokens
    least = 20 if capacity > 64 else 0  # a 64-slot ring fills after ~50 tokens: no drafts while it shifts
    assert verified > least and accepted > least  # speculation did run (and was right) on these stories


def test_a_ring_that_wraps_during_speculation_matches(fp32):
    """capacity 64, 8 sinks: the ring fills during drafting (drafts are cut to the free slots) and then
    shifts for 150 tokens (plain steps), re-basing positions on the way."""
    m = edgeinfer.load(fp32, capacity_tokens=64, n_sink=8, threads=2)
    p = GOLDEN["cases"][1]["prompt_ids"]
    story = list(m.generate(p, max_new_tokens=40, temperature=0, ignore_eos=True).token_ids)
    prompt = p + story[:20] + p[1:] + story[:3]  # the story, then its start again: drafts agree
    assert len(prompt) < 50
    a, b, st = both(m, prompt, max_new_tokens=200, temperature=0, ignore_eos=True)
    assert b.token_ids == a.token_ids and b.usage.dropped_tokens == a.usage.dropped_tokens > 100
    assert st.accepted_tokens > 0
    assert m.cache.rebased_tokens > 0


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.8"])
def test_stop_strings_and_eos_inside_accepted_drafts(fp32, sampling):
    m = edgeinfer.load(fp32, capacity_tokens=512, threads=2)
    prompt = GOLDEN["cases"][2]["prompt_ids"]
    plain = m.generate(prompt, max_new_tokens=200, ignore_eos=True, **sampling)
    words = plain.text.split()
    hits = 0
    for stop in {w for w in words[20:] if len(w) > 3}:  # stops that occur late, inside drafted runs
        a, b, st = both(m, prompt, max_new_tokens=200, ignore_eos=True, stop=stop, **sampling)
        assert (b.text, b.token_ids, b.finish_reason, b.usage) == (a.text, a.token_ids, a.finish_reason, a.usage)
        assert a.finish_reason == "stop"
        hits += st.accepted_tokens > 0
    assert hits > 3
    for case in GOLDEN["cases"]:  # EOS: the stories end; the completion stops at the same place
        a, b, _ = both(m, case["prompt_ids"], max_new_tokens=400, **sampling)
        assert (b.token_ids, b.finish_reason, b.usage) == (a.token_ids, a.finish_reason, a.usage)


def test_drafts_never_pass_the_free_slots_or_the_chunk(fp32):
    """A 48-token prompt in a 64-slot ring leaves 15 free slots; prefill_chunk 3 allows 2 drafts per call."""
    for kw in (dict(capacity_tokens=64), dict(capacity_tokens=512, prefill_chunk=3)):
        m = edgeinfer.load(fp32, threads=2, **kw)
        story = m.generate(GOLDEN["cases"][0]["prompt_ids"], max_new_tokens=30, temperature=0, ignore_eos=True)
        prompt = (GOLDEN["cases"][0]["prompt_ids"] + list(story.token_ids))[:48]
        a, b, st = both(m, prompt, max_new_tokens=60, temperature=0, ignore_eos=True)
        assert b.token_ids == a.token_ids and st.verify_calls > 0


def test_the_cache_holds_exactly_what_plain_decoding_leaves(fp32):
    """Rejected draft rows are never committed: after the request the valid slots, positions and keys
    equal those of plain decoding."""
    m = edgeinfer.load(fp32, capacity_tokens=512, threads=2)
    prompt = GOLDEN["cases"][3]["prompt_ids"]
    m.generate(prompt, max_new_tokens=150, temperature=0, ignore_eos=True)
    n, pos, k0 = m.cache.n_valid, m.cache.positions.copy(), m.cache.ks[0][:m.cache.n_valid].copy()
    g = m.stream(prompt, max_new_tokens=150, temperature=0, ignore_eos=True, speculative="ngram")
    g.run_to_end()
    assert g.speculation.drafted_tokens > g.speculation.accepted_tokens > 0  # some drafts were rejected
    assert m.cache.n_valid == n and np.array_equal(m.cache.positions, pos)
    np.testing.assert_allclose(m.cache.ks[0][:n], k0, atol=1e-5)


def test_a_stream_dropped_half_way_leaves_the_model_usable(fp32):
    m = edgeinfer.load(fp32, capacity_tokens=512, threads=2)
    prompt = GOLDEN["cases"][4]["prompt_ids"]
    want = m.generate(prompt, max_new_tokens=80, temperature=0, ignore_eos=True)
    g = m.stream(prompt, max_new_tokens=80, temperature=0, ignore_eos=True, speculative="ngram")
    for _ in zip(range(30), g):
        pass
    g.close()
    again = m.generate(prompt, max_new_tokens=80, temperature=0, ignore_eos=True, speculative="ngram")
    assert again.token_ids == want.token_ids


def test_logprobs_and_conversations_speculate_too(fp32):
    m = edgeinfer.load(fp32, capacity_tokens=512, threads=2)
    prompt = GOLDEN["cases"][5]["prompt_ids"]
    from edgeinfer.generation import Generation  # logprobs: the daemon's path
    from edgeinfer.options import GenerationOptions

    def run(spec):
        opts = GenerationOptions.from_kwargs(max_new_tokens=120, temperature=0.7, seed=2, ignore_eos=True,
                                             speculative=spec)
        m.cache.reset()
        g = Generation(m.engine, m.tokenizer, m.cache, opts, "shift", begin=lambda req: list(prompt), logprobs=2)
        return [(c.token_id, c.logprob, c.top_logprobs) for c in g], g.speculation
    (a, _), (b, st) = run(None), run("ngram")
    assert [x[0] for x in a] == [x[0] for x in b] and st.accepted_tokens > 0
    np.testing.assert_allclose([x[1] for x in a if x[1] is not None], [x[1] for x in b if x[1] is not None], atol=1e-4)
    c1, c2 = m.conversation(), m.conversation()
    for text in ("Lily had a red ball.", "What did Lily do with the ball?"):
        r1 = c1.say(text, max_new_tokens=60, temperature=0)
        r2 = c2.say(text, max_new_tokens=60, temperature=0, speculative="ngram")
        assert r1.token_ids == r2.token_ids


def daemon_answers_like_plain(fp32, check=None, **settings) -> None:
    """A daemon on `fp32` with two slots (batched decoding) and `settings`: requests alone and side by
    side, through the official openai client, equal the model's plain greedy completions. `check(server)`
    runs once it is up."""
    from concurrent.futures import ThreadPoolExecutor

    from edgeinfer.server.config import ServeConfig
    from test_server import Running

    m = edgeinfer.load(fp32, capacity_tokens=512)
    prompts = [GOLDEN["cases"][i]["prompt"] or "Once" for i in (1, 2, 3)]
    want = [m.generate(p, max_new_tokens=60, temperature=0, ignore_eos=True).text for p in prompts]
    r = Running(ServeConfig(model=str(fp32), slots=2, queue=4, capacity=512, **settings))
    try:
        if check is not None:
            check(r.server)
        cl = r.client(None)

        def ask(p):
            c = cl.completions.create(model=r.server.model_id, prompt=p, max_tokens=60, temperature=0,
                                      extra_body={"ignore_eos": True})
            return c.choices[0].text
        assert ask(prompts[0]) == want[0]
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, prompts)) == want
    finally:
        r.stop()


def test_the_daemon_speculates_and_answers_as_plain_decoding(fp32):
    """`edgeinfer serve --speculative ngram`: see `daemon_answers_like_plain`."""
    from edgeinfer.server.config import ServeConfig

    with pytest.raises(InvalidArgumentError, match="speculative"):
        ServeConfig(speculative="medusa")
    daemon_answers_like_plain(fp32, speculative="ngram")


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.8"])
def test_the_adaptive_rule_gives_the_same_tokens(fp32, sampling, monkeypatch):
    monkeypatch.setattr(speculative, "TUNING", Tuning())
    m = edgeinfer.load(fp32, capacity_tokens=512, threads=2)
    for case in GOLDEN["cases"]:
        a, b, _ = both(m, case["prompt_ids"], max_new_tokens=200, ignore_eos=True, **sampling)
        assert (b.token_ids, b.usage) == (a.token_ids, a.usage)


def test_adaptive_draft_length_follows_measured_costs():
    """Hand-computed, a draft model's drafts: a = 1 s per plain step; verify calls of s = 1..9 rows cost
    r = 1, 1.1, 1.35, 1.6, 1.2, 1.45, 1.7, 1.95, 2.2 steps, with drafts accepted whole (p = 5/6 after
    4 whole runs of 4): k = 4 is best; when 2 rows cost 3 steps and 5 rows 4, no k pays unless nearly
    every draft is right."""
    st = speculative.SpeculativeStepper(engine=NO_ENGINE, inner=None, history=[], max_new_tokens=100, tuning=Tuning())
    st._step_s, st._ratios = 1.0, (1.0, 1.1, 1.35, 1.6, 1.2, 1.45, 1.7, 1.95, 2.2)
    st._whole, st._counts[True] = True, [4.0, 0.0]  # p = (4 + 1) / (4 + 0 + 2) = 5/6
    # k=4: (1 + p + p^2 + p^3 + p^4) / 1.2 = 3.39 / 1.2 = 2.83; k=1: 1.83 / 1.1 = 1.67; k=5: 3.99 / 1.45 = 2.75
    assert st.k() == 4
    st._draft_s = 0.5  # drafting costs half a step per drafted token (a draft model): short drafts win
    # k=1: 1.83 / (1.1 + 0.5) = 1.15; k=2: 2.53 / (1.35 + 1.0) = 1.08; k=4: 3.39 / (1.2 + 2.0) = 1.06
    st._version += 1  # the measurements changed behind k()'s back (the stepper bumps it itself)
    assert st.k() == 1
    st._draft_s = 0.0
    st._ratios = (1.0, 3.0, 3.25, 3.5, 4.0, 4.25, 4.5, 4.75, 5.0)
    assert st.k() == 1  # nothing measured since: k() answers from its memo
    st._version += 1
    assert st.k() == 0  # k=4: 3.39 / 4 = 0.85 < 1.05
    st._counts[True] = [200.0, 0.0]  # p = 201/202: k=4 gives 4.95 / 4 = 1.24; k=8 8.8 / 5 = 1.76
    st._version += 1
    assert st.k() == 8


def test_copied_text_gets_drafts_as_long_as_they_pay():
    """Hand-computed, n-gram drafts (free): a verify call of s rows costs r[s] = 1 + (s - 1) / 2 plain
    steps. After a match of 2 (r = 1: draft j accepted with chance 1 / (1 + j)) no k
    pays: k=1 gives 1.5 / 1.5 = 1.0 < 1.05. After a match of 12 (r = 11: chances 11/12, 11/13, ..):
    k=1 1.917 / 1.5 = 1.278, k=2 2.763 / 2 = 1.381, k=3 3.549 / 2.5 = 1.419, k=4 4.282 / 3 = 1.427,
    k=5 4.970 / 3.5 = 1.420: k = 4. When this request's drafts were accepted a quarter as often as
    predicted (g = 1/4), k=1 gives (1 + 0.229) / 1.5 = 0.82: none. No time is measured: the same
    tokens give the same k."""
    st = speculative.SpeculativeStepper(engine=NO_ENGINE, inner=None, history=[], max_new_tokens=100, tuning=Tuning())
    assert st.drafter.free
    st._ratios = tuple(1 + (s - 1) / 2 for s in range(1, 10))
    after_2, after_12 = [1 / (1 + j) for j in range(1, 9)], [11 / (11 + j) for j in range(1, 9)]
    assert st._k_for_chances(after_2) == 0
    assert st._k_for_chances(after_12) == 4
    assert st._k_for_chances(after_12[:2]) == 2  # only two drafts to verify
    st._calib = [1.0, 4.0]
    assert st._k_for_chances(after_12) == 0
    # a settled draft moves the calibration: 0 accepted of 2.5 predicted
    st._calib, st._predicted = [1.0, 1.0], 2.5
    st._adapt(0, 3)
    assert st._calib == pytest.approx([0.9, 0.9 + 2.5])


def test_verify_ratios_are_measured_once_per_engine(fp32):
    """The engine's r[s]: one row is 1, a larger call never cheaper than a smaller, one per size up
    to k_max + 1; asked again (any request, any k_max it covers), the same tuple, not re-measured."""
    m = edgeinfer.load(fp32, capacity_tokens=128)
    r = m.engine.verify_ratios(8)
    assert len(r) == 9 and r[0] == 1.0 and all(b >= a > 0 for a, b in zip(r, r[1:]))
    assert m.engine.verify_ratios(4) is r and m.engine.verify_ratios(8) is r
    # measured with the engine to itself: another request's calls must not count as these (review)
    other = edgeinfer.load(fp32, capacity_tokens=128)
    real, held = other.engine._forward, []

    def forward(*a, **kw):
        held.append(other.engine.lock.locked())
        return real(*a, **kw)

    other.engine._forward = forward
    other.engine.verify_ratios(8)
    assert held and all(held)


def test_the_same_request_gives_the_same_tokens_every_time_at_accuracy_level_4(monkeypatch):
    """The bundled int8 model (accuracy level 4: a row's logits depend a little on its call's size):
    which rows share a verify call follows the tokens alone, not the times measured, so the same
    request speculates the same way and gives the same tokens every time, other requests between
    (hostile review: 10 runs gave 3 different texts), for as long as the model stays loaded. The clock
    is made erratic once the engine's ratios are measured: the rule must not read it."""
    monkeypatch.setattr(speculative, "TUNING", Tuning())  # the adaptive rule, not the fixture's fixed k
    m = edgeinfer.load()
    p = "Once upon a time, there was a little girl named Lily. She liked to play. Once upon a time, there was a little"
    m.engine.verify_ratios(Tuning().k_max)
    rng, now = np.random.default_rng(0), [0.0]

    def erratic() -> float:
        now[0] += float(rng.choice([1e-6, 1e-3, 0.1]))
        return now[0]

    monkeypatch.setattr(speculative.time, "perf_counter", erratic)
    got, verified = set(), set()
    for k in range(6):
        if k % 2:
            m.generate("Tom had a dog.", max_new_tokens=3)
        g = m.stream(p, max_new_tokens=300, temperature=0, speculative="ngram")
        got.add(g.run_to_end().token_ids)
        verified.add((g.speculation.verify_calls, g.speculation.drafted_tokens))
    assert len(got) == 1 and len(verified) == 1 and min(verified)[0] > 0


def test_a_model_trained_on_fewer_than_64_positions_speculates(tmp_path):
    """The verify-cost calibration used a 64-slot scratch ring: on a model trained on 48 positions,
    speculative="ngram" raised an error about a capacity of 64 the user never gave. It now calibrates
    within the trained length, and gives plain decoding's tokens."""
    import shutil

    from edgeinfer.converters import convert

    src = tmp_path / "src48"
    shutil.copytree(STORIES_SRC, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 48}))
    convert(src, tmp_path / "d48", quant="fp32")
    m = edgeinfer.load(tmp_path / "d48")
    text = "Lily and Ben were playing. Lily and Ben were"
    plain = m.generate(text, max_new_tokens=60, temperature=0, ignore_eos=True).token_ids
    assert m.generate(text, max_new_tokens=60, temperature=0, ignore_eos=True, speculative="ngram").token_ids == plain
    assert len(m.engine.verify_ratios(8)) == 9

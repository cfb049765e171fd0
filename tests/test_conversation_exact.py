"""A Conversation turn against plain decoding of the same ids (fp32, so exactly): its penalties and
usage see the whole conversation, and a turn rolled back leaves the conversation exactly as a twin
that never had it (the cache's rows, its bookkeeping, the next reply). Each test is a defect a
hostile round found."""

from __future__ import annotations

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_SRC
from edgeinfer.generation import GenerationCancelled

GREEDY = dict(temperature=0, ignore_eos=True)
LONG = ("Lily had a red ball. She liked to play with it in the park every day with her friend Ben. "
        "One day the ball rolled away and they ran after it.")  # 66 tokens: past a ring of 64


@pytest.fixture(scope="module")
def fp32(converted):
    return converted(STORIES_SRC, "fp32")


def _cancelled(stream) -> None:
    stream.cancel()
    with pytest.raises(GenerationCancelled):
        next(stream)


def _same_state(a, b) -> None:
    """Two conversations hold the same cache (rows and bookkeeping) and history."""
    assert a.messages == b.messages
    assert [(c._prompt_text, c._reply, c._unfed, c._rebuild, getattr(c, "_held", None)) for c in (a, b)] == \
        [(b._prompt_text, b._reply, b._unfed, b._rebuild, getattr(b, "_held", None))] * 2
    assert a.cache.mark() == b.cache.mark()
    n = a.cache.n_valid
    assert np.array_equal(a.cache.positions[:n], b.cache.positions[:n])
    for ka, kb, va, vb in zip(a.cache.ks, b.cache.ks, a.cache.vs, b.cache.vs):
        assert np.array_equal(ka[:n], kb[:n]) and np.array_equal(va[:n], vb[:n])


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.5), dict(presence_penalty=1.0),
                                     dict(frequency_penalty=0.5, penalty_last_n=256)])
def test_a_turn_s_penalties_and_usage_see_the_whole_conversation(fp32, penalty):
    """The sampler's penalty history held only the ids the turn fed, not the conversation before it
    (576 of 577 penalised turns differed from plain decoding of the same ids); and the usage counted
    only the fed ids, with cached_tokens 0, where generate on the same ids counts the whole prompt."""
    m = edgeinfer.load(fp32)
    opts = dict(GREEDY, max_new_tokens=20, **penalty)
    c = m.conversation()
    p1 = m.encode_chat([{"role": "user", "content": "Lily had a red ball."}])
    r1 = c.say("Lily had a red ball.", **opts)
    new = m.tokenizer.encode_continuation("\nUser: What did Lily do?\nAssistant:")  # no "\u2581" before "\n"
    r2 = c.say("What did Lily do?", **opts)
    ids = p1 + list(r1.token_ids) + new
    plain = m.generate(ids, **opts)
    assert r2.token_ids == plain.token_ids
    assert (r2.usage.prompt_tokens, r2.usage.cached_tokens) == (len(ids), len(p1) + len(r1.token_ids) - 1)
    warm = m.generate(ids, **opts)  # the default context holds ids' prefix now: the same count
    assert warm.usage.prompt_tokens == len(ids) and warm.token_ids == plain.token_ids


def test_penalties_of_the_reply_alone_follow_openai_s_formula(fp32):
    """penalize_prompt=False (the daemon's rule for OpenAI's frequency and presence penalties): each
    logit j is lowered by c[j] * frequency + (c[j] > 0) * presence, c[j] counting j in the reply so
    far only; hand-computed on the graph's logits of prompt + reply. The first token is then the
    unpenalised one (the default rule counts the prompt's words: here it changes the reply)."""
    from collections import Counter

    m = edgeinfer.load(fp32)
    prompt = m.tokenizer.encode("Lily and Ben went to the park. Lily and Ben")
    freq, pres, n = 0.7, 1.3, 24
    pen = dict(GREEDY, max_new_tokens=n, frequency_penalty=freq, presence_penalty=pres)
    got = list(m.generate(prompt, penalize_prompt=False, penalty_last_n=n, **pen).token_ids)
    reply: list[int] = []
    for _ in range(n):
        logits = m.engine.prefill(m.new_cache(), prompt + reply).astype(np.float64)
        for t, c in Counter(reply).items():
            logits[t] -= c * freq + pres
        reply.append(int(np.argmax(logits)))
    assert got == reply
    assert got[0] == m.generate(prompt, max_new_tokens=1, **GREEDY).token_ids[0]
    assert list(m.generate(prompt, **pen).token_ids) != got  # the prompt counted: another reply


def test_a_turn_refused_after_it_started_over_leaves_the_cache_as_it_was(fp32):
    """Under truncate, a turn that does not fit beside the history starts over; cancelled before its
    first graph call, it used to leave the cache emptied (the next turn re-prefilled the history
    from text, logprobs 0.1-0.2 off). Nothing was written: the cache is as before, row for row."""
    m = edgeinfer.load(fp32, capacity_tokens=64, overflow="truncate")
    a, b = m.conversation(), m.conversation()
    for c in (a, b):
        c.say("Lily had a red ball.", max_new_tokens=10, **GREEDY)
    _cancelled(a.stream_say("Who is Ben?", max_new_tokens=40, **GREEDY))  # does not fit beside: starts over
    _same_state(a, b)
    ra, rb = a.say("Why?", max_new_tokens=6, **GREEDY), b.say("Why?", max_new_tokens=6, **GREEDY)
    assert ra.token_ids == rb.token_ids and ra.usage == rb.usage
    _same_state(a, b)


def test_a_rolled_back_turn_keeps_a_pending_rebuild(fp32):
    """Under shift, a turn rolled back from a wrapped ring leaves a rebuild pending (the next turn
    feeds what the ring holds); a second turn cancelled before writing cleared it, so the next turn
    fed the whole history instead (80 of 120 next replies differed from a twin's)."""
    m = edgeinfer.load(fp32, capacity_tokens=64)
    a, b = m.conversation(), m.conversation()
    for c in (a, b):
        c.say("Tell me a story.", max_new_tokens=40, **GREEDY)
        g = c.stream_say("What happened next?", max_new_tokens=40, **GREEDY)
        for _ in range(30):
            next(g)
        g.close()  # wrapped: rolled back, rebuild pending
        assert c._rebuild
    _cancelled(a.stream_say("Hm.", max_new_tokens=40, **GREEDY))
    _same_state(a, b)
    ra, rb = a.say("Who is Ben?", max_new_tokens=40, **GREEDY), b.say("Who is Ben?", max_new_tokens=40, **GREEDY)
    assert ra.token_ids == rb.token_ids and ra.usage == rb.usage
    _same_state(a, b)


def test_a_first_turn_rolled_back_after_it_wrapped_is_retried_as_a_fresh_conversation(fp32):
    """A first turn whose own prompt wrapped the ring, abandoned, made the retry feed only the sinks
    and the tail of its prompt (38 of 55 retries differed from a fresh conversation's reply). With
    nothing before it there is nothing to rebuild: the retry starts as a fresh conversation."""
    m = edgeinfer.load(fp32, capacity_tokens=64)
    a = m.conversation()
    g = a.stream_say(LONG, max_new_tokens=20, **GREEDY)
    next(g)
    g.close()
    assert a.messages == [] and not a._rebuild
    fresh = m.conversation()
    ra, rf = a.say(LONG, max_new_tokens=20, **GREEDY), fresh.say(LONG, max_new_tokens=20, **GREEDY)
    assert ra.token_ids == rf.token_ids and ra.usage == rf.usage
    _same_state(a, fresh)


def _interrupt_call(monkeypatch, module, name: str, nth: int) -> list:
    """`module.name` raises KeyboardInterrupt at its nth call (as a Ctrl-C there would), once."""
    real, calls = getattr(module, name), []

    def wrapper(*args, **kwargs):
        calls.append(name)
        if len(calls) == nth:
            monkeypatch.setattr(module, name, real)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_a_ctrl_c_as_a_turn_s_steps_end_leaves_no_half_turn(fp32, monkeypatch):
    """A hostile round: a Ctrl-C as the steps' `finally` began (before it held Ctrl-C off) skipped
    the conversation's `end`: neither committed nor rolled back, the cache kept the turn's rows while
    the bookkeeping said it held the history only (8 of 2,000 real signals; every next reply then
    differed from a twin's). The next turn now undoes such a turn first."""
    import edgeinfer.generation as generation

    m = edgeinfer.load(fp32)
    opts = dict(GREEDY, max_new_tokens=8)
    a, b = m.conversation(), m.conversation()
    for c in (a, b):
        c.say("Lily had a red ball.", **opts)
    _interrupt_call(monkeypatch, generation, "interrupts_held", 2)  # 1: taking the lock; 2: the finally's
    with pytest.raises(KeyboardInterrupt):
        for _ in a.stream_say("Who is Ben?", **opts):
            pass
    assert a._open is not None  # the scenario: the turn's end never ran
    ra, rb = a.say("Why?", max_new_tokens=30, **GREEDY), b.say("Why?", max_new_tokens=30, **GREEDY)
    assert ra.token_ids == rb.token_ids and ra.usage == rb.usage
    _same_state(a, b)


def test_a_ctrl_c_inside_begin_after_the_cache_was_emptied_is_undone(fp32, monkeypatch):
    """A hostile round: a Ctrl-C between the start-over's `forget` and the bookkeeping's `_clear`
    left an empty cache whose bookkeeping said it held the history: the next turn fed only its new
    ids and reported them cached. A real Ctrl-C there now waits for the block's end (`interrupts_held`);
    an error raised inside it (injected here) is undone by the turn's own `end`."""
    import edgeinfer.conversation as conversation

    m = edgeinfer.load(fp32, capacity_tokens=64, overflow="truncate")
    a, b = m.conversation(), m.conversation()
    for c in (a, b):
        c.say("Lily had a red ball.", max_new_tokens=10, **GREEDY)
    calls = _interrupt_call(monkeypatch, conversation.Conversation, "_clear", 1)
    with pytest.raises(KeyboardInterrupt):
        next(a.stream_say("Who is Ben?", max_new_tokens=40, **GREEDY))  # does not fit beside: starts over
    assert calls == ["_clear"]  # the scenario: cut after the cache's forget, in begin
    ra, rb = a.say("Why?", max_new_tokens=30, **GREEDY), b.say("Why?", max_new_tokens=30, **GREEDY)
    assert ra.token_ids == rb.token_ids and ra.usage == rb.usage
    _same_state(a, b)


def test_drafts_in_a_long_conversation_come_from_what_the_ring_can_hold(fp32, monkeypatch):
    """A hostile round: with speculative="ngram", each turn indexed the whole conversation for its
    drafts (52 of a turn's 62 ms at turn 1,000 in a 64-token ring). The history given to the drafter
    is at most the ring's capacity before the turn's own ids."""
    import edgeinfer.generation as generation

    seen, real = [], generation.SpeculativeStepper
    monkeypatch.setattr(generation, "SpeculativeStepper",
                        lambda engine, inner, history, *a, **k: (seen.append(len(history)), real(engine, inner, history,
                                                                                                 *a, **k))[1])
    m = edgeinfer.load(fp32, capacity_tokens=64)
    c = m.conversation()
    for i in range(12):
        r = c.say(f"Turn {i}: and then?", max_new_tokens=16, speculative="ngram", **GREEDY)
    new_ids = r.usage.prompt_tokens - r.usage.cached_tokens  # the last turn's own ids (about 27 each turn)
    assert r.usage.cached_tokens > 400 and max(seen) <= 64 + new_ids + 2


def test_a_continued_conversation_feeds_what_a_fresh_one_renders_from_its_messages(fp32):
    """A hostile round: under the fallback template a reply generated after the cue "Assistant:"
    begins with a space (" Anna"), and the history rendered it "Assistant:  Anna" (two spaces),
    which the continued conversation's cache never held: its next turn gave other tokens than a
    fresh conversation given the same messages, in 5 of 10 dialogs. Now the two feed the same ids."""
    import random

    m = edgeinfer.load(fp32)
    rng = random.Random(4)
    asks = ["Tell me a story.", "And then?", "Who was there?", "What did Lily say?", "Why?", "The end."]
    for dialog in range(6):
        c = m.conversation()
        for turn in range(3):
            c.say(rng.choice(asks), max_new_tokens=rng.randrange(4, 16), temperature=0)
        assert c.messages[1]["content"][:1] == " " or dialog  # the case: a reply that begins with a space
        msgs = c.messages + [{"role": "user", "content": rng.choice(asks)}]
        held = list(c._held) + list(c._unfed)
        assert m.encode_chat(msgs)[:len(held)] == held
        a = c.say(msgs[-1]["content"], max_new_tokens=40, temperature=0)
        b = m.conversation().reply(msgs, max_new_tokens=40, temperature=0)
        assert a.token_ids == b.token_ids, dialog


@pytest.mark.parametrize("ended_by", ["eos", "stop", "length"])
def test_an_empty_reply_regenerated_is_the_reply_a_fresh_conversation_gives(fp32, ended_by):
    """Hostile round: regenerating a reply that was empty (EOS first, or a stop string at its start)
    with reply(messages[:-1]) was refused ("nothing new to say": the cache held that rendering whole)
    where a fresh conversation answered the same messages."""
    m = edgeinfer.load(fp32)
    said = "Lily had a red ball."
    if ended_by == "eos":
        empty = dict(logit_bias={m.tokenizer.eos_ids[0]: 1e6})
    elif ended_by == "length":  # a token with no text (BOS), not fed: the cache's unfed token (a review)
        empty = dict(logit_bias={m.tokenizer.bos_id: 1e6}, max_new_tokens=1)
    else:  # a stop string at the reply's very start
        empty = dict(stop=[m.conversation().say(said, **GREEDY, max_new_tokens=4).text[:3]])
    c = m.conversation()
    first = c.say(said, **{"temperature": 0, "max_new_tokens": 20, **empty})  # (EOS ends it: not GREEDY's ignore_eos)
    assert first.text == ""
    history = c.messages[:-1]
    again = c.reply(history, **GREEDY, max_new_tokens=20)
    fresh = m.conversation().reply(history, **GREEDY, max_new_tokens=20)
    assert again.token_ids == fresh.token_ids and again.text and c.messages == history + [
        {"role": "assistant", "content": again.text}]


def test_a_regenerated_or_edited_turn_keeps_the_turns_it_shares_and_replies_as_a_fresh_conversation(fp32):
    """A hostile round: `reply` with the last reply dropped (regenerate) or the last question edited
    started over and prefilled the whole history again, where its docstring says the prefix it shares
    with the cache is not. The cache now keeps the shared prefix (by the prefix cache's rules); here
    the replies, usage and later turns are a fresh conversation's (the kept rows came from decode steps:
    at a near-tie, which these prompts do not have, a reply may differ, as for the prefix cache)."""
    m = edgeinfer.load(fp32, capacity_tokens=480)
    c, twin = m.conversation(), m.conversation()
    for q in ("Tell me a story about a cat.", "And then what?", "Why?"):
        for x in (c, twin):
            x.say(q, max_new_tokens=20, **GREEDY)
    edits = [c.messages[:-1], c.messages[:-2] + [{"role": "user", "content": "What was its name?"}]]
    for msgs in edits:
        got = c.reply(msgs, max_new_tokens=20, **GREEDY)
        fresh = m.conversation().reply(msgs, max_new_tokens=20, **GREEDY)
        assert got.token_ids == fresh.token_ids
        assert got.usage.prompt_tokens == fresh.usage.prompt_tokens
        assert got.usage.prompt_tokens - 2 >= got.usage.cached_tokens > got.usage.prompt_tokens - 20
        assert c.messages == msgs + [{"role": "assistant", "content": got.text}]
    nxt = c.say("Where did it go?", max_new_tokens=20, **GREEDY)
    fresh = m.conversation().reply(c.messages[:-1], max_new_tokens=20, **GREEDY)
    assert nxt.token_ids == fresh.token_ids and nxt.usage.cached_tokens > 0


def test_a_kept_prefix_turn_rolled_back_leaves_the_cache_as_it_was_or_rebuilds_it(fp32, monkeypatch):
    """The rollback of an edited turn: cancelled inside `begin` (the cache cut to the kept prefix, no
    row written yet: the prefill's first chunk refuses), the cache (rows and bookkeeping) is as before
    the turn; closed half-way (rows written past the kept prefix), the next turn rebuilds, and
    replies as a twin that never tried."""
    m = edgeinfer.load(fp32, capacity_tokens=480)
    a, b = m.conversation(), m.conversation()
    for x in (a, b):
        x.say("Tell me a story about a dog.", max_new_tokens=20, **GREEDY)
        x.say("What did it eat?", max_new_tokens=20, **GREEDY)
    edited = a.messages[:-2] + [{"role": "user", "content": "Was it big?"}]
    opts = edgeinfer.GenerationOptions.from_kwargs(max_new_tokens=20, **GREEDY)
    g = a._turn(edited, None, opts)  # `reply`'s turn as a stream (`reply` runs it to its end)
    render, cut = m.template.render, []

    def cancelled_while_rendering(*args, **kwargs):  # a client gone while `begin` runs
        g.cancel()
        return render(*args, **kwargs)

    real_forget = a.cache.forget
    monkeypatch.setattr(a.cache, "forget", lambda keep=0: cut.append(keep) or real_forget(keep))
    monkeypatch.setattr(m.template, "render", cancelled_while_rendering)
    with pytest.raises(GenerationCancelled):
        next(g)
    monkeypatch.undo()
    assert cut and cut[0] > 0  # the turn did cut the cache to a kept prefix, then was undone
    _same_state(a, b)
    g = a._turn(edited, None, opts)
    for _ in range(5):
        next(g)
    g.close()
    assert a.messages == b.messages
    ra, rb = a.say("Why?", max_new_tokens=20, **GREEDY), b.say("Why?", max_new_tokens=20, **GREEDY)
    assert ra.token_ids == rb.token_ids and ra.usage.prompt_tokens == rb.usage.prompt_tokens

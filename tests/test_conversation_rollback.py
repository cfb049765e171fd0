"""A Conversation's history and cache always agree: a refused, failed or abandoned turn is rolled
back; `truncate` drops only the oldest tokens after the sinks, and a truncating Conversation keeps
answering. The reference for "agree" is a fresh conversation replaying the same history from scratch."""

from __future__ import annotations

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX
from edgeinfer.overflow import fit_prompt

OPTS = dict(temperature=0, max_new_tokens=10)
STORY = (STORIES_FIX / "eval.txt").read_text().splitlines()[0]


def replay(model, history: list[dict], content: str) -> str:
    """The reply a fresh conversation gives to `history` + a user turn (whole rendering prefilled)."""
    return model.conversation().reply(history + [{"role": "user", "content": content}], **OPTS).text


def test_refused_turn_leaves_no_trace():
    m = edgeinfer.load(capacity_tokens=64, overflow="error")
    conv = m.conversation()
    conv.say("Lily had a ball.", **OPTS)
    history, n_valid = list(conv.messages), conv.cache.n_valid
    with pytest.raises(edgeinfer.ContextOverflowError):
        conv.say(STORY, **OPTS)  # far too long for the ring: refused
    assert conv.messages == history and conv.cache.n_valid == n_valid
    reply = conv.say("Then what?", **OPTS).text  # the conversation goes on
    assert reply == replay(m, history, "Then what?")


@pytest.mark.parametrize("capacity", [512, 40])  # 40: the abandoned turn wraps the ring (no cheap rewind)
def test_abandoned_stream_is_rolled_back(capacity):
    m = edgeinfer.load(capacity_tokens=capacity)
    conv = m.conversation()
    conv.say("Lily had a ball.", **OPTS)
    history = list(conv.messages)
    s = conv.stream_say("Tell me a long story about a cat.", temperature=0, max_new_tokens=200, ignore_eos=True)
    for _ in range(30):
        next(s)
    s.close()  # abandoned half-way
    assert conv.messages == history
    assert conv.cache.n_valid <= capacity and conv.cache.intact
    reply = conv.say("Then what?", **OPTS).text
    assert reply == replay(m, history, "Then what?")


def test_failing_turn_is_rolled_back(monkeypatch):
    m = edgeinfer.load()
    conv = m.conversation()
    conv.say("Lily had a ball.", **OPTS)
    history, n_valid = list(conv.messages), conv.cache.n_valid
    real, calls = m.engine.decode_one, {"n": 0}

    def failing(cache, token):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of a reply
        return real(cache, token)

    monkeypatch.setattr(m.engine, "decode_one", failing)
    with pytest.raises(KeyboardInterrupt):
        conv.say("Then what?", **OPTS)
    monkeypatch.setattr(m.engine, "decode_one", real)
    assert conv.messages == history and conv.cache.n_valid == n_valid
    assert conv.say("Then what?", **OPTS).text == replay(m, history, "Then what?")


def test_cut_mutation_makes_the_cache_start_over(monkeypatch):
    """Ctrl-C inside the ring's bookkeeping leaves it half-moved: the next turn must not trust it."""
    m = edgeinfer.load(capacity_tokens=40)
    conv = m.conversation()
    conv.say("Lily had a ball.", **OPTS)
    history = list(conv.messages)
    real = type(conv.cache).commit

    def cut(self, s):
        if self.full:
            self.intact = False
            raise KeyboardInterrupt
        return real(self, s)

    monkeypatch.setattr(type(conv.cache), "commit", cut)
    with pytest.raises(KeyboardInterrupt):
        conv.say("Tell me a long story about a cat.", temperature=0, max_new_tokens=100, ignore_eos=True)
    monkeypatch.setattr(type(conv.cache), "commit", real)
    assert conv.messages == history
    assert conv.say("Then what?", **OPTS).text == replay(m, history, "Then what?")


def test_truncate_keeps_sinks_and_drops_only_what_is_needed():
    m = edgeinfer.load(capacity_tokens=32, n_sink=4, overflow="truncate")
    ids = m.tokenizer.encode(STORY)[:60]
    kept, dropped = fit_prompt(m.new_cache(), ids, "truncate", 10_000)  # a huge max_new_tokens
    assert kept == ids[:4] + ids[-12:] and dropped == 44  # half the ring kept for the reply, BOS kept
    kept, dropped = fit_prompt(m.new_cache(), ids[:20], "truncate", 8)
    assert kept == ids[:20] and dropped == 0  # fits with room for the reply: nothing dropped
    kept, dropped = fit_prompt(m.new_cache(), ids[:30], "truncate", 8)
    assert kept == ids[:4] + ids[30 - 20:30] and dropped == 6  # exactly as many as needed
    c = m.generate(ids, temperature=0, max_new_tokens=10_000, ignore_eos=True)
    # 16 prompt slots + 16 generated tokens fill the ring; the 17th is sampled from the full ring
    assert c.usage.dropped_tokens == 44 and len(c.token_ids) == 17 and c.finish_reason == "length"


def test_truncating_conversation_keeps_answering():
    m = edgeinfer.load(capacity_tokens=64, n_sink=4, overflow="truncate")
    conv = m.conversation()
    for i, content in enumerate(["Lily had a ball.", "Tell me about the dog and the cat in the park.",
                                 "What did the bird say to the dog?", "Where did they go after that day?"]):
        c = conv.say(content, temperature=0, max_new_tokens=24)
        assert len(c.token_ids) >= 1 and conv.messages[-2]["content"] == content
        # the new user turn itself was fed, not cut to its last token
        fed = c.usage.prompt_tokens - c.usage.dropped_tokens
        assert fed >= len(m.tokenizer.encode(content, add_bos=False))
    assert len(conv.messages) == 8 and c.usage.dropped_tokens > 0  # the ring did fill up
    assert conv.cache.n_valid <= 64


def test_numpy_ids_through_a_conversation_free_path():
    m = edgeinfer.load()
    ids = np.array(m.tokenizer.encode("Once upon a time"), np.int32)
    assert m.generate(ids, **OPTS).token_ids == m.generate(ids.tolist(), **OPTS).token_ids


def test_the_turn_after_a_rollback_in_a_wrapped_ring_feeds_only_what_the_ring_holds():
    """After 60 turns in a 64-token ring, an abandoned turn cannot be rewound (it evicted older
    tokens), so the next turn rebuilt the cache by feeding the whole history through the ring:
    2,600 tokens here, 17,539 after 400 turns, growing with the conversation. Now it feeds the
    history's first n_sink tokens and its last capacity - n_sink (what a full refeed leaves in the
    ring), counting the rest as dropped; the history is rolled back exactly."""
    m = edgeinfer.load(capacity_tokens=64, n_sink=4)
    conv = m.conversation()
    for i in range(60):
        conv.say(f"Turn {i}: and then?", temperature=0, max_new_tokens=16)
    history = list(conv.messages)
    s = conv.stream_say("Something else entirely.", temperature=0, max_new_tokens=20, ignore_eos=True)
    for _ in range(3):
        next(s)
    s.close()
    assert conv.messages == history
    fed, forward = [], m.engine.forward
    m.engine.forward = lambda cache, ids, *a, **k: fed.append(len(ids)) or forward(cache, ids, *a, **k)
    r = conv.say("What did the dog do?", temperature=0, max_new_tokens=8, ignore_eos=True)
    rendered = m.encode_rendered(m.template.render(history + [{"role": "user", "content": "What did the dog do?"}],
                                                   add_generation_prompt=True))
    assert len(rendered) > 1000 and sum(fed) == 64 + 7  # the ring's worth, then 7 decode steps
    assert r.usage.prompt_tokens == len(rendered) and r.usage.dropped_tokens >= len(rendered) - 64
    assert conv.messages[:-1] == history + [{"role": "user", "content": "What did the dog do?"}]
    again = conv.say("Then what?", temperature=0, max_new_tokens=8)  # and the conversation goes on, cheaply
    fed = again.usage.prompt_tokens - again.usage.cached_tokens  # the whole conversation, less what earlier turns fed
    assert fed < 64 and again.usage.cached_tokens == len(rendered) + 7 and again.finish_reason in ("length", "eos")

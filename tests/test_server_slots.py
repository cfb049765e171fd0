"""Which slot a daemon request takes (`scheduler.choose_slot`): the slot whose cache it continues,
else an empty or the least recently used one, never a long cache it shares only a start token or a
default system prompt with while empty slots stand idle (the hostile tester's slot-stealing defect).

Three levels: the rule alone on bare slots; the Scheduler with real rings and jobs; the server end
to end through the official `openai` client."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

import edgeinfer
from edgeinfer.context_lock import ContextBusyError
from edgeinfer.options import GenerationOptions
from edgeinfer.server.config import ServeConfig
from edgeinfer.server.scheduler import Job, Scheduler, Slot, choose_slot
from test_server import Running

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big red ball. She wanted to play with it. ")
SYSTEM = list(range(100, 124))  # 24 tokens every chat starts with (a template's default system prompt)


def _slots(*held, last_used: tuple[int, ...] | None = None) -> list[Slot]:
    """Slots holding `held[i]`: None, or (prompt, reply) of the request that filled it."""
    return [Slot(i, cache=None, ids=None if h is None else h[0] + h[1], last_used=(last_used or (0,) * len(held))[i],
                 prompt_tokens=0 if h is None else len(h[0])) for i, h in enumerate(held)]


# --- the rule ------------------------------------------------------------------------------------------------

def test_a_prompt_sharing_only_the_start_token_takes_an_empty_slot_not_a_long_cache():
    """The tester's repro: "Hello" shared BOS with a 155-token cached prompt and took its slot over
    three empty ones (its longest prefix, 1, beat their 0)."""
    long_prompt = [1] + list(range(10, 164))
    free = _slots((long_prompt, [7, 7, 7]), None, None, None, last_used=(1, 0, 0, 0))
    assert choose_slot(free, [1, 346, 306, 414]).index == 1
    assert choose_slot(free, long_prompt).index == 0  # the same prompt again continues its cache


def test_a_first_chat_turn_sharing_only_the_system_prompt_leaves_another_conversation_alone():
    """User 2's "Hi!" shares the 24-token system prompt with user 1's conversation; it takes an empty
    slot, and user 1's next turn finds its conversation."""
    turn1, reply1 = SYSTEM + list(range(200, 230)), list(range(230, 480))
    free = _slots((turn1, reply1), None, None, None, last_used=(3, 0, 0, 0))
    assert choose_slot(free, SYSTEM + [5, 6, 7, 8, 9, 10, 11, 12]).index == 1
    assert choose_slot(free, turn1 + reply1 + [9, 9, 9]).index == 0


def test_two_users_sharing_a_long_system_prompt_keep_a_slot_each():
    """A hostile round on the first version of the rule (a prefix of half what the slot holds): with a
    425-token system prompt, the other user's turn shared more than half of a short conversation, so
    both users kept taking one slot, each re-prefilling its history, and the other slot stayed empty."""
    system = list(range(1000, 1425))
    u1 = (system + [1, 2, 3], [4, 5, 6, 7])
    u2_turn1 = system + [8, 9]
    free = _slots(u1, None, last_used=(1, 0))
    assert choose_slot(free, u2_turn1).index == 1
    both = _slots(u1, (u2_turn1, [10, 11]), last_used=(1, 2))
    assert choose_slot(both, u1[0] + u1[1] + [20, 21]).index == 0
    assert choose_slot(both, u2_turn1 + [10, 11] + [22, 23]).index == 1
    assert choose_slot(both, system + [30, 31]).index == 0  # a third user: both keep the system prompt; LRU


def test_a_retry_after_a_long_reply_takes_the_slot_that_holds_its_prompt():
    """A hostile round: a 755-token prompt with an 800-token reply, sent again, was prefilled cold in an
    empty slot (it shared less than half of what its slot held)."""
    prompt = [1] + list(range(10, 764))
    free = _slots((prompt, list(range(2000, 2800))), None, last_used=(1, 0))
    assert choose_slot(free, prompt).index == 0


def test_a_template_that_renders_its_generation_cue_otherwise_after_a_reply_still_continues_its_slot():
    """A review: DeepSeek-R1's cue "<｜Assistant｜><think>\n" comes back in the history as "<｜Assistant｜>"
    and the reply, so the last prompt is never whole in the next one: every second turn took an empty
    slot, cold. A prompt that ended with the template's cue (`generation_cue`) may lose it."""
    assistant, think, newline = 900, 901, 902
    history = SYSTEM + [1, 2, 3]
    free = _slots((history + [assistant, think, newline], [40, 41, 42]), None, last_used=(1, 0))
    nxt = history + [assistant, 40, 41, 42, 7, 8, 9]
    cue = (assistant, think, newline)
    assert choose_slot(free, nxt).index == 1  # without the cue: the empty slot
    assert choose_slot(free, nxt, cue=cue).index == 0
    assert choose_slot(free, SYSTEM + [5, 6, 7, 8], cue=cue).index == 1  # another user's turn still does not
    plain = _slots((history + [7, 8, 9], [40]), None, last_used=(1, 0))  # a prompt that did not end with the cue
    assert choose_slot(plain, history + [7, 8, 10], cue=cue).index == 1


def test_the_cue_is_what_a_chat_prompt_ends_with(model):
    """A review: encoded alone, the cue began with SentencePiece's leading-space piece, which no prompt
    ends with, so the slack never applied on such a model."""
    from edgeinfer.server.scheduler import generation_cue

    cue = generation_cue(model)
    prompt = model.encode_chat([{"role": "user", "content": "Tell me a story about a dog."}])
    assert len(cue) >= 2 and tuple(prompt[-len(cue):]) == cue


def test_without_an_empty_slot_the_one_keeping_most_then_the_least_recently_used_is_taken():
    a, b, c = [1] + list(range(10, 60)), [1] + list(range(60, 110)), [1] + list(range(110, 160))
    assert choose_slot(_slots((a, []), (b, []), (c, []), last_used=(7, 3, 9)), [1, 5, 5]).index == 1
    assert choose_slot(_slots((a, []), None, (c, []), last_used=(7, 9, 1)), [1, 5, 5]).index == 1  # an empty one
    assert choose_slot(_slots(None, None, None), [1, 5]).index == 0
    free = _slots((a, []), (b, []), (c, []), last_used=(7, 3, 9))
    assert choose_slot(free, a[:20] + [5, 5]).index == 0  # keeps 20: more than the others' 1
    assert [choose_slot(free, [1, 5, 5]).index for _ in range(3)] == [1, 1, 1]  # deterministic


# --- the Scheduler with real rings ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return edgeinfer.load()


def _serve(sched: Scheduler, prompt: list[int], max_new_tokens: int = 5) -> int:
    """Run one request through `sched` in this thread (as a worker would); returns its cached tokens."""
    loop = asyncio.new_event_loop()
    try:
        job = Job(sched, sched.admit(), prompt, GenerationOptions(max_new_tokens=max_new_tokens, ignore_eos=True),
                  None, loop)
        job.run()
        end = loop.run_until_complete(_last_event(job))
    finally:
        loop.close()
    assert end[0] == "done", end
    return end[2]


async def _last_event(job: Job):
    while True:
        event = await job.events.get()
        if event[0] != "chunk":
            return event


def test_scheduler_keeps_a_long_cached_prompt_while_empty_slots_serve_unrelated_requests(model):
    """The tester's numbers, on the scheduler: a 155-token prompt, cached 153 on a repeat, was
    cached 1 after an unrelated "Hello" took its slot; now 153 again."""
    sched = Scheduler(model, slots=4, queue=4)
    long_prompt = model.encode_prompt(STORY * 3)
    assert _serve(sched, long_prompt) == 0
    assert _serve(sched, long_prompt) == len(long_prompt) - 2
    assert _serve(sched, model.encode_prompt("Hello")) == 0
    assert _serve(sched, model.encode_prompt("The dog barked")) == 0  # another unrelated one: a third slot
    assert _serve(sched, long_prompt) == len(long_prompt) - 2
    assert sched.busy == 0 and sched.waiting == 0


def test_a_prompt_longer_than_the_ring_does_not_take_a_cache_it_could_not_keep(model):
    """A review found the rule read the raw common prefix: a 681-token prompt (the ring holds 480)
    sharing a 200-token system prompt with a cached conversation took its slot, kept nothing (a prompt
    longer than the ring is fed whole), and the conversation's next turn was cached 0 with the other
    slot empty. The rule now counts what `reuse` would keep."""
    sched = Scheduler(model, slots=2, queue=2)
    system = list(range(100, 300))
    convo = [1] + system + list(range(300, 400))
    assert _serve(sched, convo) == 0 and _serve(sched, convo) == len(convo) - 2
    assert _serve(sched, [1] + system + list(range(10, 10 + model.capacity_tokens))) == 0
    assert _serve(sched, convo) == len(convo) - 2


# --- end to end ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_slots(model):
    r = Running(ServeConfig(slots=4, queue=4, max_tokens_limit=64), model=model)
    yield r
    r.stop()


def _cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def test_an_unrelated_completion_does_not_take_a_cached_prompts_slot(four_slots):
    cl, name = four_slots.client(key=None), "stories260K-int8"
    long_prompt = STORY * 3
    cl.completions.create(model=name, prompt=long_prompt, max_tokens=5, temperature=0)
    again = cl.completions.create(model=name, prompt=long_prompt, max_tokens=5, temperature=0)
    assert _cached(again) == again.usage.prompt_tokens - 2
    assert _cached(cl.completions.create(model=name, prompt="Hello", max_tokens=5, temperature=0)) == 0
    last = cl.completions.create(model=name, prompt=long_prompt, max_tokens=5, temperature=0)
    assert _cached(last) == last.usage.prompt_tokens - 2


def test_a_second_users_first_chat_turn_does_not_take_the_first_users_conversation(four_slots):
    """Both users' chats start with the same system prompt; user 2's "Hi!" used to take user 1's slot,
    so user 1's turn 3 prefilled its whole history with every slot idle."""
    cl, name = four_slots.client(key=None), "stories260K-int8"
    system = {"role": "system", "content": "You are Lily, a kind helper who tells short stories to children."}
    hist = [system, {"role": "user", "content": "Here are my notes: " + "Lily went to the park with her ball. " * 12}]
    r = cl.chat.completions.create(model=name, messages=hist, max_tokens=20, temperature=0)
    hist += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "Summarise."}]
    turn2 = cl.chat.completions.create(model=name, messages=hist, max_tokens=5, temperature=0)
    assert _cached(turn2) > 100
    hist += [{"role": "assistant", "content": turn2.choices[0].message.content},
             {"role": "user", "content": "Shorter."}]
    hi = cl.chat.completions.create(model=name, messages=[system, {"role": "user", "content": "Hi!"}], max_tokens=5,
                                    temperature=0)
    assert _cached(hi) == 0  # an empty slot
    turn3 = cl.chat.completions.create(model=name, messages=hist, max_tokens=5, temperature=0)
    assert _cached(turn3) >= turn2.usage.prompt_tokens


@pytest.mark.parametrize("slots", [1, 2])
def test_a_server_takes_the_models_default_ring_and_generate_is_then_refused_not_wrong(slots):
    """A hostile round: a program that served requests through a Model and then called its
    `generate` got another text ("All the cats liked"): the server used the default ring as its slot 0
    (the model still believed it held its last prompt), and the two could write one ring at once. The
    default context is now the server's: generate, a stream made before, snapshot and restore are
    refused naming it; conversations (their own rings) answer as on a fresh model; a second server
    on the model gets rings of its own."""
    m = edgeinfer.load()
    early = m.stream("Once upon a time", max_new_tokens=3)
    sched = Scheduler(m, slots=slots, queue=1)
    _serve(sched, m.encode_prompt("The dog barked at the"), max_new_tokens=20)
    for call in (lambda: m.generate("Once upon a time", max_new_tokens=3), lambda: next(early),
                 lambda: m.snapshot("Once"), lambda: m.stream("Hi").run_to_end()):
        with pytest.raises(ContextBusyError, match="belongs to a server: use model.conversation"):
            call()
    messages = [{"role": "user", "content": "Lily had a ball."}]
    want = edgeinfer.load().chat(messages, max_new_tokens=12, ignore_eos=True, temperature=0).text
    assert m.chat(messages, max_new_tokens=12, ignore_eos=True, temperature=0).text == want
    second = Scheduler(m, slots=1, queue=1)
    assert all(s.cache is not t.cache for s in sched.slots for t in second.slots)
    assert _serve(second, m.encode_prompt("The dog barked at the")) == 0  # nothing cached: a ring of its own


def test_a_server_that_cannot_start_leaves_the_model_as_it_was():
    """A review: the ring was lent before the other slots were allocated, so a slot count refused for
    memory left the model lent to no server (generate refused for good, a batch's ring freed)."""
    from edgeinfer.errors import InvalidArgumentError

    m = edgeinfer.load()
    with pytest.raises(InvalidArgumentError, match="KV cache"):
        Scheduler(m, slots=10 ** 7, queue=1)
    want = edgeinfer.load().generate("Once upon a time", max_new_tokens=8, temperature=0).text
    assert m.generate("Once upon a time", max_new_tokens=8, temperature=0).text == want


def test_two_servers_built_at_once_each_get_a_ring():
    """A review: the second of two Schedulers waiting for a stream's turn found the ring lent by the
    first and was refused, where a second server gets a ring of its own."""
    import threading

    m = edgeinfer.load()
    stream = m.stream("Once upon a time", max_new_tokens=3)
    next(stream)  # holds the default context until it is closed
    got = {}

    def build(name):
        try:
            got[name] = Scheduler(m, slots=1, queue=1)
        except Exception as e:  # noqa: BLE001 (the test reports it)
            got[name] = e

    threads = [threading.Thread(target=build, args=(n,)) for n in "AB"]
    for t in threads:
        t.start()
    time.sleep(0.3)  # both wait for the stream's turn
    stream.close()
    for t in threads:
        t.join(timeout=30)
    assert all(isinstance(s, Scheduler) for s in got.values()), got
    assert got["A"].slots[0].cache is not got["B"].slots[0].cache


def test_a_ctrl_c_while_the_ring_is_lent_leaves_it_lent_or_not_never_a_closed_model():
    """A review: a Ctrl-C between the two stores (the ring let go, the owner not yet named) left an
    open model that every call said was closed. The Ctrl-C comes here right after the first store."""
    import sys

    m = edgeinfer.load()
    sent = []

    def trace(frame, event, arg):
        if frame.f_code.co_name != "lend_default_cache":
            return None
        if event == "line" and not sent and (m.cache is None or m.lent_to is not None):  # one store made
            sent.append(frame.f_lineno)
            signal.raise_signal(signal.SIGINT)
        return trace

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored in tests started in the background)
    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            m.lend_default_cache("a server")
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGINT, before)
    assert sent and not m.closed
    with pytest.raises(ContextBusyError, match="belongs to a server"):
        m.generate("Once", max_new_tokens=2)


def test_a_rings_memory_is_taken_when_it_is_committed_not_at_its_first_long_prompt():
    """np.zeros only reserves pages: a server's resident memory grew by its slots' KV under the first
    burst of long requests, past what its start showed (a hostile round). `commit_memory` writes every
    row; here a ring of 135 MB in a larger geometry of the bundled model's, measured by RSS in a fresh
    process (in this one, memory earlier tests freed and the allocator kept may come back resident)."""
    import json
    import subprocess
    import sys

    code = """if True:
        import dataclasses, json, psutil, edgeinfer
        from edgeinfer.kv_cache import RingKVCache
        m = edgeinfer.load()
        spec = dataclasses.replace(m.manifest.arch, num_layers=32, max_position_embeddings=8192)
        rss = lambda: psutil.Process().memory_info().rss
        r0 = rss(); ring = RingKVCache(spec, 8000, 4, 256, m.engine.mode); r1 = rss()
        ring.commit_memory(); r2 = rss()
        print(json.dumps({"alloc": r1 - r0, "commit": r2 - r1, "bytes": ring.bytes, "empty": ring.n_valid == 0
                          and not any(a.any() for a in ring.k + ring.v)}))
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    b = got["bytes"]
    assert b > 120e6 and got["alloc"] < 0.2 * b and got["commit"] > 0.9 * b, got
    assert got["empty"]


@pytest.mark.parametrize("slots", [1, 3])
def test_a_scheduler_commits_every_slots_ring_at_start(monkeypatch, slots):
    from edgeinfer.kv_cache import RingKVCache

    committed = []
    real = RingKVCache.commit_memory
    monkeypatch.setattr(RingKVCache, "commit_memory", lambda self: (committed.append(self), real(self))[1])
    m = edgeinfer.load()
    sched = Scheduler(m, slots=slots, queue=1)
    assert [id(c) for c in committed] == [id(s.cache) for s in sched.slots]

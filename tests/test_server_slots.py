"""Which slot a daemon request takes (`scheduler.choose_slot`): the slot whose cache it continues,
else an empty or the least recently used one, never a long cache it shares only a start token or a
default system prompt with while empty slots stand idle (the hostile tester's slot-stealing defect).

Three levels: the rule alone on bare slots; the Scheduler with real rings and jobs; the server end
to end through the official `openai` client."""

from __future__ import annotations

import asyncio

import pytest

import edgeinfer
from edgeinfer.options import GenerationOptions
from edgeinfer.server.config import ServeConfig
from edgeinfer.server.scheduler import REUSE_MIN_SHARE, Job, Scheduler, Slot, choose_slot
from test_server import Running

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big red ball. She wanted to play with it. ")
SYSTEM = list(range(100, 124))  # 24 tokens every chat starts with (a template's default system prompt)


def _slots(*held: list[int] | None, last_used: tuple[int, ...] | None = None) -> list[Slot]:
    return [Slot(i, cache=None, ids=ids, last_used=(last_used or (0,) * len(held))[i]) for i, ids in enumerate(held)]


# --- the rule ------------------------------------------------------------------------------------------------

def test_a_prompt_sharing_only_the_start_token_takes_an_empty_slot_not_a_long_cache():
    """The tester's repro: "Hello" shared BOS with a 155-token cached prompt and took its slot over
    three empty ones (its longest prefix, 1, beat their 0)."""
    long_prompt = [1] + list(range(10, 164))
    free = _slots(long_prompt + [7, 7, 7], None, None, None, last_used=(1, 0, 0, 0))
    assert choose_slot(free, [1, 346, 306, 414]).index == 1
    assert choose_slot(free, long_prompt).index == 0  # the same prompt again continues its cache


def test_a_first_chat_turn_sharing_only_the_system_prompt_leaves_another_conversation_alone():
    """User 2's "Hi!" shares the 24-token system prompt with user 1's 400-token conversation (75 % of
    its own prompt: the llama.cpp rule's share would take that slot); it takes an empty slot, and
    user 1's next turn finds its conversation."""
    convo = SYSTEM + list(range(200, 480))
    free = _slots(convo, None, None, None, last_used=(3, 0, 0, 0))
    hi = SYSTEM + [5, 6, 7, 8, 9, 10, 11, 12]
    assert choose_slot(free, hi).index == 1
    assert choose_slot(free, convo + [9, 9, 9]).index == 0


def test_a_shared_prefix_is_reused_when_it_is_most_of_what_the_slot_holds():
    """A slot that holds the system prompt and a short exchange is taken by a new chat with that
    system prompt (it keeps more than it throws away); the longest such prefix wins, then the slot
    holding the fewest tokens."""
    short = SYSTEM + [1, 2, 3, 4]
    free = _slots(None, short, SYSTEM + [1, 2] + list(range(300, 340)), last_used=(0, 5, 4))
    assert choose_slot(free, SYSTEM + [1, 2, 9]).index == 1  # 26 of 28 held (slot 2: 26 of 66)
    same = _slots(None, SYSTEM + [1, 2, 3], SYSTEM + [1, 2], last_used=(0, 1, 2))
    assert choose_slot(same, SYSTEM + [1, 2, 9, 9]).index == 2  # 26 each: slot 2 throws nothing away
    n = len(SYSTEM)
    edge = _slots(None, SYSTEM + list(range(300, 300 + int(n / REUSE_MIN_SHARE) - n)))
    assert choose_slot(edge, SYSTEM + [9]).index == 1  # exactly REUSE_MIN_SHARE of what it holds


def test_without_an_empty_slot_the_least_recently_used_is_taken_and_ties_go_by_index():
    a, b, c = [1] + list(range(10, 60)), [1] + list(range(60, 110)), [1] + list(range(110, 160))
    assert choose_slot(_slots(a, b, c, last_used=(7, 3, 9)), [1, 5, 5]).index == 1
    assert choose_slot(_slots(a, None, c, last_used=(7, 9, 1)), [1, 5, 5]).index == 1  # an emptied slot first
    assert choose_slot(_slots(None, None, None), [1, 5]).index == 0
    free = _slots(a, b, c, last_used=(7, 3, 9))
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

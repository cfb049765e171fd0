"""What happens when a context does not fit its ring: the policy, the prompt fitting, the capacity.

Policies (`OVERFLOW_POLICIES`), chosen at load:
  shift     everything goes in; the ring forgets its oldest tokens after the sinks, for ever, in
            constant memory (the default: chats, streams, a daemon left running);
  truncate  the oldest prompt tokens after the sinks are dropped up front, exactly as many as
            needed, reported in `usage.dropped_tokens`; generation stops when the ring is full;
  error     a prompt that does not fit raises `ContextOverflowError` with the counts; generation
            stops when the ring is full.
Never silent: every dropped token is counted. The ring itself (`kv_cache.RingKVCache`) is the only
validator of its own geometry (capacity, sinks, chunk, memory).
"""

from __future__ import annotations

from edgeinfer.arch import ArchSpec
from edgeinfer.errors import EdgeInferError, InvalidArgumentError
from edgeinfer.kv_cache import binding_window, max_capacity

OVERFLOW_POLICIES = ("shift", "truncate", "error")
DEFAULT_PREFILL_CHUNK = 256  # `load`'s tokens per prefill call: also the overflow rows its ring allocates


class ContextOverflowError(EdgeInferError, ValueError):
    """The prompt does not fit the ring's free slots under overflow="error" (a reply that then fills
    the ring ends there with finish_reason "length", as under "truncate": only "shift" runs on).
    `counts`: what did not fit, without the remedy the message adds (a server names its own flags)."""

    def __init__(self, counts: str, remedy: str = "overflow='error'; use 'shift' or 'truncate', or a larger "
                                                  "capacity_tokens"):
        super().__init__(f"{counts} ({remedy})")
        self.counts, self.remedy = counts, remedy

    def __reduce__(self):  # copy and pickle rebuild it from its parts: from `args` (the whole message) the remedy
        return type(self), (self.counts, self.remedy), self.__dict__  # came twice, and a stream copies its error


def check_policy(overflow) -> str:
    if not isinstance(overflow, str) or overflow not in OVERFLOW_POLICIES:
        raise InvalidArgumentError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
    return overflow


def resolve_capacity(default_capacity_tokens: int, spec: ArchSpec, requested: int | None,
                     device_capacity_tokens: int | None = None) -> int:
    """The ring's capacity: what the caller asked for (an int >= 2; more than the trained length T, or
    a binding sliding window's W - 1, is refused by `RingKVCache.check_geometry`), else the manifest's
    default capped at the device profile's (`platforms.Profile.capacity_tokens`, when given), at
    `kv_cache.max_capacity` (T less a sixteenth, the room a full ring re-bases in) and at W - 1 (a
    query of such a model attends to W tokens, itself among them: `binding_window`)."""
    if requested is None:
        if device_capacity_tokens is not None:  # a Pi 4's 1024, not the model's 4096 (4x the KV memory)
            default_capacity_tokens = min(default_capacity_tokens, device_capacity_tokens)
        cap = min(default_capacity_tokens, max_capacity(spec.max_position_embeddings))
        window = binding_window(spec)
        return min(cap, window - 1) if window else cap
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 2:
        raise InvalidArgumentError(f"capacity_tokens must be an integer >= 2, got {requested!r}")
    return requested


DEFAULT_SINKS = 4  # attention sinks (StreamingLLM): the first tokens a full ring keeps in view


def resolve_sinks(spec: ArchSpec, requested: int | None) -> int:
    """The ring's attention sinks: what the caller asked for (checked by `RingKVCache.check_geometry`),
    else `DEFAULT_SINKS`, or none for a model whose sliding window binds (it attends to its last W
    tokens only: sinks would keep older ones in view)."""
    if requested is not None:
        return requested
    return 0 if binding_window(spec) else DEFAULT_SINKS


def rebase_warning(capacity_tokens: int, max_position_embeddings: int) -> str | None:
    """What to tell a caller whose ring leaves less than a sixteenth of the trained length to re-base
    in (None otherwise): a full ring then rotates every cached key every few tokens."""
    most = max_capacity(max_position_embeddings)
    if capacity_tokens <= most or capacity_tokens > max_position_embeddings:
        return None
    every = max(1, max_position_embeddings - capacity_tokens)
    return (f"capacity_tokens={capacity_tokens} leaves {max_position_embeddings - capacity_tokens} of the model's "
            f"{max_position_embeddings} trained positions to re-base in: once full, the ring rotates every cached "
            f"key every {every} token{'s' if every > 1 else ''} (a capacity of {most} or less does it every "
            f"{max_position_embeddings - most} or more)")


def truncate_reserve(capacity_tokens: int, max_new_tokens: int) -> int:
    """Slots `truncate` keeps free for the reply: max_new_tokens, but at most half the ring (a huge
    max_new_tokens must not cut the prompt to nothing; the reply then ends "length" when the ring is full)."""
    return min(max_new_tokens, capacity_tokens // 2)


def fits_beside(cached_tokens: int, new_tokens: int, capacity_tokens: int, overflow: str, max_new_tokens: int) -> bool:
    """Whether `new_tokens` may be fed after `cached_tokens` the ring already holds (a conversation's
    history, a reused prefix) without the policy having to see those: always, except under
    `truncate` when they would not fit with the reply's reserve; then the caller must feed the whole
    prompt from an empty ring, so that truncation drops its oldest tokens, not the new ones."""
    return overflow != "truncate" or (
        cached_tokens + new_tokens + truncate_reserve(capacity_tokens, max_new_tokens) <= capacity_tokens)


def fit_prompt(cache, ids: list[int], overflow: str, max_new_tokens: int) -> tuple[list[int], int]:
    """Apply the overflow policy to a prompt about to enter `cache`; returns (ids to feed, dropped count).

    shift: everything goes in (the ring forgets its oldest tokens after the sinks as it must).
    error: the prompt must fit the free slots, else ContextOverflowError stating the counts.
    truncate: the prompt plus `truncate_reserve` slots must fit; if not, the oldest prompt tokens after
    the first n_sink (the sinks: BOS and the start of a system prompt, when the cache is empty) are
    dropped, exactly as many as needed, and reported.
    """
    room = cache.capacity - cache.n_valid
    if overflow == "shift" or len(ids) <= room and overflow == "error":
        return ids, 0
    if overflow == "error":
        raise ContextOverflowError(f"prompt of {len(ids)} tokens does not fit: the context holds {cache.n_valid} of "
                                   f"{cache.capacity} tokens, {room} free")
    budget = max(1, room - truncate_reserve(cache.capacity, max_new_tokens))
    if len(ids) <= budget:
        return ids, 0
    kept = sinks_and_tail(ids, cache.n_sink if cache.n_valid == 0 else 0, budget)
    return kept, len(ids) - len(kept)


def refuse_longer_than_ring(ids: list[int], capacity: int) -> None:
    """Under overflow="error", a prompt longer than the ring fits in no state of it: refused
    (ContextOverflowError) before the ring is touched, so that what it holds stays reusable."""
    if len(ids) > capacity:
        raise ContextOverflowError(f"prompt of {len(ids)} tokens does not fit: the context holds at most {capacity} "
                                   "tokens")


def sinks_and_tail(ids: list[int], n_sink: int, budget: int) -> list[int]:
    """What `budget` slots keep of a longer sequence: its first n_sink ids (at most budget - 1: the
    sinks, BOS and the start of a system prompt) and the most recent ones after them."""
    head = min(n_sink, budget - 1)
    return ids[:head] + ids[len(ids) - (budget - head):]

"""Changing how many cores the runtime computes on, between two tokens, without a second session.

ONNX Runtime fixes a session's intra-op thread pool when it is created, and a second session with
another thread count would hold its own prepacked copy of the weights (measured: +118 MB on a
319 MB process for the 135M-shaped int4 model). So the pool keeps its threads and `CoreLimit`
confines the whole process (every thread: the pool's workers, the caller, a server's threads) to
the first k cores it was allowed at start, with `sched_setaffinity` (Linux and Android; elsewhere
`supported` is False and the limit is reported, not applied). Work that a confined worker cannot
run is taken by the running threads (the pool's loops steal blocks and revoke queued ones), so the
output is bit-identical and the change is effective from the next graph call.

A pool worker that spins waiting for work would take its core's time from the thread doing the
work, so a session built for power control spins only briefly (`SPIN_DURATION_US`; measured: no
loss on all cores, half the slowdown of the default on fewer cores, docs/power.md).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("edgeinfer.power")

SPIN_DURATION_US = 20


def allowed_cores() -> list[int]:
    """The cores this process may run on now, as its main thread's affinity says (the one `taskset
    -p` sets; the caller may be the power controller's own thread); all online CPUs where affinity
    is not supported."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return sorted(os.sched_getaffinity(os.getpid()))  # on Linux the main thread's id is the pid
        except OSError:
            return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class CoreLimit:
    """Confine the process to `k` of the cores it may use, and give them back. The cores are read
    again each time it starts to confine (the user may have pinned the process since), and those
    are what it gives back. Affinity is the process's, so every controller of a live process shares
    one (`shared()`): with two Models under power control the last plan applied wins."""

    _shared: "CoreLimit | None" = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> "CoreLimit":
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self, cores: list[int] | None = None, task_dir: str = "/proc/self/task"):
        self.cores = list(cores) if cores is not None else allowed_cores()
        self._follow = cores is None  # re-read the allowed cores whenever this does not confine them
        self.task_dir = task_dir
        self.supported = hasattr(os, "sched_setaffinity") and os.path.isdir(task_dir)
        self.applied = len(self.cores)  # cores the process is confined to now
        self._lock = threading.Lock()

    @property
    def max_threads(self) -> int:
        return len(self.cores)

    def apply(self, k: int) -> int:
        """Confine every thread of the process to the first k cores (1 <= k <= max_threads, clamped);
        return the count now in force. Threads that exit meanwhile are skipped; never raises."""
        with self._lock:
            if self._follow and self.supported and self.applied >= 1:  # has the user pinned the process since?
                now = allowed_cores()
                ours = self.cores[:self.applied]  # what the process has if nobody else moved it
                if now and now != ours:  # they did: their cores are the ones to confine within, and give back
                    self.cores, self.applied = now, len(now)
            k = max(1, min(int(k), len(self.cores)))
            if not self.supported:  # reported only
                self.applied = k
                return k
            if k == self.applied:
                return k
            target = set(self.cores[:k])
            try:
                tids = [int(t) for t in os.listdir(self.task_dir)]
            except OSError as e:
                log.warning("edgeinfer power: cannot list threads (%s); core limit not applied", e)
                return self.applied
            self.applied = -1  # unknown until every thread is moved (an interruption leaves it so)
            for tid in tids:
                try:
                    os.sched_setaffinity(tid, target)
                except OSError:  # the thread ended, or we may not touch it
                    pass
            self.applied = k
            return k

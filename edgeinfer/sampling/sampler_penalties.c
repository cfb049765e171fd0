/*
 * sampler_penalties.c: the penalty window of the C sampler, and the penalty step it feeds
 * (step 1 of reference.adjust_logits).
 *
 * The window holds the last n ids given (a history, then accepted tokens) in a ring of n slots,
 * and the distinct ids among them with their counts in an array sorted by id. Each accepted id
 * updates the counts by one binary search and at most one memmove for the id that arrives and one
 * for the id that leaves, so the penalty step reads ready counts instead of sorting the window
 * every token. Both arrays grow as ids arrive, never beyond n entries. The Python twin of the
 * window is edgeinfer.sampling.penalties.PenaltyWindow.
 */
#include "sampler_chain.h"

#include <stdlib.h>
#include <string.h>

void window_init(Window *w, idx_t n) {
    memset(w, 0, sizeof *w);
    w->n = n;
    w->max_id = -1;
}

void window_free(Window *w) {
    free(w->ring);
    free(w->counts);
    window_init(w, 0);
}

/* the first entry of counts[0..n_distinct) whose id is >= id */
static idx_t lower_bound(const Window *w, int32_t id) {
    idx_t lo = 0, hi = w->n_distinct;
    while (lo < hi) {
        idx_t mid = lo + (hi - lo) / 2;
        if (w->counts[mid].id < id) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void count_up(Window *w, int32_t id) {
    idx_t i = lower_bound(w, id);
    if (i < w->n_distinct && w->counts[i].id == id) {
        w->counts[i].count++;
        return;
    }
    memmove(w->counts + i + 1, w->counts + i, (size_t)(w->n_distinct - i) * sizeof(IdCount));
    w->counts[i].id = id;
    w->counts[i].count = 1;
    w->n_distinct++;
}

static void count_down(Window *w, int32_t id) { /* id is held */
    idx_t i = lower_bound(w, id);
    if (--w->counts[i].count > 0) return;
    w->n_distinct--;
    memmove(w->counts + i, w->counts + i + 1, (size_t)(w->n_distinct - i) * sizeof(IdCount));
}

/* room for one more id while the window is not full: both arrays doubled, at most to n */
static int grow(Window *w) {
    idx_t cap = w->cap ? 2 * w->cap : 64;
    if (cap > w->n) cap = w->n;
    int32_t *ring = realloc(w->ring, (size_t)cap * sizeof *ring);
    if (!ring) return -1;
    w->ring = ring;
    IdCount *counts = realloc(w->counts, (size_t)cap * sizeof *counts);
    if (!counts) return -1; /* ring is larger, cap unchanged: still consistent */
    w->counts = counts;
    w->cap = cap;
    return 0;
}

int window_accept(Window *w, int32_t id) {
    if (w->n > 0) {
        if (w->len < w->n) {
            if (w->len == w->cap && grow(w) < 0) return -1;
            w->ring[w->len++] = id;
        } else { /* full: the oldest id leaves, the new one takes its slot */
            count_down(w, w->ring[w->head]);
            w->ring[w->head] = id;
            w->head = w->head + 1 == w->n ? 0 : w->head + 1;
        }
        count_up(w, id);
    }
    if (id > w->max_id) w->max_id = id;
    return 0;
}

int window_reset(Window *w, const int64_t *ids, idx_t k) {
    w->len = w->head = w->n_distinct = 0;
    int64_t max_id = -1;
    for (idx_t i = 0; i < k; i++) max_id = ids[i] > max_id ? ids[i] : max_id;
    for (idx_t i = k > w->n ? k - w->n : 0; i < k; i++) {
        if (window_accept(w, (int32_t)ids[i]) < 0) {
            w->len = w->head = w->n_distinct = 0;
            w->max_id = -1;
            return -1;
        }
    }
    w->max_id = max_id;
    return 0;
}

/* For each distinct id t held, c times: a positive logit is divided by rep, a negative one
 * multiplied by it, then lg[t] -= c * freq + pres. Ids are < V: the chain checked max_id. */
void window_penalize(const Window *w, const Params *p, double *lg) {
    for (idx_t i = 0; i < w->n_distinct; i++) {
        int32_t t = w->counts[i].id;
        double v = lg[t];
        v = v > 0 ? v / p->rep : v * p->rep;
        lg[t] = v - ((double)w->counts[i].count * p->freq + p->pres);
    }
}

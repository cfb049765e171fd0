/*
 * sampler_chain.c: the sampling chain of edgeinfer/sampling/reference.py in C99.
 *
 * The numpy twin is the specification. One token is its three steps, each a function below with
 * the same name and contract:
 *   1. adjust_logits: copy the float32 logits to double, checking them in the same pass; the
 *      penalties, from the counts the penalty window keeps up to date as ids are accepted
 *      (sampler_penalties.c); the logit bias.
 *   2. filter_logits: temperature 0 keeps the argmax alone; else top-k (bounded heap, one pass)
 *      -> typical -> top-p (bucketed partial selection) -> min-p -> temperature, and the
 *      unnormalised softmax over the kept set, in ascending id (kernels: sampler_kernels.c).
 *   3. draw_token: inverse-CDF draw in ascending token id (temperature 0: the argmax, no RNG).
 *
 * State is split by lifetime (as llama2.c's run.c): `Params` is fixed at construction, the `Rng`
 * advances one step per draw, the `Window` one id per accepted token, and the run-state buffers
 * are allocated once for the vocabulary size and reused (grown only if a larger vocabulary
 * arrives). No Python here: _csampler.c is the glue.
 *
 * Generator: xoshiro256** (Blackman & Vigna), seeded by splitmix64; uniform = (x >> 11) * 2^-53.
 */
#include "sampler_chain.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- rng */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(Rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static double rng_uniform(Rng *r) { return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

/* ---------------------------------------------------------------- the three steps */

/*
 * Step 1. st->lg = the logits as double, with the penalties and the logit bias applied. Returns
 * NULL, or the message for bad input (NaN or +inf logits, a history or bias id >= V, all -inf,
 * a logit the penalties and bias pushed to +inf).
 * *best: the argmax of the result (lowest id on ties), or -1 at a temperature above 0 with nothing
 * adjusted (only temperature 0 reads it). *n_neginf: how many logits are -inf, over-counted when a
 * bias is -inf (it only decides the filter's slow path).
 */
static const char *adjust_logits(ChainState *st, const float *logits, idx_t V, int64_t *best, idx_t *n_neginf) {
    const Params *p = &st->p;
    double *lg = st->lg;
    int nan_seen = 0, inf_seen = 0;
    idx_t neg = 0;
    for (idx_t i = 0; i < V; i++) { /* branch-free, so it vectorizes */
        float x = logits[i];
        nan_seen |= x != x;
        inf_seen |= x == INFINITY;
        neg += x == -INFINITY;
        lg[i] = (double)x;
    }
    if (nan_seen) return "logits contain NaN";
    if (inf_seen) return "logits contain +inf";
    if (st->win.max_id >= V) return "history has token ids outside the vocabulary";
    window_penalize(&st->win, p, lg);
    for (idx_t i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] >= V) return "logit_bias token id is outside the vocabulary";
        lg[p->bias_ids[i]] += p->bias_vals[i];
        neg += p->bias_vals[i] == -INFINITY;
    }
    *n_neginf = neg;
    if (p->temperature != 0.0 && st->win.n_distinct == 0 && p->n_bias == 0) {
        /* nothing adjusted and no argmax wanted: the counts say all (the argmax's two reads saved) */
        *best = -1;
        return neg >= V ? "all logits are -inf: nothing can be sampled" : NULL;
    }
    *best = argmax_first(lg, V);
    if (lg[*best] == -INFINITY) return "all logits are -inf: nothing can be sampled";
    /* SamplingParams' bounds keep this from happening; were it to, no candidate would survive the filter */
    if (lg[*best] == INFINITY) return "the penalties and logit_bias push a logit to +inf";
    return NULL;
}

/* the typical filter's key of each candidate: |-log p - H|, p = softmax at temperature 1 */
static double typical_keys(ChainState *st, idx_t n, int identity) {
    const int32_t *cand = st->cand;
    double *e = st->e, *key = st->key;
    double s = exp_over(st->lg, e, cand, n, identity, st->xs, NULL, 1.0), ent = 0.0;
    for (idx_t i = 0; i < n; i++) {
        double q = e[cand[i]] / s;
        key[cand[i]] = log(q); /* -inf when q underflows to 0: such a token sorts last */
        if (q > 0) ent -= q * key[cand[i]];
    }
    for (idx_t i = 0; i < n; i++) key[cand[i]] = fabs(-key[cand[i]] - ent);
    return s;
}

/* min-p: keeps the candidates with p >= min_p * max p (their order unchanged); returns how many */
static idx_t min_p_select(ChainState *st, idx_t n, int identity) {
    int32_t *cand = st->cand;
    const double *e = st->e;
    double s = exp_over(st->lg, st->e, cand, n, identity, st->xs, NULL, 1.0), pmax = 0.0;
    for (idx_t i = 0; i < n; i++) if (e[cand[i]] / s > pmax) pmax = e[cand[i]] / s;
    double thr = st->p.min_p * pmax;
    idx_t m = 0;
    for (idx_t i = 0; i < n; i++) if (e[cand[i]] / s >= thr) cand[m++] = cand[i];
    return m;
}

/*
 * Step 2. The kept ids, ascending, into st->cand[0..n); their unnormalised probabilities at the
 * temperature into st->e[id]; returns n (>= 1) and their sum in *total. Temperature 0: the argmax
 * `best` alone (e = total = 1). Filters see probabilities at temperature 1; st->lg is not changed.
 */
static idx_t filter_logits(ChainState *st, idx_t V, int64_t best, idx_t n_neginf, double *total) {
    const Params *p = &st->p;
    const double *lg = st->lg;
    int32_t *cand = st->cand;
    if (p->temperature == 0.0) {
        cand[0] = (int32_t)best;
        st->e[best] = *total = 1.0;
        return 1;
    }
    /* candidates: the finite logits in ascending id, or straight to the k best */
    idx_t n = 0;
    int identity = 0; /* cand == 0..n-1, until a filter drops or reorders candidates */
    if (p->top_k > 0 && p->top_k < V) {
        n = V <= TOP_K_BUCKETS_MAX_V ? top_k_buckets(lg, V, p->top_k, cand, st->bidx, st->pairs) : -1;
        if (n < 0) n = top_k_scan(lg, V, p->top_k, cand);
    } else if (n_neginf == 0) {
        for (idx_t i = 0; i < V; i++) cand[i] = (int32_t)i;
        n = V;
        identity = 1;
    } else {
        for (idx_t i = 0; i < V; i++) if (lg[i] != -INFINITY) cand[n++] = (int32_t)i;
    }
    if (p->typical_p < 1.0) {
        double s = typical_keys(st, n, identity);
        n = prefix_mass(st->key, st->e, s, cand, st->tmp, st->pairs, &st->buckets, st->bidx, n, p->typical_p);
        identity = 0;
    }
    if (p->top_p < 1.0) {
        double m, s = exp_over(lg, st->e, cand, n, identity, st->xs, &m, 1.0);
        n = top_p_select(lg, st->e, s, m, cand, identity, st->pairs, &st->buckets, st->bidx, n, p->top_p);
        identity = 0;
    }
    if (p->min_p > 0.0) {
        idx_t m = min_p_select(st, n, identity);
        identity = identity && m == n;
        n = m;
    }
    sort_ids(cand, st->tmp, n);
    *total = exp_over(lg, st->e, cand, n, identity, st->xs, NULL, p->temperature);
    return n;
}

/*
 * Step 3. u = uniform in [0, 1); the first of cand[0..n) (ascending id) whose running sum of e
 * exceeds u * total (the last one if rounding leaves none). Temperature 0: cand[0], and the RNG
 * does not advance.
 */
static int64_t draw_token(ChainState *st, idx_t n, double total) {
    const int32_t *cand = st->cand;
    if (st->p.temperature == 0.0) return cand[0];
    double target = rng_uniform(&st->rng) * total, cum = 0.0;
    for (idx_t i = 0; i < n; i++) {
        cum += st->e[cand[i]];
        if (cum > target) return cand[i];
    }
    return cand[n - 1];
}

/* ---------------------------------------------------------------- the chain */

int chain_grow(ChainState *self, idx_t V) {
    if (V <= self->cap) return 0;
    double *lg = realloc(self->lg, (size_t)V * sizeof(double));
    if (lg) self->lg = lg;
    double *key = realloc(self->key, (size_t)V * sizeof(double));
    if (key) self->key = key;
    double *e = realloc(self->e, (size_t)V * sizeof(double));
    if (e) self->e = e;
    double *xs = realloc(self->xs, (size_t)V * sizeof(double));
    if (xs) self->xs = xs;
    int32_t *cand = realloc(self->cand, (size_t)V * sizeof(int32_t));
    if (cand) self->cand = cand;
    int32_t *tmp = realloc(self->tmp, (size_t)V * sizeof(int32_t));
    if (tmp) self->tmp = tmp;
    Pair *pairs = realloc(self->pairs, (size_t)V * sizeof(Pair));
    if (pairs) self->pairs = pairs;
    int32_t *bidx = realloc(self->bidx, (size_t)V * sizeof(int32_t));
    if (bidx) self->bidx = bidx;
    if (!lg || !key || !e || !xs || !cand || !tmp || !pairs || !bidx) return -1;
    self->cap = V;
    return 0;
}

/* Steps 1-3. Touches only st and the call's pointers (the Python glue runs it without the GIL). */
void chain_run(ChainState *st, Call *c) {
    int64_t best;
    idx_t n_neginf;
    double total;
    c->err = adjust_logits(st, c->logits, c->V, &best, &n_neginf);
    if (c->err) return;
    idx_t n = filter_logits(st, c->V, best, n_neginf, &total);
    if (c->probs_out) {
        memset(c->probs_out, 0, (size_t)c->V * sizeof(double));
        for (idx_t i = 0; i < n; i++) c->probs_out[st->cand[i]] = st->e[st->cand[i]] / total;
    }
    if (c->draw) c->token = draw_token(st, n, total);
}

/*
 * Steps 1-3 for temperature 0 with no penalty and no logit bias (the common greedy request): the
 * argmax of the float32 logits, lowest id on ties, and step 1's errors in its order, in one read of
 * the logits instead of a copy to double and two reads of that (a 49,152-id vocabulary: ~30 -> ~5 us).
 * The token and the errors are chain_run's: float to double is exact and keeps the order.
 */
const char *chain_greedy(const ChainState *st, const float *logits, idx_t V, int64_t *token) {
    int nan_seen, inf_seen;
    int64_t best = argmax_first_f32(logits, V, &nan_seen, &inf_seen);
    if (nan_seen) return "logits contain NaN";
    if (inf_seen) return "logits contain +inf";
    if (st->win.max_id >= V) return "history has token ids outside the vocabulary";
    if (logits[best] == -INFINITY) return "all logits are -inf: nothing can be sampled";
    *token = best;
    return NULL;
}

void chain_seed(ChainState *st, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) st->rng.s[i] = splitmix64(&x);
}

double chain_uniform(ChainState *st) { return rng_uniform(&st->rng); }

void chain_free(ChainState *st) {
    free(st->p.bias_ids); free(st->p.bias_vals); window_free(&st->win);
    free(st->lg); free(st->key); free(st->e); free(st->xs); free(st->cand); free(st->tmp); free(st->pairs);
    free(st->bidx);
}

double chain_logprobs(ChainState *st, idx_t V, int64_t token, idx_t top_n, idx_t *n_out) {
    const double *lg = st->lg;
    double lse = log_sum_exp(lg, V, st->xs);
    idx_t n = 0;
    if (top_n > 0) {
        n = top_k_scan(lg, V, top_n, st->tmp);
        for (idx_t i = 0; i < n; i++) { st->pairs[i].key = -lg[st->tmp[i]]; st->pairs[i].id = st->tmp[i]; }
        sort_pairs(st->pairs, n);
        for (idx_t i = 0; i < n; i++) st->pairs[i].key = lg[st->pairs[i].id] - lse;
    }
    *n_out = n;
    return lg[token] - lse;
}

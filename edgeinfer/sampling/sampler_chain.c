/*
 * sampler_chain.c: the sampling chain of edgeinfer/sampling/reference.py in C99.
 *
 * The numpy twin is the specification; this file implements the same steps with partial
 * selection instead of sorts of the vocabulary:
 *   copy + checks (one pass) -> penalties (sort of the small history window) -> logit bias
 *   -> top-k (bounded heap, one pass) -> typical / top-p (bucketed partial selection: one pass
 *   to bucket by key, a sort of only the bucket where the mass threshold falls) -> min-p
 *   -> temperature + softmax over the kept set -> inverse-CDF draw in ascending token id.
 *
 * State is split by lifetime (as llama2.c's run.c): `Params` is fixed at construction, `Rng`
 * advances one step per draw, and the run-state buffers are allocated once for the vocabulary
 * size and reused (grown only if a larger vocabulary arrives). No Python here: _csampler.c is
 * the glue.
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

/* ---------------------------------------------------------------- ordering helpers */

/* candidates are ordered by (key ascending, id ascending); sorted as pairs, so no global state */
static int cmp_pair(const void *a, const void *b) {
    const Pair *x = a, *y = b;
    if (x->key < y->key) return -1;
    if (x->key > y->key) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

static void sort_by_key(const double *key, int32_t *ids, Pair *pairs, idx_t n) {
    for (idx_t i = 0; i < n; i++) { pairs[i].key = key[ids[i]]; pairs[i].id = ids[i]; }
    qsort(pairs, (size_t)n, sizeof(Pair), cmp_pair);
    for (idx_t i = 0; i < n; i++) ids[i] = pairs[i].id;
}
static int cmp_i32(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    return (i > j) - (i < j);
}
static int cmp_i64(const void *a, const void *b) {
    int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    return (i > j) - (i < j);
}

/* `a` ranks above `b` for top-k: larger logit, then lower id */
static int above(const double *lg, int32_t a, int32_t b) { return lg[a] > lg[b] || (lg[a] == lg[b] && a < b); }

/* min-heap (root = weakest kept) of size k over lg */
static void heap_down(const double *lg, int32_t *h, idx_t n, idx_t i) {
    for (;;) {
        idx_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && above(lg, h[w], h[l])) w = l;
        if (r < n && above(lg, h[w], h[r])) w = r;
        if (w == i) return;
        int32_t t = h[i]; h[i] = h[w]; h[w] = t;
        i = w;
    }
}

/* GCC/Clang on x86-64 Linux: build the exp loop for AVX-512, AVX2+FMA and baseline, picked at load */
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define VECTOR_CLONES
#endif

/*
 * exp(x) for x <= 0 (x = logit - max, or -inf), in pure arithmetic so the loop below vectorizes:
 * Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, a degree-13 Taylor polynomial for exp(r),
 * 2^k built in the exponent bits. Max relative error 2.2e-16 against glibc's exp; 0 below -708.
 */
static inline double exp_nonpos(double x) {
    const double shift = 6755399441055744.0; /* 1.5 * 2^52: adding it rounds to an integer */
    double xc = x < -708.0 ? -708.0 : x;
    double t = xc * 1.4426950408889634 + shift;
    double k = t - shift;
    double r = xc - k * 0.6931471803691238 - k * 1.9082149292705877e-10;
    double p = 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    int64_t bits, shift_bits;
    memcpy(&bits, &t, sizeof bits);
    memcpy(&shift_bits, &shift, sizeof shift_bits);
    int64_t e = (bits - shift_bits + 1023) << 52;
    double scale;
    memcpy(&scale, &e, sizeof scale);
    return x <= -708.0 ? 0.0 : p * scale;
}

VECTOR_CLONES static void vexp_inplace(double *x, idx_t n) {
    for (idx_t i = 0; i < n; i++) x[i] = exp_nonpos(x[i]);
}

/* index of the largest value, lowest index on ties (8 independent maxima, then a scan) */
static int64_t argmax_first(const double *x, idx_t n) {
    double m[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    idx_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
    for (; i < n; i++) m[0] = x[i] > m[0] ? x[i] : m[0];
    double best = m[0];
    for (int j = 1; j < 8; j++) best = m[j] > best ? m[j] : best;
    for (i = 0; i < n; i++) if (x[i] == best) return i;
    return 0;
}

/* softmax pieces over cand: e[id] = exp(x[id] / t - max); returns their sum (and the max if asked).
 * `identity`: the caller knows cand[i] == i for all i < n. `xs` is scratch [n]. */
static double exp_over(const double *x, double *e, const int32_t *cand, idx_t n, int identity, double *xs,
                       double *max_out, double t) {
    if (identity) { /* cand is exactly 0..n-1: contiguous, no gathers */
        double m = x[argmax_first(x, n)] / t;
        if (max_out) *max_out = m;
        if (t == 1.0) for (idx_t i = 0; i < n; i++) e[i] = x[i] - m;
        else for (idx_t i = 0; i < n; i++) e[i] = x[i] / t - m;
        vexp_inplace(e, n);
        double s[4] = {0.0, 0.0, 0.0, 0.0};
        idx_t i = 0;
        for (; i + 4 <= n; i += 4) for (int j = 0; j < 4; j++) s[j] += e[i + j];
        for (; i < n; i++) s[0] += e[i];
        return (s[0] + s[1]) + (s[2] + s[3]);
    }
    double m = -INFINITY;
    for (idx_t i = 0; i < n; i++) if (x[cand[i]] > m) m = x[cand[i]];
    m /= t;
    if (max_out) *max_out = m;
    for (idx_t i = 0; i < n; i++) xs[i] = x[cand[i]] / t - m;
    vexp_inplace(xs, n);
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    idx_t i = 0;
    for (; i + 4 <= n; i += 4) {
        e[cand[i]] = xs[i]; e[cand[i + 1]] = xs[i + 1]; e[cand[i + 2]] = xs[i + 2]; e[cand[i + 3]] = xs[i + 3];
        s0 += xs[i]; s1 += xs[i + 1]; s2 += xs[i + 2]; s3 += xs[i + 3];
    }
    for (; i < n; i++) { e[cand[i]] = xs[i]; s0 += xs[i]; }
    return (s0 + s1) + (s2 + s3);
}

/* bucket of a key: linear in [kmin, kmax] over the finite keys; infinite keys go last */
static int bucket_of(double k, double kmin, double kmax, double scale) {
    if (!(k <= kmax)) return N_BUCKETS - 1;
    int b = (int)((k - kmin) * scale);
    return b < 0 ? 0 : (b >= N_BUCKETS ? N_BUCKETS - 1 : b);
}

/*
 * Shortest prefix of cand ordered by (key asc, id asc) whose probability mass (e / sum) reaches
 * `mass`. Reorders cand so the kept ones come first and returns their count (>= 1). Small sets
 * are sorted; large ones are bucketed by key so only the bucket holding the threshold is sorted.
 */
static idx_t prefix_mass(const double *key, const double *e, double sum, int32_t *cand, int32_t *tmp,
                              Pair *pairs, Buckets *bk, int32_t *bidx, idx_t n, double mass) {
    if (n <= SMALL_SORT) {
        sort_by_key(key, cand, pairs, n);
        double cum = 0.0;
        for (idx_t i = 0; i < n; i++) {
            cum += e[cand[i]] / sum;
            if (cum >= mass) return i + 1;
        }
        return n;
    }
    double kmin = INFINITY, kmax = -INFINITY;
    for (idx_t i = 0; i < n; i++) {
        double k = key[cand[i]];
        if (k == INFINITY) continue;
        if (k < kmin) kmin = k;
        if (k > kmax) kmax = k;
    }
    double scale = kmax > kmin ? (N_BUCKETS - 1) / (kmax - kmin) : 0.0;
    memset(bk->mass, 0, sizeof bk->mass);
    double inv = 1.0 / sum;
    for (idx_t i = 0; i < n; i++) {
        int b = bucket_of(key[cand[i]], kmin, kmax, scale);
        bidx[i] = b;
        bk->mass[i & 3][b] += e[cand[i]] * inv;
    }
    double cum = 0.0;
    int B = N_BUCKETS - 1;
    for (int b = 0; b < N_BUCKETS; b++) {
        double m = (bk->mass[0][b] + bk->mass[1][b]) + (bk->mass[2][b] + bk->mass[3][b]);
        if (cum + m >= mass) { B = b; break; }
        cum += m;
    }
    /* partition: buckets < B first, then the sorted bucket B until the mass is reached */
    idx_t lo = 0, nb = 0;
    for (idx_t i = 0; i < n; i++) {
        if (bidx[i] < B) cand[lo++] = cand[i];
        else if (bidx[i] == B) tmp[nb++] = cand[i];
    }
    sort_by_key(key, tmp, pairs, nb);
    for (idx_t i = 0; i < nb; i++) {
        cand[lo++] = tmp[i];
        cum += e[tmp[i]] / sum;
        if (cum >= mass) return lo;
    }
    return lo > 0 ? lo : 1;
}

/* the k best finite ids of lg[0..V) (larger logit, then lower id) into cand; returns their count */
static idx_t top_k_scan(const double *lg, idx_t V, idx_t k, int32_t *cand) {
    idx_t n = 0, i = 0;
    for (; i < V && n < k; i++) if (lg[i] != -INFINITY) cand[n++] = (int32_t)i;
    if (n < k) return n;
    for (idx_t j = k / 2; j-- > 0;) heap_down(lg, cand, k, j);
    double floor = lg[cand[0]];
    for (; i < V; i++) {
        if (lg[i] > floor) { /* equal logits lose: a later id ranks below */
            cand[0] = (int32_t)i;
            heap_down(lg, cand, k, 0);
            floor = lg[cand[0]];
        }
    }
    return k;
}

/* put cand[0..n) in ascending id: a sorted prefix is merged with the sorted rest */
static void sort_ids(int32_t *cand, int32_t *tmp, idx_t n) {
    idx_t L = 1;
    while (L < n && cand[L - 1] < cand[L]) L++;
    if (L >= n) return;
    qsort(cand + L, (size_t)(n - L), sizeof(int32_t), cmp_i32);
    idx_t a = 0, b = L, o = 0;
    while (a < L && b < n) tmp[o++] = cand[a] < cand[b] ? cand[a++] : cand[b++];
    while (a < L) tmp[o++] = cand[a++];
    while (b < n) tmp[o++] = cand[b++];
    memcpy(cand, tmp, (size_t)n * sizeof(int32_t));
}

/*
 * Top-p: the shortest prefix by (logit desc, id asc) whose mass reaches `mass`; the same contract as
 * prefix_mass with key = -logit, but bucketed straight from the logits: bucket = (max - logit) scaled
 * over TOP_P_SPAN nats, everything lower in the last bucket (sorted only if the threshold falls there).
 */
static idx_t top_p_select(const double *lg, const double *e, double sum, double m, int32_t *cand, int identity,
                               Pair *pairs, Buckets *bk, int32_t *bidx, idx_t n, double mass) {
    if (n <= SMALL_SORT) {
        for (idx_t i = 0; i < n; i++) { pairs[i].key = -lg[cand[i]]; pairs[i].id = cand[i]; }
        qsort(pairs, (size_t)n, sizeof(Pair), cmp_pair);
        double cum = 0.0;
        for (idx_t i = 0; i < n; i++) {
            cand[i] = pairs[i].id;
            cum += e[cand[i]] / sum;
            if (cum >= mass) return i + 1;
        }
        return n;
    }
    const double scale = (N_BUCKETS - 1) / TOP_P_SPAN, inv = 1.0 / sum, last = (double)(N_BUCKETS - 1);
    memset(bk->mass, 0, sizeof bk->mass);
    if (identity) { /* cand[i] == i: bucket indices in a vectorizable pass, then the histogram */
        for (idx_t i = 0; i < n; i++) {
            double d = (m - lg[i]) * scale;
            bidx[i] = (int32_t)(d < last ? d : last);
        }
        for (idx_t i = 0; i < n; i++) bk->mass[i & 3][bidx[i]] += e[i];
    } else {
        for (idx_t i = 0; i < n; i++) {
            double d = (m - lg[cand[i]]) * scale;
            bidx[i] = (int32_t)(d < last ? d : last);
            bk->mass[i & 3][bidx[i]] += e[cand[i]];
        }
    }
    for (int j = 0; j < 4; j++) for (int b = 0; b < N_BUCKETS; b++) bk->mass[j][b] *= inv;
    double cum = 0.0;
    int B = N_BUCKETS - 1;
    for (int b = 0; b < N_BUCKETS; b++) {
        double w = (bk->mass[0][b] + bk->mass[1][b]) + (bk->mass[2][b] + bk->mass[3][b]);
        if (cum + w >= mass) { B = b; break; }
        cum += w;
    }
    idx_t lo = 0, nb = 0;
    for (idx_t i = 0; i < n; i++) { /* branch-free compaction in place (lo <= i) */
        int32_t id = cand[i];
        cand[lo] = id;
        lo += bidx[i] < B;
        if (bidx[i] == B) { pairs[nb].key = -lg[id]; pairs[nb].id = id; nb++; }
    }
    qsort(pairs, (size_t)nb, sizeof(Pair), cmp_pair);
    for (idx_t i = 0; i < nb; i++) {
        cand[lo++] = pairs[i].id;
        cum += e[pairs[i].id] / sum;
        if (cum >= mass) return lo;
    }
    return lo > 0 ? lo : 1;
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

/* Touches only st's buffers and the call's pointers (the Python glue runs it without the GIL). */
void chain_run(ChainState *self, Call *c) {
    const Params *p = &self->p;
    idx_t V = c->V;
    double *lg = self->lg, *e = self->e, *key = self->key;
    int32_t *cand = self->cand;

    int nan_seen = 0, inf_seen = 0;
    idx_t n_neginf = 0;
    for (idx_t i = 0; i < V; i++) { /* branch-free, so it vectorizes */
        float x = c->logits[i];
        nan_seen |= x != x;
        inf_seen |= x == INFINITY;
        n_neginf += x == -INFINITY;
        lg[i] = (double)x;
    }
    if (nan_seen) { c->err = "logits contain NaN"; return; }
    if (inf_seen) { c->err = "logits contain +inf"; return; }
    for (idx_t i = 0; i < c->nh; i++) {
        if (c->hist[i] < 0 || c->hist[i] >= V) { c->err = "history has token ids outside the vocabulary"; return; }
    }
    int has_pen = p->rep != 1.0 || p->freq != 0.0 || p->pres != 0.0;
    if (p->last_n > 0 && c->nh > 0 && has_pen) {
        idx_t n = c->nh < p->last_n ? c->nh : p->last_n;
        memcpy(self->win, c->hist + (c->nh - n), (size_t)n * sizeof(int64_t));
        qsort(self->win, (size_t)n, sizeof(int64_t), cmp_i64);
        for (idx_t i = 0; i < n;) {
            idx_t j = i;
            while (j < n && self->win[j] == self->win[i]) j++;
            int64_t t = self->win[i];
            double v = lg[t];
            v = v > 0 ? v / p->rep : v * p->rep;
            lg[t] = v - ((double)(j - i) * p->freq + p->pres);
            i = j;
        }
    }
    for (idx_t i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] >= V) { c->err = "logit_bias token id is outside the vocabulary"; return; }
        lg[p->bias_ids[i]] += p->bias_vals[i];
        n_neginf += p->bias_vals[i] == -INFINITY; /* may over-count: only decides the slow path */
    }
    int64_t best = argmax_first(lg, V);
    if (lg[best] == -INFINITY) { c->err = "all logits are -inf: nothing can be sampled"; return; }
    if (p->temperature == 0.0) {
        c->token = best;
        if (c->probs_out) { memset(c->probs_out, 0, (size_t)V * sizeof(double)); c->probs_out[best] = 1.0; }
        return;
    }
    /* candidates: the finite logits in ascending id, or straight to the k best */
    idx_t n = 0;
    int identity = 0; /* cand == 0..n-1, until a filter drops or reorders candidates */
    if (p->top_k > 0 && p->top_k < V) {
        n = top_k_scan(lg, V, p->top_k, cand);
    } else if (n_neginf == 0) {
        for (idx_t i = 0; i < V; i++) cand[i] = (int32_t)i;
        n = V;
        identity = 1;
    } else {
        for (idx_t i = 0; i < V; i++) if (lg[i] != -INFINITY) cand[n++] = (int32_t)i;
    }
    if (p->typical_p < 1.0) {
        double s = exp_over(lg, e, cand, n, identity, self->xs, NULL, 1.0), ent = 0.0;
        for (idx_t i = 0; i < n; i++) {
            double q = e[cand[i]] / s;
            key[cand[i]] = log(q); /* -inf when q underflows to 0: such a token sorts last */
            if (q > 0) ent -= q * key[cand[i]];
        }
        for (idx_t i = 0; i < n; i++) key[cand[i]] = fabs(-key[cand[i]] - ent);
        n = prefix_mass(key, e, s, cand, self->tmp, self->pairs, &self->buckets, self->bidx, n, p->typical_p);
        identity = 0;
    }
    if (p->top_p < 1.0) {
        double m, s = exp_over(lg, e, cand, n, identity, self->xs, &m, 1.0);
        n = top_p_select(lg, e, s, m, cand, identity, self->pairs, &self->buckets, self->bidx, n, p->top_p);
        identity = 0;
    }
    if (p->min_p > 0.0) {
        double s = exp_over(lg, e, cand, n, identity, self->xs, NULL, 1.0), pmax = 0.0;
        for (idx_t i = 0; i < n; i++) if (e[cand[i]] / s > pmax) pmax = e[cand[i]] / s;
        double thr = p->min_p * pmax;
        idx_t m = 0;
        for (idx_t i = 0; i < n; i++) if (e[cand[i]] / s >= thr) cand[m++] = cand[i];
        identity = identity && m == n;
        n = m;
    }
    /* temperature, softmax over the kept set, in ascending id for the draw */
    sort_ids(cand, self->tmp, n);
    double total = exp_over(lg, e, cand, n, identity, self->xs, NULL, p->temperature);
    if (c->probs_out) {
        memset(c->probs_out, 0, (size_t)V * sizeof(double));
        for (idx_t i = 0; i < n; i++) c->probs_out[cand[i]] = e[cand[i]] / total;
    }
    if (!c->draw) return;
    double target = rng_uniform(&self->rng) * total, cum = 0.0;
    c->token = cand[n - 1];
    for (idx_t i = 0; i < n; i++) {
        cum += e[cand[i]];
        if (cum > target) { c->token = cand[i]; break; }
    }
}


void chain_seed(ChainState *st, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) st->rng.s[i] = splitmix64(&x);
}

double chain_uniform(ChainState *st) { return rng_uniform(&st->rng); }

void chain_free(ChainState *st) {
    free(st->p.bias_ids); free(st->p.bias_vals); free(st->win);
    free(st->lg); free(st->key); free(st->e); free(st->xs); free(st->cand); free(st->tmp); free(st->pairs);
    free(st->bidx);
}

double chain_logprobs(ChainState *st, idx_t V, int64_t token, idx_t top_n, idx_t *n_out) {
    const double *lg = st->lg;
    double *xs = st->xs;
    double m = lg[argmax_first(lg, V)];
    for (idx_t i = 0; i < V; i++) xs[i] = lg[i] - m;
    vexp_inplace(xs, V);
    double sum = 0.0;
    for (idx_t i = 0; i < V; i++) sum += xs[i];
    double lse = m + log(sum);
    idx_t n = 0;
    if (top_n > 0) {
        n = top_k_scan(lg, V, top_n, st->tmp);
        for (idx_t i = 0; i < n; i++) { st->pairs[i].key = -lg[st->tmp[i]]; st->pairs[i].id = st->tmp[i]; }
        qsort(st->pairs, (size_t)n, sizeof(Pair), cmp_pair);
        for (idx_t i = 0; i < n; i++) st->pairs[i].key = lg[st->pairs[i].id] - lse;
    }
    *n_out = n;
    return lg[token] - lse;
}

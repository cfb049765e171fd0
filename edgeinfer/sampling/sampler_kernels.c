/*
 * sampler_kernels.c: the selection and softmax kernels the chain's filter step is built from
 * (sampler_chain.c calls them; declared in sampler_chain.h). No state of their own: every buffer is
 * the caller's. Partial selection instead of sorts of the vocabulary: top-k is a bounded heap over
 * one pass; typical and top-p bucket the candidates by key and sort only the bucket where the mass
 * threshold falls; exp is a vectorizable polynomial.
 */
#include "sampler_chain.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/*
 * The first i in [0, n) with x[i] == best (0 if none), for doubles and floats: a vectorizable test
 * per block of 32 (one branch per block), then the first index inside the block that holds it.
 */
#define FIRST_EQUAL_BODY                                                            \
    {                                                                               \
        idx_t i = 0;                                                                \
        for (; i + 32 <= n; i += 32) {                                              \
            int hit = 0;                                                            \
            for (int j = 0; j < 32; j++) hit |= x[i + j] == best;                   \
            if (hit) break;                                                         \
        }                                                                           \
        for (; i < n; i++) if (x[i] == best) return i;                              \
        return 0;                                                                   \
    }
static inline int64_t first_equal_f64(const double *x, idx_t n, double best) FIRST_EQUAL_BODY
static inline int64_t first_equal_f32(const float *x, idx_t n, float best) FIRST_EQUAL_BODY

/*
 * Index of the largest value, lowest index on ties; 0 when every value is -inf (no NaN allowed).
 * Two vectorizable passes: 8 independent maxima; then a scan for the first block of 32 holding
 * the maximum (one branch per block), and the first index inside it.
 */
VECTOR_CLONES int64_t argmax_first(const double *x, idx_t n) {
    double m[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    idx_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
    for (; i < n; i++) m[0] = x[i] > m[0] ? x[i] : m[0];
    double best = m[0];
    for (int j = 1; j < 8; j++) best = m[j] > best ? m[j] : best;
    return first_equal_f64(x, n, best);
}

/*
 * argmax_first on float32, with step 1's checks in the same pass: *nan_seen / *inf_seen say whether
 * a NaN / +inf was met (the index is then meaningless). The largest value, lowest index on ties,
 * is the argmax_first of the values converted to double (the conversion is exact and keeps order).
 */
#define F32_LANES 32 /* four AVX registers of maxima: a chain of one would wait on each max's latency */
VECTOR_CLONES int64_t argmax_first_f32(const float *x, idx_t n, int *nan_seen, int *inf_seen) {
    float m[F32_LANES], z[F32_LANES]; /* z: sums of x * 0, NaN once a NaN or an infinity was met, else 0 */
    for (int j = 0; j < F32_LANES; j++) m[j] = -INFINITY, z[j] = 0.0f;
    idx_t i = 0;
    for (; i + F32_LANES <= n; i += F32_LANES)
        for (int j = 0; j < F32_LANES; j++) {
            m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
            z[j] += x[i + j] * 0.0f;
        }
    for (; i < n; i++) {
        m[0] = x[i] > m[0] ? x[i] : m[0];
        z[0] += x[i] * 0.0f;
    }
    float best = m[0], zs = z[0];
    for (int j = 1; j < F32_LANES; j++) {
        best = m[j] > best ? m[j] : best;
        zs += z[j];
    }
    *nan_seen = *inf_seen = 0;
    if (zs != zs) { /* a NaN or an infinity: which (-inf alone is allowed) */
        int32_t bad = 0;
        for (i = 0; i < n; i++) bad |= (x[i] != x[i]) | ((x[i] == INFINITY) << 1);
        *nan_seen = bad & 1;
        *inf_seen = bad >> 1;
    }
    return first_equal_f32(x, n, best);
}

/* softmax pieces over cand: e[id] = exp(x[id] / t - max); returns their sum (and the max if asked).
 * `identity`: the caller knows cand[i] == i for all i < n. `xs` is scratch [n]. */
double exp_over(const double *x, double *e, const int32_t *cand, idx_t n, int identity, double *xs,
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
idx_t prefix_mass(const double *key, const double *e, double sum, int32_t *cand, int32_t *tmp,
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
VECTOR_CLONES idx_t top_k_scan(const double *lg, idx_t V, idx_t k, int32_t *cand) {
    idx_t n = 0, i = 0;
    for (; i < V && n < k; i++) if (lg[i] != -INFINITY) cand[n++] = (int32_t)i;
    if (n < k) return n;
    for (idx_t j = k / 2; j-- > 0;) heap_down(lg, cand, k, j);
    double floor = lg[cand[0]];
    /* blocks of 32 with none above the floor are skipped after one vectorized test (once the heap
     * holds good logits, nearly all of them): the same ids in the same order as one by one */
    for (; i < V; i++) {
        if (i % 32 == 0 && i + 32 <= V) {
            int hit = 0;
            for (int j = 0; j < 32; j++) hit |= lg[i + j] > floor;
            if (!hit) {
                i += 31;
                continue;
            }
        }
        if (lg[i] > floor) { /* equal logits lose: a later id ranks below */
            cand[0] = (int32_t)i;
            heap_down(lg, cand, k, 0);
            floor = lg[cand[0]];
        }
    }
    return k;
}

/*
 * The same k ids as top_k_scan, for a vocabulary of at most TOP_K_BUCKETS_MAX_V: each logit's distance
 * below the max, bucketed (TOP_K_N_BUCKETS over TOP_K_SPAN nats; a larger logit never lands in a later
 * bucket, equal ones in the same); the buckets before the one where the count reaches k are kept whole,
 * and that bucket's ids are sorted (larger logit, then lower id) for the rest. Four passes over the
 * vocabulary and no branch on the logits, where the heap's cost follows how often an id raises its
 * floor: every time for logits that rise with the id (61 us at V = 512); stories260K's own logits cost
 * it 25 us, and 1 us here. Returns -1, cand unspecified, where top_k_scan must do it: fewer than k
 * finite logits within the span, or a threshold bucket of more than TOP_K_SORT_MAX ids (many equal
 * logits, which the heap passes over).
 */
idx_t top_k_buckets(const double *lg, idx_t V, idx_t k, int32_t *cand, int32_t *bidx, Pair *pairs) {
    const double m = lg[argmax_first(lg, V)], scale = (TOP_K_N_BUCKETS - 1) / TOP_K_SPAN;
    const double last = (double)(TOP_K_N_BUCKETS - 1); /* and every logit below the span, -inf among them */
    idx_t count[TOP_K_N_BUCKETS] = {0};
    for (idx_t i = 0; i < V; i++) {
        double d = (m - lg[i]) * scale;
        bidx[i] = (int32_t)(d < last ? d : last);
    }
    for (idx_t i = 0; i < V; i++) count[bidx[i]]++;
    idx_t before = 0;
    int32_t b = 0;
    while (b < TOP_K_N_BUCKETS - 1 && before + count[b] < k) before += count[b++];
    if (b == TOP_K_N_BUCKETS - 1 || count[b] > TOP_K_SORT_MAX) return -1;
    idx_t n = 0, np = 0;
    for (idx_t i = 0; i < V; i++) {
        if (bidx[i] < b) {
            cand[n++] = (int32_t)i;
        } else if (bidx[i] == b) {
            pairs[np].key = -lg[i];
            pairs[np++].id = (int32_t)i;
        }
    }
    sort_pairs(pairs, np); /* key = -logit ascending, then id ascending */
    for (idx_t j = 0; n < k; j++) cand[n++] = pairs[j].id;
    return k;
}

/* put cand[0..n) in ascending id: a sorted prefix is merged with the sorted rest */
void sort_ids(int32_t *cand, int32_t *tmp, idx_t n) {
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
idx_t top_p_select(const double *lg, const double *e, double sum, double m, int32_t *cand, int identity,
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

/* sort (key, id) pairs: key ascending, then id ascending */
void sort_pairs(Pair *pairs, idx_t n) { qsort(pairs, (size_t)n, sizeof(Pair), cmp_pair); }

/* log(sum(exp(x[0..n)))), the max factored out; xs is scratch [n] */
double log_sum_exp(const double *x, idx_t n, double *xs) {
    double m = x[argmax_first(x, n)];
    for (idx_t i = 0; i < n; i++) xs[i] = x[i] - m;
    vexp_inplace(xs, n);
    double sum = 0.0;
    for (idx_t i = 0; i < n; i++) sum += xs[i];
    return m + log(sum);
}

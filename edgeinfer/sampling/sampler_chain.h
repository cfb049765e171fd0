/*
 * sampler_chain.h: the sampling chain of edgeinfer/sampling/reference.py in C99, no Python.
 *
 *   sampler_chain.c      state, RNG, and the chain's three steps: adjust, filter, draw
 *   sampler_penalties.c  the penalty window: the last n ids and their counts, updated per accepted id
 *   sampler_kernels.c    selection and softmax kernels the filter step is built from
 *
 * One ChainState per sampler: parameters (fixed at construction), the RNG, the penalty window, and
 * run-state buffers grown once to the vocabulary size. Nothing here is thread-safe for one ChainState.
 */
#ifndef EDGEINFER_SAMPLER_CHAIN_H
#define EDGEINFER_SAMPLER_CHAIN_H

#include <stddef.h>
#include <stdint.h>

typedef ptrdiff_t idx_t;

#define N_BUCKETS 2048
#define TOP_P_SPAN 40.0 /* nats below the max logit covered by the top-p buckets; lower ones share the last */
#define SMALL_SORT 256
/* top_k_buckets: vocabularies up to this size; buckets over the span below the max logit; the most ids
 * the threshold bucket may hold (more: many equal logits, which top_k_scan passes over cheaply) */
#define TOP_K_BUCKETS_MAX_V 16384
#define TOP_K_N_BUCKETS 256
#define TOP_K_SPAN 32.0
#define TOP_K_SORT_MAX 512

typedef struct {
    double temperature, top_p, min_p, typical_p, rep, freq, pres;
    idx_t top_k, n_bias;
    int64_t *bias_ids;
    double *bias_vals;
} Params;

typedef struct {
    uint64_t s[4];
} Rng;

typedef struct {
    double key;
    int32_t id;
} Pair;

typedef struct {
    int32_t id, count;
} IdCount;

typedef struct {
    double mass[4][N_BUCKETS]; /* four interleaved histograms: no store-to-load chain on hot buckets */
} Buckets;

/*
 * The penalty window: the last n ids given (a history, then accepted tokens) and how often each
 * distinct id occurs among them. Ids are in [0, 2^31) (the caller checks); memory grows with the
 * ids held, never beyond n of each array, however long generation runs.
 */
typedef struct {
    idx_t n;          /* ids kept: penalty_last_n when a penalty is on, else 0 (nothing is stored) */
    idx_t len;        /* ids held, <= n */
    idx_t head;       /* once len == n: the slot of the oldest id, the next one replaced */
    idx_t cap;        /* slots allocated in ring and counts (<= n) */
    int32_t *ring;    /* [cap] the ids held: slots 0..len in arrival order, a ring from head once full */
    IdCount *counts;  /* [cap] the distinct ids held, ascending id, each with its count (> 0) */
    idx_t n_distinct;
    int64_t max_id;   /* largest id given since the last reset (-1: none), stored or not */
} Window;

typedef struct {
    Params p;
    Rng rng;
    Window win;
    idx_t cap;      /* vocabulary size the buffers hold */
    double *lg;     /* [cap] adjusted logits (after a run: the penalised, biased logits) */
    double *key;    /* [cap] selection keys / scratch */
    double *e;      /* [cap] unnormalised probabilities of candidates */
    double *xs;     /* [cap] contiguous scratch for the vectorized exp */
    int32_t *cand;  /* [cap] candidate ids */
    int32_t *tmp;   /* [cap] scratch ids */
    Pair *pairs;    /* [cap] (key, id) for the few sorts */
    int32_t *bidx;  /* [cap] bucket of each candidate */
    Buckets buckets;
} ChainState;

/* One call of the chain. */
typedef struct {
    const float *logits;
    idx_t V;
    double *probs_out; /* [V] or NULL */
    int draw;
    /* results */
    int64_t token;     /* the drawn id (left as is when draw is 0) */
    const char *err;   /* a user error (bad input), or NULL */
} Call;

/* ---- the chain (sampler_chain.c) */
void chain_seed(ChainState *st, uint64_t seed);
double chain_uniform(ChainState *st);
int chain_grow(ChainState *st, idx_t V);    /* 0, or -1 when out of memory */
void chain_free(ChainState *st);
void chain_run(ChainState *st, Call *c);    /* sets c->token, fills c->probs_out, or sets c->err */
/* temperature 0, no penalty, no logit bias: chain_run's token and errors, from the float32 logits
 * directly (st->lg is not written); NULL or the error */
const char *chain_greedy(const ChainState *st, const float *logits, idx_t V, int64_t *token);
/* log-softmax of st->lg[0..V) at `token`; the top_n best (id, logprob) into st->pairs (best first) */
double chain_logprobs(ChainState *st, idx_t V, int64_t token, idx_t top_n, idx_t *n_out);

/* ---- the penalty window (sampler_penalties.c) */
void window_init(Window *w, idx_t n);                        /* empty, keeping n ids; allocates nothing */
void window_free(Window *w);                                 /* frees, then as window_init(w, 0) */
int window_accept(Window *w, int32_t id);                    /* 0, or -1 out of memory (w unchanged) */
int window_reset(Window *w, const int64_t *ids, idx_t k);    /* as if only ids[0..k) were accepted; -1: OOM, emptied */
void window_penalize(const Window *w, const Params *p, double *lg); /* the penalty step on lg */

/* ---- kernels of the filter step (sampler_kernels.c); contracts at their definitions */
int64_t argmax_first(const double *x, idx_t n);
int64_t argmax_first_f32(const float *x, idx_t n, int *nan_seen, int *inf_seen);
double exp_over(const double *x, double *e, const int32_t *cand, idx_t n, int identity, double *xs,
                double *max_out, double t);
double log_sum_exp(const double *x, idx_t n, double *xs);
idx_t top_k_scan(const double *lg, idx_t V, idx_t k, int32_t *cand);
idx_t top_k_buckets(const double *lg, idx_t V, idx_t k, int32_t *cand, int32_t *bidx, Pair *pairs);
idx_t prefix_mass(const double *key, const double *e, double sum, int32_t *cand, int32_t *tmp, Pair *pairs,
                  Buckets *bk, int32_t *bidx, idx_t n, double mass);
idx_t top_p_select(const double *lg, const double *e, double sum, double m, int32_t *cand, int identity,
                   Pair *pairs, Buckets *bk, int32_t *bidx, idx_t n, double mass);
void sort_ids(int32_t *cand, int32_t *tmp, idx_t n);
void sort_pairs(Pair *pairs, idx_t n);

#endif

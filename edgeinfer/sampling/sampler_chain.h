/*
 * sampler_chain.h: the sampling chain of edgeinfer/sampling/reference.py in C99, no Python.
 * One ChainState per sampler: parameters (fixed at construction), the RNG, and run-state buffers
 * grown once to the vocabulary size. Nothing here is thread-safe for one ChainState.
 */
#ifndef EDGEINFER_SAMPLER_CHAIN_H
#define EDGEINFER_SAMPLER_CHAIN_H

#include <stddef.h>
#include <stdint.h>

typedef ptrdiff_t idx_t;

#define N_BUCKETS 2048
#define TOP_P_SPAN 40.0 /* nats below the max logit covered by the top-p buckets; lower ones share the last */
#define SMALL_SORT 256

typedef struct {
    double temperature, top_p, min_p, typical_p, rep, freq, pres;
    idx_t top_k, last_n, n_bias;
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
    double mass[4][N_BUCKETS]; /* four interleaved histograms: no store-to-load chain on hot buckets */
} Buckets;

typedef struct {
    Params p;
    Rng rng;
    idx_t cap;      /* vocabulary size the buffers hold */
    double *lg;     /* [cap] adjusted logits (after a run: the penalised, biased logits) */
    double *key;    /* [cap] selection keys / scratch */
    double *e;      /* [cap] unnormalised probabilities of candidates */
    double *xs;     /* [cap] contiguous scratch for the vectorized exp */
    int32_t *cand;  /* [cap] candidate ids */
    int32_t *tmp;   /* [cap] scratch ids */
    Pair *pairs;    /* [cap] (key, id) for the few sorts */
    int32_t *bidx;  /* [cap] bucket of each candidate */
    int64_t *win;   /* [last_n] sorted penalty window */
    Buckets buckets;
} ChainState;

/* One call of the chain. */
typedef struct {
    const float *logits;
    idx_t V;
    const int64_t *hist;
    idx_t nh;
    double *probs_out; /* [V] or NULL */
    int draw;
    /* results */
    int64_t token;
    const char *err; /* a user error (bad input), or NULL */
} Call;

void chain_seed(ChainState *st, uint64_t seed);
double chain_uniform(ChainState *st);
int chain_grow(ChainState *st, idx_t V);    /* 0, or -1 when out of memory */
void chain_free(ChainState *st);
void chain_run(ChainState *st, Call *c);    /* sets c->token, fills c->probs_out, or sets c->err */
/* log-softmax of st->lg[0..V) at `token`; the top_n best (id, logprob) into out (best first) */
double chain_logprobs(ChainState *st, idx_t V, int64_t token, idx_t top_n, idx_t *n_out);

#endif



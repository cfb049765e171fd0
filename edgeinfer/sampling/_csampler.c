/*
 * edgeinfer.sampling._csampler: Python glue for the C sampling chain (sampler_chain.c).
 *
 * One `Sampler` object owns one ChainState: parameters fixed at construction (keyword arguments),
 * its RNG (xoshiro256** seeded by splitmix64, the same generator as edgeinfer/sampling/rng.py), its
 * penalty window (ids arrive by accept / reset), and run-state buffers allocated once for the
 * vocabulary. Inputs arrive through the buffer protocol (contiguous float32 logits, int64 ids), are
 * checked here, and the chain runs with the GIL released; one object refuses to be used by two
 * threads at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "sampler_chain.h"

/* what edgeinfer/sampling/__init__.py expects (its C_API_VERSION): 2 since run() takes top_n */
#define CSAMPLER_API_VERSION 2

typedef struct {
    PyObject_HEAD
    ChainState st;
    int busy;
    Py_ssize_t last_v; /* vocabulary of the last successful run: st.lg holds its adjusted logits */
} SamplerObject;


static int get_vec(PyObject *obj, Py_buffer *view, const char *what, char kind) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = view->ndim == 1 &&
             ((kind == 'f' && strcmp(f, "f") == 0 && view->itemsize == 4) ||
              (kind == 'q' && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0) && view->itemsize == 8));
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous 1-D %s array", what,
                     kind == 'f' ? "float32" : "int64");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ids given to the window: in [0, 2^31), else ValueError (no vocabulary is larger) */
static const char BAD_ID[] = "history has token ids outside the vocabulary [0, 2**31 - 1]";

static int check_idle(SamplerObject *self) {
    if (!self->busy) return 0;
    PyErr_SetString(PyExc_RuntimeError, "this Sampler is in use by another thread");
    return -1;
}

/* the top n (id, logprob) pairs that chain_logprobs left in st.pairs, as a list; called while the
 * object is still marked busy (another thread's run would rewrite or reallocate pairs) */
static PyObject *top_list(SamplerObject *self, Py_ssize_t n) {
    PyObject *top = PyList_New(n);
    for (Py_ssize_t i = 0; top && i < n; i++) {
        PyObject *item = Py_BuildValue("(id)", (int)self->st.pairs[i].id, self->st.pairs[i].key);
        if (!item) { Py_CLEAR(top); break; }
        PyList_SET_ITEM(top, i, item);
    }
    return top;
}

/* run(logits: float32[V], *, probs_out: float64[V] | None = None, draw: bool = True, top_n: int = -1)
 *   -> int, or with top_n >= 0: (token, logprob, [(id, logprob), ...]) as logprobs() gives them, in the
 *   same call (no other thread's run can come between the draw and its logprobs) */
static PyObject *Sampler_run(SamplerObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"logits", "probs_out", "draw", "top_n", NULL};
    PyObject *lo, *po = Py_None;
    int draw = 1;
    Py_ssize_t top_n = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$Opn", kwlist, &lo, &po, &draw, &top_n)) return NULL;
    if (check_idle(self) < 0) return NULL;
    if (top_n >= 0 && !draw) {
        PyErr_SetString(PyExc_ValueError, "top_n needs a draw");
        return NULL;
    }
    Py_buffer lv, pv;
    if (get_vec(lo, &lv, "logits", 'f') < 0) return NULL;
    int have_probs = po != Py_None;
    if (have_probs) {
        if (PyObject_GetBuffer(po, &pv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0 ||
            pv.len != (Py_ssize_t)(lv.shape[0] * sizeof(double))) {
            if (!PyErr_Occurred()) { PyErr_SetString(PyExc_ValueError, "probs_out must be float64[V]"); PyBuffer_Release(&pv); }
            PyBuffer_Release(&lv);
            return NULL;
        }
    }
    Call c = {(const float *)lv.buf, lv.shape[0], have_probs ? (double *)pv.buf : NULL, draw, -1, NULL};
    PyObject *result = NULL;
    if (c.V == 0) {
        PyErr_SetString(PyExc_ValueError, "logits are empty");
    } else if (c.V > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "vocabulary larger than 2^31 is not supported");
    } else if (chain_grow(&self->st, c.V) < 0) {
        PyErr_NoMemory();
    } else {
        double lp = 0.0;
        Py_ssize_t n = 0;
        if (top_n > c.V) top_n = c.V;
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        chain_run(&self->st, &c);
        if (!c.err && top_n >= 0) lp = chain_logprobs(&self->st, c.V, c.token, top_n, &n);
        Py_END_ALLOW_THREADS
        if (c.err) {
            self->last_v = 0;
            PyErr_SetString(PyExc_ValueError, c.err);
        } else {
            self->last_v = c.V;
            if (top_n < 0) {
                result = PyLong_FromLongLong(c.token);
            } else {
                PyObject *top = top_list(self, n);
                result = top ? Py_BuildValue("(LdN)", (long long)c.token, lp, top) : NULL;
            }
        }
        self->busy = 0;
    }
    PyBuffer_Release(&lv);
    if (have_probs) PyBuffer_Release(&pv);
    return result;
}

/* greedy(logits: float32[V]) -> int: run()'s token and errors for a sampler whose parameters are
 * temperature 0, no penalty and no logit bias (the caller's choice; not checked here), without
 * keeping the adjusted logits: logprobs() after it needs a run() */
static PyObject *Sampler_greedy(SamplerObject *self, PyObject *lo) {
    if (check_idle(self) < 0) return NULL;
    Py_buffer lv;
    if (get_vec(lo, &lv, "logits", 'f') < 0) return NULL;
    PyObject *result = NULL;
    if (lv.shape[0] == 0) {
        PyErr_SetString(PyExc_ValueError, "logits are empty");
    } else if (lv.shape[0] > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "vocabulary larger than 2^31 is not supported");
    } else {
        int64_t token = -1;
        const char *err;
        self->busy = 1;
        self->last_v = 0;
        Py_BEGIN_ALLOW_THREADS
        err = chain_greedy(&self->st, (const float *)lv.buf, lv.shape[0], &token);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        if (err) PyErr_SetString(PyExc_ValueError, err);
        else result = PyLong_FromLongLong(token);
    }
    PyBuffer_Release(&lv);
    return result;
}

/* accept(token: int) -> None: one id into the penalty window (METH_O: the per-token call, no parsing) */
static PyObject *Sampler_accept(SamplerObject *self, PyObject *token) {
    long long id = PyLong_AsLongLong(token);
    if (id == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear();
        id = -1; /* too large for 64 bits: outside every vocabulary */
    }
    if (id < 0 || id > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, BAD_ID);
        return NULL;
    }
    if (check_idle(self) < 0) return NULL;
    if (window_accept(&self->st.win, (int32_t)id) < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* reset(history: int64[n] | None = None) -> None: the window as if only `history` had been given.
 * On a bad id the window is left as it was. */
static PyObject *Sampler_reset(SamplerObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"history", NULL};
    PyObject *ho = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &ho)) return NULL;
    if (check_idle(self) < 0) return NULL;
    if (ho == Py_None) {
        window_reset(&self->st.win, NULL, 0);
        Py_RETURN_NONE;
    }
    Py_buffer hv;
    if (get_vec(ho, &hv, "history", 'q') < 0) return NULL;
    const int64_t *ids = (const int64_t *)hv.buf;
    for (Py_ssize_t i = 0; i < hv.shape[0]; i++) {
        if (ids[i] < 0 || ids[i] > INT32_MAX) {
            PyBuffer_Release(&hv);
            PyErr_SetString(PyExc_ValueError, BAD_ID);
            return NULL;
        }
    }
    int rc = window_reset(&self->st.win, ids, hv.shape[0]);
    PyBuffer_Release(&hv);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* logprobs(token, top_n=0) -> (logprob, [(id, logprob), ...]) of the last run's penalised, biased
 * logits at temperature 1 over the whole vocabulary; the top_n best first (lower id on ties). */
static PyObject *Sampler_logprobs(SamplerObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"token", "top_n", NULL};
    long long token;
    Py_ssize_t top_n = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|n", kwlist, &token, &top_n)) return NULL;
    if (check_idle(self) < 0) return NULL;
    Py_ssize_t V = self->last_v;
    if (V == 0) {
        PyErr_SetString(PyExc_RuntimeError, "logprobs needs a successful run first");
        return NULL;
    }
    if (token < 0 || token >= V || top_n < 0) {
        PyErr_SetString(PyExc_ValueError, "token outside the vocabulary or negative top_n");
        return NULL;
    }
    if (top_n > V) top_n = V;
    double lp;
    Py_ssize_t n = 0;
    self->busy = 1; /* the GIL is released: a run() meanwhile would rewrite (or reallocate) lg, tmp and pairs */
    Py_BEGIN_ALLOW_THREADS
    lp = chain_logprobs(&self->st, V, token, top_n, &n);
    Py_END_ALLOW_THREADS
    PyObject *top = top_list(self, n);
    self->busy = 0;
    return top ? Py_BuildValue("(dN)", lp, top) : NULL;
}

static PyObject *Sampler_uniform(SamplerObject *self, PyObject *noargs) {
    (void)noargs;
    if (check_idle(self) < 0) return NULL;
    return PyFloat_FromDouble(chain_uniform(&self->st));
}

static void Sampler_dealloc(SamplerObject *self) {
    chain_free(&self->st);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/*
 * Sampler(*, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0,
 *         frequency_penalty=0.0, presence_penalty=0.0, penalty_last_n=0, bias_ids=None (int64[k]),
 *         bias_values=None (float64[k]), seed=0)
 * Keywords only; the defaults switch every step off. Parameters are validated by the Python
 * SamplingParams; this checks only what would be unsafe. The penalty window starts empty and keeps
 * penalty_last_n ids when a penalty is on, none otherwise.
 */
static int Sampler_init(SamplerObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                             "frequency_penalty", "presence_penalty", "penalty_last_n", "bias_ids",
                             "bias_values", "seed", NULL};
    Params p = {.temperature = 1.0, .top_p = 1.0, .min_p = 0.0, .typical_p = 1.0, .rep = 1.0, .freq = 0.0,
                .pres = 0.0, .top_k = 0};
    Py_ssize_t last_n = 0;
    PyObject *ids_o = Py_None, *vals_o = Py_None;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$dnddddddnOOK", kwlist, &p.temperature, &p.top_k, &p.top_p,
                                     &p.min_p, &p.typical_p, &p.rep, &p.freq, &p.pres, &last_n, &ids_o, &vals_o,
                                     &seed))
        return -1;
    if (check_idle(self) < 0) return -1;
    if (p.top_k < 0 || last_n < 0 || last_n > INT32_MAX || !(p.top_p > 0 && p.top_p <= 1) ||
        !(p.typical_p > 0 && p.typical_p <= 1) || !(p.min_p >= 0 && p.min_p <= 1) || !(p.temperature >= 0) ||
        !(p.rep > 0)) {
        PyErr_SetString(PyExc_ValueError, "invalid sampling parameters");
        return -1;
    }
    if ((ids_o == Py_None) != (vals_o == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "bias_ids and bias_values go together");
        return -1;
    }
    Py_buffer iv = {0}, vv = {0};
    p.n_bias = 0;
    if (ids_o != Py_None) {
        if (get_vec(ids_o, &iv, "bias_ids", 'q') < 0) return -1;
        if (PyObject_GetBuffer(vals_o, &vv, PyBUF_C_CONTIGUOUS) < 0) { PyBuffer_Release(&iv); return -1; }
        p.n_bias = iv.shape[0];
        if (vv.len != p.n_bias * (Py_ssize_t)sizeof(double)) {
            PyErr_SetString(PyExc_ValueError, "bias_values must be float64 of the same length as bias_ids");
            PyBuffer_Release(&iv); PyBuffer_Release(&vv);
            return -1;
        }
    }
    p.bias_ids = malloc((size_t)(p.n_bias + 1) * sizeof(int64_t));
    p.bias_vals = malloc((size_t)(p.n_bias + 1) * sizeof(double));
    if (!p.bias_ids || !p.bias_vals) {
        free(p.bias_ids); free(p.bias_vals);
        if (ids_o != Py_None) { PyBuffer_Release(&iv); PyBuffer_Release(&vv); }
        PyErr_NoMemory();
        return -1;
    }
    if (p.n_bias) {
        memcpy(p.bias_ids, iv.buf, (size_t)p.n_bias * sizeof(int64_t));
        memcpy(p.bias_vals, vv.buf, (size_t)p.n_bias * sizeof(double));
    }
    if (ids_o != Py_None) { PyBuffer_Release(&iv); PyBuffer_Release(&vv); }
    for (Py_ssize_t i = 0; i < p.n_bias; i++) {
        if (p.bias_ids[i] < 0) {
            free(p.bias_ids); free(p.bias_vals);
            PyErr_SetString(PyExc_ValueError, "logit_bias token ids must be >= 0");
            return -1;
        }
    }
    free(self->st.p.bias_ids); free(self->st.p.bias_vals); window_free(&self->st.win);
    self->st.p = p;
    int has_pen = p.rep != 1.0 || p.freq != 0.0 || p.pres != 0.0;
    window_init(&self->st.win, has_pen ? last_n : 0);
    self->last_v = 0;
    chain_seed(&self->st, (uint64_t)seed);
    return 0;
}

static PyMethodDef Sampler_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Sampler_run, METH_VARARGS | METH_KEYWORDS,
     "run(logits, *, probs_out=None, draw=True, top_n=-1) -> token id (argmax when temperature is 0; -1 when draw "
     "is False), or (token, logprob, top) with top_n >= 0"},
    {"greedy", (PyCFunction)Sampler_greedy, METH_O,
     "greedy(logits) -> token id: run()'s, for temperature 0 with no penalty and no logit bias; keeps no logits"},
    {"accept", (PyCFunction)Sampler_accept, METH_O,
     "accept(token) -> None: append one id to the penalty window"},
    {"reset", (PyCFunction)(void (*)(void))Sampler_reset, METH_VARARGS | METH_KEYWORDS,
     "reset(history=None) -> None: the penalty window as if only history (int64[n]) had been given"},
    {"uniform", (PyCFunction)Sampler_uniform, METH_NOARGS, "next uniform double in [0, 1) (advances the RNG)"},
    {"logprobs", (PyCFunction)(void (*)(void))Sampler_logprobs, METH_VARARGS | METH_KEYWORDS,
     "logprobs(token, top_n=0) -> (logprob, [(id, logprob)]) of the last run's adjusted logits (temperature 1)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SamplerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "edgeinfer.sampling._csampler.Sampler",
    .tp_basicsize = sizeof(SamplerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Fused sampling chain; parameters fixed at construction, buffers reused across calls.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sampler_init,
    .tp_dealloc = (destructor)Sampler_dealloc,
    .tp_methods = Sampler_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_csampler", .m_doc = "Fused sampling chain in C.", .m_size = -1,
};

PyMODINIT_FUNC PyInit__csampler(void) {
    if (PyType_Ready(&SamplerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "API_VERSION", CSAMPLER_API_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SamplerType);
    if (PyModule_AddObject(m, "Sampler", (PyObject *)&SamplerType) < 0) {
        Py_DECREF(&SamplerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

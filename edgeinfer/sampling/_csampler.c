/*
 * edgeinfer.sampling._csampler: Python glue for the C sampling chain (sampler_chain.c).
 *
 * One `Sampler` object owns one ChainState: parameters fixed at construction, its RNG
 * (xoshiro256** seeded by splitmix64, the same generator as edgeinfer/sampling/rng.py), and
 * run-state buffers allocated once for the vocabulary. Inputs arrive through the buffer protocol
 * (contiguous float32 logits, int64 history), are checked here, and the chain runs with the GIL
 * released; one object refuses to be used by two threads at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "sampler_chain.h"

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

/* sample(logits: float32[V], history: int64[n], probs_out: float64[V] | None, draw: bool) -> int */
static PyObject *Sampler_run(SamplerObject *self, PyObject *args) {
    PyObject *lo, *ho, *po;
    int draw;
    if (!PyArg_ParseTuple(args, "OOOp", &lo, &ho, &po, &draw)) return NULL;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this Sampler is in use by another thread");
        return NULL;
    }
    Py_buffer lv, hv, pv;
    if (get_vec(lo, &lv, "logits", 'f') < 0) return NULL;
    if (get_vec(ho, &hv, "history", 'q') < 0) { PyBuffer_Release(&lv); return NULL; }
    int have_probs = po != Py_None;
    if (have_probs) {
        if (PyObject_GetBuffer(po, &pv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0 ||
            pv.len != (Py_ssize_t)(lv.shape[0] * sizeof(double))) {
            if (!PyErr_Occurred()) { PyErr_SetString(PyExc_ValueError, "probs_out must be float64[V]"); PyBuffer_Release(&pv); }
            PyBuffer_Release(&lv); PyBuffer_Release(&hv);
            return NULL;
        }
    }
    Call c = {(const float *)lv.buf, lv.shape[0], (const int64_t *)hv.buf, hv.shape[0],
              have_probs ? (double *)pv.buf : NULL, draw, -1, NULL};
    PyObject *result = NULL;
    if (c.V == 0) {
        PyErr_SetString(PyExc_ValueError, "logits are empty");
    } else if (c.V > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "vocabulary larger than 2^31 is not supported");
    } else if (chain_grow(&self->st, c.V) < 0) {
        PyErr_NoMemory();
    } else {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        chain_run(&self->st, &c);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        if (c.err) {
            self->last_v = 0;
            PyErr_SetString(PyExc_ValueError, c.err);
        } else {
            self->last_v = c.V;
            result = PyLong_FromLongLong(c.token);
        }
    }
    PyBuffer_Release(&lv);
    PyBuffer_Release(&hv);
    if (have_probs) PyBuffer_Release(&pv);
    return result;
}

/* logprobs(token, top_n) -> (logprob, [(id, logprob), ...]) of the last run's penalised, biased
 * logits at temperature 1 over the whole vocabulary; the top_n best first (lower id on ties). */
static PyObject *Sampler_logprobs(SamplerObject *self, PyObject *args) {
    long long token;
    Py_ssize_t top_n;
    if (!PyArg_ParseTuple(args, "Ln", &token, &top_n)) return NULL;
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
    Py_BEGIN_ALLOW_THREADS
    lp = chain_logprobs(&self->st, V, token, top_n, &n);
    Py_END_ALLOW_THREADS
    PyObject *top = PyList_New(n);
    if (!top) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = Py_BuildValue("(id)", (int)self->st.pairs[i].id, self->st.pairs[i].key);
        if (!item) { Py_DECREF(top); return NULL; }
        PyList_SET_ITEM(top, i, item);
    }
    return Py_BuildValue("(dN)", lp, top);
}

static PyObject *Sampler_uniform(SamplerObject *self, PyObject *noargs) {
    (void)noargs;
    return PyFloat_FromDouble(chain_uniform(&self->st));
}

static void Sampler_dealloc(SamplerObject *self) {
    chain_free(&self->st);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Sampler(temperature, top_k, top_p, min_p, typical_p, rep, freq, pres, last_n, bias_ids, bias_vals, seed)
 * Parameters are validated by the Python SamplingParams; this checks only what would be unsafe. */
static int Sampler_init(SamplerObject *self, PyObject *args, PyObject *kwds) {
    (void)kwds;
    Params p;
    PyObject *ids_o, *vals_o;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "dnddddddnOOK", &p.temperature, &p.top_k, &p.top_p, &p.min_p, &p.typical_p,
                          &p.rep, &p.freq, &p.pres, &p.last_n, &ids_o, &vals_o, &seed))
        return -1;
    if (p.top_k < 0 || p.last_n < 0 || !(p.top_p > 0 && p.top_p <= 1) || !(p.typical_p > 0 && p.typical_p <= 1) ||
        !(p.min_p >= 0 && p.min_p <= 1) || !(p.temperature >= 0) || !(p.rep > 0)) {
        PyErr_SetString(PyExc_ValueError, "invalid sampling parameters");
        return -1;
    }
    Py_buffer iv, vv;
    if (get_vec(ids_o, &iv, "bias ids", 'q') < 0) return -1;
    if (PyObject_GetBuffer(vals_o, &vv, PyBUF_C_CONTIGUOUS) < 0) { PyBuffer_Release(&iv); return -1; }
    p.n_bias = iv.shape[0];
    if (vv.len != p.n_bias * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "bias values must be float64 of the same length as ids");
        PyBuffer_Release(&iv); PyBuffer_Release(&vv);
        return -1;
    }
    p.bias_ids = malloc((size_t)(p.n_bias + 1) * sizeof(int64_t));
    p.bias_vals = malloc((size_t)(p.n_bias + 1) * sizeof(double));
    int64_t *win = malloc((size_t)(p.last_n + 1) * sizeof(int64_t));
    if (!p.bias_ids || !p.bias_vals || !win) {
        free(p.bias_ids); free(p.bias_vals); free(win);
        PyBuffer_Release(&iv); PyBuffer_Release(&vv);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(p.bias_ids, iv.buf, (size_t)p.n_bias * sizeof(int64_t));
    memcpy(p.bias_vals, vv.buf, (size_t)p.n_bias * sizeof(double));
    PyBuffer_Release(&iv);
    PyBuffer_Release(&vv);
    for (Py_ssize_t i = 0; i < p.n_bias; i++) {
        if (p.bias_ids[i] < 0) {
            free(p.bias_ids); free(p.bias_vals); free(win);
            PyErr_SetString(PyExc_ValueError, "logit_bias token ids must be >= 0");
            return -1;
        }
    }
    free(self->st.p.bias_ids); free(self->st.p.bias_vals); free(self->st.win);
    self->st.p = p;
    self->st.win = win;
    chain_seed(&self->st, (uint64_t)seed);
    return 0;
}

static PyMethodDef Sampler_methods[] = {
    {"run", (PyCFunction)Sampler_run, METH_VARARGS,
     "run(logits, history, probs_out, draw) -> token id (argmax when temperature is 0)"},
    {"uniform", (PyCFunction)Sampler_uniform, METH_NOARGS, "next uniform double in [0, 1) (advances the RNG)"},
    {"logprobs", (PyCFunction)Sampler_logprobs, METH_VARARGS,
     "logprobs(token, top_n) -> (logprob, [(id, logprob)]) of the last run's adjusted logits (temperature 1)"},
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
    Py_INCREF(&SamplerType);
    if (PyModule_AddObject(m, "Sampler", (PyObject *)&SamplerType) < 0) {
        Py_DECREF(&SamplerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

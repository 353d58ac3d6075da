/* The work queues' per-message loops, compiled: the same functions as workers/workqueues/purecore.py, with the same
 * results and the same changes to the dicts passed in, for every input (tests/test_qcore.py compares them on random
 * queues).  purecore.py is the reference and says what each does; this file says only how.
 *
 * The state is the model's own dicts and tuples, touched only through the C API's checked calls: an argument of
 * the wrong type raises (TypeError, KeyError as the Python would), it never reads out of bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *str_acked;   /* "acked": the fate of an acked lease */

static const char b64url[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/* b64url_chunks(raw, width) */
static PyObject *b64url_chunks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer raw;
    Py_ssize_t width;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "b64url_chunks(raw, width)");
        return NULL;
    }
    width = PyLong_AsSsize_t(args[1]);
    if (width == -1 && PyErr_Occurred())
        return NULL;
    if (width <= 0) {
        PyErr_SetString(PyExc_ValueError, "width must be positive");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &raw, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n = raw.len / width;
    Py_ssize_t chars = (4 * width + 2) / 3;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto done;
    const unsigned char *b = raw.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *text = PyUnicode_New(chars, 127);
        if (text == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        Py_UCS1 *o = PyUnicode_1BYTE_DATA(text);
        const unsigned char *c = b + k * width;
        Py_ssize_t i = 0, j = 0;
        for (; i + 3 <= width; i += 3) {
            unsigned v = (unsigned)c[i] << 16 | (unsigned)c[i + 1] << 8 | c[i + 2];
            o[j++] = b64url[v >> 18];
            o[j++] = b64url[(v >> 12) & 63];
            o[j++] = b64url[(v >> 6) & 63];
            o[j++] = b64url[v & 63];
        }
        if (width - i == 1) {
            o[j++] = b64url[c[i] >> 2];
            o[j++] = b64url[(c[i] & 3) << 4];
        } else if (width - i == 2) {
            unsigned v = (unsigned)c[i] << 8 | c[i + 1];
            o[j++] = b64url[v >> 10];
            o[j++] = b64url[(v >> 4) & 63];
            o[j++] = b64url[(v & 15) << 2];
        }
        PyList_SET_ITEM(out, k, text);
    }
done:
    PyBuffer_Release(&raw);
    return out;
}

/* The fast sequences of ``seqs`` and ``receipts`` (new references), and how many pairs zip() makes of them.
 * -> -1 with an exception set, nothing held. */
static Py_ssize_t pairs(PyObject *seqs_arg, PyObject *receipts_arg, PyObject **seqs, PyObject **receipts)
{
    *seqs = PySequence_Fast(seqs_arg, "seqs must be a sequence");
    if (*seqs == NULL)
        return -1;
    *receipts = PySequence_Fast(receipts_arg, "receipts must be a sequence");
    if (*receipts == NULL) {
        Py_CLEAR(*seqs);
        return -1;
    }
    return Py_MIN(PySequence_Fast_GET_SIZE(*seqs), PySequence_Fast_GET_SIZE(*receipts));
}

/* grant(leases, leased, deliveries, seqs, receipts, granted, deadline, visibility, holder) -> redeliveries */
static PyObject *grant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9 || !PyDict_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "grant(leases, leased, deliveries, seqs, receipts, granted, deadline, visibility, holder)");
        return NULL;
    }
    PyObject *leases = args[0], *leased = args[1], *deliveries = args[2], *seqs, *receipts;
    Py_ssize_t n = pairs(args[3], args[4], &seqs, &receipts);
    if (n < 0)
        return NULL;
    long again = 0;
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *seq = PySequence_Fast_GET_ITEM(seqs, i);
        PyObject *receipt = PySequence_Fast_GET_ITEM(receipts, i);
        PyObject *lease = PyTuple_Pack(5, seq, args[5], args[6], args[7], args[8]);
        if (lease == NULL)
            goto fail;
        int err = PyDict_SetItem(leases, receipt, lease);
        Py_DECREF(lease);
        if (err < 0 || PyDict_SetItem(leased, seq, receipt) < 0)
            goto fail;
        PyObject *d = PyDict_GetItemWithError(deliveries, seq);   /* borrowed */
        PyObject *next;
        if (d == NULL) {
            if (PyErr_Occurred())
                goto fail;
            next = Py_NewRef(one);
        } else {
            int was = PyObject_IsTrue(d);
            if (was < 0)
                goto fail;
            again += was;
            next = PyNumber_Add(d, one);
            if (next == NULL)
                goto fail;
        }
        err = PyDict_SetItem(deliveries, seq, next);
        Py_DECREF(next);
        if (err < 0)
            goto fail;
    }
    Py_DECREF(one);
    Py_DECREF(seqs);
    Py_DECREF(receipts);
    return PyLong_FromLong(again);
fail:
    Py_XDECREF(one);
    Py_DECREF(seqs);
    Py_DECREF(receipts);
    return NULL;
}

/* A tuple item, or IndexError/TypeError as subscripting would raise. */
static PyObject *item(PyObject *tuple, Py_ssize_t i)
{
    if (PyTuple_CheckExact(tuple) && i < PyTuple_GET_SIZE(tuple))
        return PyTuple_GET_ITEM(tuple, i);
    PyObject *index = PyLong_FromSsize_t(i);
    if (index == NULL)
        return NULL;
    PyObject *got = PyObject_GetItem(tuple, index);   /* raises what m[i] raises; otherwise a sequence we do not
                                                         keep: not reached by the model's own tuples */
    Py_DECREF(index);
    if (got != NULL) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_TypeError, "expected the model's tuple");
    }
    return NULL;
}

/* delivered(store, deliveries, seqs, receipts, ms) -> the D_* tuples */
static PyObject *delivered(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "delivered(store, deliveries, seqs, receipts, ms)");
        return NULL;
    }
    PyObject *store = args[0], *deliveries = args[1], *ms = args[4], *seqs, *receipts;
    Py_ssize_t n = pairs(args[2], args[3], &seqs, &receipts);
    if (n < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *seq = PySequence_Fast_GET_ITEM(seqs, i);
        PyObject *m = PyObject_GetItem(store, seq);
        if (m == NULL)
            goto fail;
        PyObject *count = PyObject_GetItem(deliveries, seq);
        PyObject *f[9] = {NULL};
        int ok = count != NULL;
        for (int k = 1; ok && k <= 7; k++)
            ok = (f[k] = item(m, k)) != NULL;
        PyObject *enqueued = ok ? PyNumber_FloorDivide(f[5], ms) : NULL;
        PyObject *d = enqueued == NULL ? NULL : PyTuple_Pack(9, f[1], PySequence_Fast_GET_ITEM(receipts, i), f[2],
                                                             f[3], count, f[4], enqueued, f[6], f[7]);
        Py_XDECREF(enqueued);
        Py_XDECREF(count);
        Py_DECREF(m);
        if (d == NULL)
            goto fail;
        int err = PyList_Append(out, d);
        Py_DECREF(d);
        if (err < 0)
            goto fail;
    }
    Py_DECREF(seqs);
    Py_DECREF(receipts);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seqs);
    Py_DECREF(receipts);
    return NULL;
}

/* dict.pop(key) (KeyError if missing) or, with a default, dict.pop(key, default) */
static PyObject *pop(PyObject *dict, PyObject *key, PyObject *dflt)
{
    PyObject *value = PyDict_GetItemWithError(dict, key);
    if (value == NULL) {
        if (PyErr_Occurred())
            return NULL;
        if (dflt != NULL)
            return Py_NewRef(dflt);
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_INCREF(value);
    if (PyDict_DelItem(dict, key) < 0) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

/* ack_run(leases, leased, store, deliveries, receipts, start, now, fates, done, results, acked) -> (stop, size) */
static PyObject *ack_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11 || !PyDict_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])
            || !PyDict_Check(args[3]) || !PyDict_Check(args[7]) || !PyList_Check(args[8])
            || !PyList_Check(args[9])) {
        PyErr_SetString(PyExc_TypeError, "ack_run(leases, leased, store, deliveries, receipts, start, now, "
                                         "fates, done, results, acked)");
        return NULL;
    }
    PyObject *leases = args[0], *leased = args[1], *store = args[2], *deliveries = args[3];
    PyObject *now = args[6], *fates = args[7], *done = args[8], *results = args[9], *acked = args[10];
    Py_ssize_t i = PyLong_AsSsize_t(args[5]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0) {
        PyErr_SetString(PyExc_ValueError, "start must not be negative");
        return NULL;
    }
    /* a list is its own fast sequence: the same object, whose items this loop holds while it uses them */
    PyObject *receipts = PySequence_Fast(args[4], "receipts must be a sequence");
    if (receipts == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) {
        Py_DECREF(receipts);
        return NULL;
    }
    long long size = 0;
    for (; i < PySequence_Fast_GET_SIZE(receipts); i++) {
        PyObject *receipt = PySequence_Fast_GET_ITEM(receipts, i);
        if (!PyUnicode_CheckExact(receipt))
            break;
        PyObject *lease = PyDict_GetItemWithError(leases, receipt);   /* borrowed */
        if (lease == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        Py_INCREF(receipt);   /* the list may lose it to a __del__ of what the dicts let go: keep it */
        Py_INCREF(lease);
        PyObject *deadline = item(lease, 2);
        int over = deadline == NULL ? -1 : PyObject_RichCompareBool(deadline, now, Py_LE);
        int live = over < 0 ? -1 : !over;
        PyObject *seq = live > 0 ? item(lease, 0) : NULL;
        Py_XINCREF(seq);
        Py_DECREF(lease);
        if (live <= 0 || seq == NULL) {
            Py_DECREF(receipt);
            if (live == 0)
                break;
            goto fail;
        }
        PyObject *count = NULL, *fate = NULL, *m = NULL;
        int err = PyDict_DelItem(leases, receipt) < 0 || PyDict_DelItem(leased, seq) < 0
            || (count = pop(deliveries, seq, zero)) == NULL
            || (fate = PyTuple_Pack(3, str_acked, seq, count)) == NULL
            || PyDict_SetItem(fates, receipt, fate) < 0
            || (m = pop(store, seq, NULL)) == NULL;
        Py_XDECREF(count);
        Py_XDECREF(fate);
        Py_DECREF(seq);
        PyObject *data = err ? NULL : item(m, 3);
        Py_ssize_t len = data == NULL ? -1 : PyObject_Size(data);
        Py_XDECREF(m);
        if (len < 0 || PyList_Append(done, receipt) < 0 || PyList_Append(results, acked) < 0) {
            Py_DECREF(receipt);
            goto fail;
        }
        Py_DECREF(receipt);
        size += len;
    }
    Py_DECREF(zero);
    Py_DECREF(receipts);
    return Py_BuildValue("(nL)", i, size);
fail:
    Py_DECREF(zero);
    Py_DECREF(receipts);
    return NULL;
}

/* A str's UTF-8 when it is ASCII (ids and receipts are base64url): anything else takes the Python render. */
static const char *ascii(PyObject *s, Py_ssize_t *len)
{
    if (!PyUnicode_CheckExact(s) || !PyUnicode_IS_ASCII(s))
        return NULL;
    *len = PyUnicode_GET_LENGTH(s);
    return (const char *)PyUnicode_1BYTE_DATA(s);
}

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
} out_buf;

static int put(out_buf *o, const char *s, Py_ssize_t n)
{
    if (o->len + n > o->cap) {
        Py_ssize_t cap = Py_MAX(o->cap * 2, o->len + n + 256);
        char *grown = PyMem_Realloc(o->buf, cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        o->buf = grown;
        o->cap = cap;
    }
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    return 0;
}

static int put_int(out_buf *o, long long v)
{
    char digits[24];
    int n = snprintf(digits, sizeof digits, "%lld", v);
    return put(o, digits, n);
}

#define PUT(lit) put(&o, lit, sizeof(lit) - 1)

/* One delivery in the common case, as ndjson_ops._message writes it.  -> 1 written, 0 not the common case. */
static int render_one(out_buf *o_, PyObject *m, PyObject *kind_json)
{
    if (!PyTuple_CheckExact(m) || PyTuple_GET_SIZE(m) != 9)
        return 0;
    PyObject *kind = PyTuple_GET_ITEM(m, 2), *data = PyTuple_GET_ITEM(m, 3), *reason = PyTuple_GET_ITEM(m, 7);
    if (!PyLong_CheckExact(kind) || PyObject_RichCompareBool(kind, kind_json, Py_EQ) != 1
            || !PyBytes_CheckExact(data) || !(reason == Py_None || (PyUnicode_CheckExact(reason)
                                                                    && PyUnicode_GET_LENGTH(reason) == 0)))
        return 0;
    Py_ssize_t id_len = 0, receipt_len = 0;
    const char *id = ascii(PyTuple_GET_ITEM(m, 0), &id_len);
    const char *receipt = ascii(PyTuple_GET_ITEM(m, 1), &receipt_len);
    if (id == NULL || receipt == NULL)
        return 0;
    long long n[3];
    const int at[3] = {4, 5, 6};
    for (int k = 0; k < 3; k++) {
        PyObject *v = PyTuple_GET_ITEM(m, at[k]);
        int overflow;
        if (!PyLong_CheckExact(v))
            return 0;
        n[k] = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (n[k] == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
    }
    out_buf o = *o_;
    int err = PUT("{\"id\":\"") || put(&o, id, id_len) || PUT("\",\"receipt\":\"") || put(&o, receipt, receipt_len)
        || PUT("\",\"data\":") || put(&o, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data)) || PUT(",\"deliveries\":")
        || put_int(&o, n[0]) || PUT(",\"priority\":") || put_int(&o, n[1]) || PUT(",\"enqueued_at\":")
        || put_int(&o, n[2]) || PUT("}");
    *o_ = o;
    return err ? -1 : 1;
}

/* render_deliveries(messages, kind_json, render) -> bytes */
static PyObject *render_deliveries(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "render_deliveries(messages, kind_json, render)");
        return NULL;
    }
    PyObject *messages = args[0];
    out_buf o = {NULL, 0, 0};
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(messages); i++) {
        if (i && put(&o, ",", 1) < 0)
            goto fail;
        PyObject *m = PyList_GET_ITEM(messages, i);
        int done = render_one(&o, m, args[1]);
        if (done < 0)
            goto fail;
        if (done)
            continue;
        Py_INCREF(m);
        PyObject *text = PyObject_CallOneArg(args[2], m);
        Py_DECREF(m);
        if (text == NULL)
            goto fail;
        if (!PyBytes_Check(text)) {
            PyErr_Format(PyExc_TypeError, "render returned %.100s, not bytes", Py_TYPE(text)->tp_name);
            Py_DECREF(text);
            goto fail;
        }
        int err = put(&o, PyBytes_AS_STRING(text), PyBytes_GET_SIZE(text));
        Py_DECREF(text);
        if (err < 0)
            goto fail;
    }
    PyObject *out = PyBytes_FromStringAndSize(o.buf ? o.buf : "", o.len);
    PyMem_Free(o.buf);
    return out;
fail:
    PyMem_Free(o.buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"b64url_chunks", (PyCFunction)(void (*)(void))b64url_chunks, METH_FASTCALL,
     "b64url_chunks(raw, width) -> texts: see workers/workqueues/purecore.py"},
    {"grant", (PyCFunction)(void (*)(void))grant, METH_FASTCALL,
     "grant(leases, leased, deliveries, seqs, receipts, granted, deadline, visibility, holder) -> redeliveries"},
    {"delivered", (PyCFunction)(void (*)(void))delivered, METH_FASTCALL,
     "delivered(store, deliveries, seqs, receipts, ms) -> deliveries: see workers/workqueues/purecore.py"},
    {"ack_run", (PyCFunction)(void (*)(void))ack_run, METH_FASTCALL,
     "ack_run(leases, leased, store, deliveries, receipts, start, now, fates, done, results, acked) -> (stop, size)"},
    {"render_deliveries", (PyCFunction)(void (*)(void))render_deliveries, METH_FASTCALL,
     "render_deliveries(messages, kind_json, render) -> bytes: see workers/workqueues/purecore.py"},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *module)
{
    if (str_acked == NULL && (str_acked = PyUnicode_InternFromString("acked")) == NULL)
        return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "workers.workqueues._qcore",
    .m_doc = "The work queues' per-message loops, compiled (see workers/workqueues/purecore.py).",
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__qcore(void)
{
    return PyModuleDef_Init(&module_def);
}

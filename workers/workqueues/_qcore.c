/* The work queues' per-message loops, compiled: the same functions as workers/workqueues/purecore.py, with the same
 * results and the same changes to the dicts passed in, for every input (tests/test_qcore.py compares them on random
 * queues).  purecore.py is the reference and says what each does; this file says only how.
 *
 * The state is the model's own dicts and tuples, touched only through the C API's checked calls: an argument of
 * the wrong type raises (TypeError, KeyError as the Python would), it never reads out of bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Untrack a new tuple that holds nothing the collector follows, as the collector itself would at its next young
 * pass (CPython's _PyTuple_MaybeUntrack, the same test).  A queue's message and lease tuples live for as long as
 * their message is queued: left tracked, each young pass walks the tuples made since the last one only to
 * untrack them, ~0.2 µs a pushed message in a growing queue. */
static void untrack_if_atomic(PyObject *t)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        PyObject *v = PyTuple_GET_ITEM(t, i);
        if (PyObject_IS_GC(v) && (!PyTuple_CheckExact(v) || PyObject_GC_IsTracked(v)))
            return;
    }
    PyObject_GC_UnTrack(t);
}

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
        untrack_if_atomic(lease);
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
    PyObject *out = PyList_New(n), *wall = NULL, *enqueued = NULL;
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
        if (ok && f[5] != wall) {   /* a run pushed together shares its wall clock's int: one division for it */
            Py_XSETREF(enqueued, PyNumber_FloorDivide(f[5], ms));
            /* held, so that no other object can take its address while it is compared against */
            Py_XSETREF(wall, enqueued == NULL ? NULL : Py_NewRef(f[5]));
            ok = enqueued != NULL;
        }
        PyObject *d = ok ? PyTuple_Pack(9, f[1], PySequence_Fast_GET_ITEM(receipts, i), f[2], f[3], count, f[4],
                                        enqueued, f[6], f[7]) : NULL;
        Py_XDECREF(count);
        Py_DECREF(m);
        if (d == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, d);
    }
    Py_XDECREF(enqueued);
    Py_XDECREF(wall);
    Py_DECREF(seqs);
    Py_DECREF(receipts);
    return out;
fail:
    Py_XDECREF(enqueued);
    Py_XDECREF(wall);
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

/* ack_run(leases, leased, store, deliveries, receipts, start, now, done, results, acked) -> (stop, size) */
static PyObject *ack_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10 || !PyDict_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])
            || !PyDict_Check(args[3]) || !PyList_Check(args[7]) || !PyList_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "ack_run(leases, leased, store, deliveries, receipts, start, now, "
                                         "done, results, acked)");
        return NULL;
    }
    PyObject *leases = args[0], *leased = args[1], *store = args[2], *deliveries = args[3];
    PyObject *now = args[6], *done = args[7], *results = args[8], *acked = args[9];
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
        PyObject *count = NULL, *m = NULL;
        int err = PyDict_DelItem(leases, receipt) < 0 || PyDict_DelItem(leased, seq) < 0
            || (count = pop(deliveries, seq, Py_None)) == NULL
            || (m = pop(store, seq, NULL)) == NULL;
        Py_XDECREF(count);
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
    Py_DECREF(receipts);
    return Py_BuildValue("(nL)", i, size);
fail:
    Py_DECREF(receipts);
    return NULL;
}

/* store_run(store, seq, ids, kind, datas, priority, wall) -> size */
static PyObject *store_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !PyDict_Check(args[0]) || !PyList_Check(args[2]) || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "store_run(store, seq, ids, kind, datas, priority, wall)");
        return NULL;
    }
    PyObject *store = args[0], *ids = args[2], *datas = args[4];
    long long seq = PyLong_AsLongLong(args[1]);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    PyObject *empty = PyUnicode_New(0, 0), *zero = PyLong_FromLong(0);
    long long size = 0;
    int err = empty == NULL || zero == NULL;
    /* the lists' sizes are read each time: replacing a value in the store releases it, which could run Python
     * code that changes them */
    for (Py_ssize_t i = 0; !err && i < PyList_GET_SIZE(datas); i++) {
        if (i >= PyList_GET_SIZE(ids)) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            err = 1;
            break;
        }
        PyObject *data = PyList_GET_ITEM(datas, i);
        Py_ssize_t len = PyObject_Size(data);
        PyObject *key = len < 0 ? NULL : PyLong_FromLongLong(seq + i);
        PyObject *m = key == NULL ? NULL : PyTuple_New(9);
        if (m == NULL) {
            Py_XDECREF(key);
            err = 1;
            break;
        }
        PyObject *items[9] = {key, PyList_GET_ITEM(ids, i), args[3], data, args[5], args[6], empty, empty, zero};
        for (int k = 0; k < 9; k++)
            PyTuple_SET_ITEM(m, k, Py_NewRef(items[k]));
        untrack_if_atomic(m);
        err = PyDict_SetItem(store, key, m) < 0;
        Py_DECREF(m);
        Py_DECREF(key);
        size += len;
    }
    Py_XDECREF(empty);
    Py_XDECREF(zero);
    return err ? NULL : PyLong_FromLongLong(size);
}

/* store_put(store, messages) -> size */
static PyObject *store_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "store_put(store, messages)");
        return NULL;
    }
    PyObject *store = args[0], *messages = args[1];
    long long size = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(messages); i++) {
        PyObject *m = PyList_GET_ITEM(messages, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) < 4) {
            PyErr_SetString(PyExc_TypeError, "a message is a tuple (seq, id, kind, data, ...)");
            return NULL;
        }
        Py_INCREF(m);   /* replacing a value in the store may run Python code that empties the list */
        Py_ssize_t len = PyObject_Size(PyTuple_GET_ITEM(m, 3));
        if (len >= 0 && PyTuple_CheckExact(m))
            untrack_if_atomic(m);
        int err = len < 0 || PyDict_SetItem(store, PyTuple_GET_ITEM(m, 0), m) < 0;
        Py_DECREF(m);
        if (err)
            return NULL;
        size += len;
    }
    return PyLong_FromLongLong(size);
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

/* Decimal digits by hand: snprintf's format parsing cost more than the rest of a delivery's rendering. */
static int put_int(out_buf *o, long long v)
{
    char digits[24];
    char *end = digits + sizeof digits, *p = end;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        *--p = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--p = '-';
    return put(o, p, end - p);
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

/* flat_dumps: marshal's format 4 without its back-references.  marshal.dumps enters every object that something
 * else also references (a receipt kept as a lease's key, a stored message's data, a sequence number held by a dict)
 * in a table, so that a second sight of it can be written as a reference; a journal record has no second sights
 * worth the table, which costs more than all the rest of the writing (each entry is a hash-table insertion and an
 * allocation).  The format allows leaving them out: marshal.loads reads this as it reads marshal.dumps's own.
 * The types journal records hold are written here; anything else (a set, a subclass, an int past 64 bits, a str
 * with a lone surrogate, nesting past FLAT_DEPTH) leaves the whole object to marshal.dumps. */
#define FLAT_DEPTH 64
#define FLAT_KEEP (1 << 22)   /* the scratch buffer is kept between calls up to this size */

/* A pushcol record can carry message m: an id of `width` ASCII characters, no dead letter's reason, source or
 * redrive.  -1 with an exception if m is not a message tuple. */
static int carried(PyObject *m, Py_ssize_t width)
{
    if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 9) {
        PyErr_SetString(PyExc_TypeError, "a message is a tuple of 9");
        return -1;
    }
    PyObject *id = PyTuple_GET_ITEM(m, 1), *reason = PyTuple_GET_ITEM(m, 6), *source = PyTuple_GET_ITEM(m, 7),
             *redriven = PyTuple_GET_ITEM(m, 8);
    return PyUnicode_CheckExact(id) && PyUnicode_IS_ASCII(id) && PyUnicode_GET_LENGTH(id) == width
        && PyUnicode_CheckExact(reason) && PyUnicode_GET_LENGTH(reason) == 0
        && PyUnicode_CheckExact(source) && PyUnicode_GET_LENGTH(source) == 0
        && PyLong_CheckExact(redriven) && PyObject_Not(redriven) == 1;
}

/* The pushcol record of messages[a:b], a run that `carried` each of. */
static PyObject *pushcol(PyObject *messages, Py_ssize_t a, Py_ssize_t b, Py_ssize_t width)
{
    PyObject *first = PyList_GET_ITEM(messages, a);
    PyObject *ids = PyUnicode_New((b - a) * width, 127), *datas = PyList_New(b - a), *record = NULL;
    if (ids != NULL && datas != NULL) {
        Py_UCS1 *out = PyUnicode_1BYTE_DATA(ids);
        for (Py_ssize_t i = a; i < b; i++) {
            PyObject *m = PyList_GET_ITEM(messages, i);
            memcpy(out + (i - a) * width, PyUnicode_1BYTE_DATA(PyTuple_GET_ITEM(m, 1)), (size_t)width);
            PyList_SET_ITEM(datas, i - a, Py_NewRef(PyTuple_GET_ITEM(m, 3)));
        }
        record = Py_BuildValue("(sOOOOOOO)", "pushcol", Py_None, PyTuple_GET_ITEM(first, 0), ids,
                               PyTuple_GET_ITEM(first, 2), datas, PyTuple_GET_ITEM(first, 4),
                               PyTuple_GET_ITEM(first, 5));
    }
    Py_XDECREF(ids);
    Py_XDECREF(datas);
    return record;
}

/* Append to records the pushes record of messages[a:b] (none if empty). */
static int pushes(PyObject *records, PyObject *messages, Py_ssize_t a, Py_ssize_t b)
{
    if (a == b)
        return 0;
    PyObject *odd = PyList_GetSlice(messages, a, b);
    PyObject *record = odd == NULL ? NULL : Py_BuildValue("(sOOO)", "pushes", Py_None, odd, Py_None);
    int err = record == NULL || PyList_Append(records, record) < 0;
    Py_XDECREF(odd);
    Py_XDECREF(record);
    return err ? -1 : 0;
}

/* A run, messages[run:i], ends: a pushcol record if it is at least `least` long (after a pushes record of
 * messages[*pending:run]), else it stays pending. */
static int end_run(PyObject *records, PyObject *messages, Py_ssize_t *pending, Py_ssize_t run, Py_ssize_t i,
                   Py_ssize_t width, Py_ssize_t least)
{
    if (run < 0 || i - run < least)
        return 0;
    if (pushes(records, messages, *pending, run) < 0)
        return -1;
    PyObject *record = pushcol(messages, run, i, width);
    int err = record == NULL || PyList_Append(records, record) < 0;
    Py_XDECREF(record);
    *pending = i;
    return err ? -1 : 0;
}

/* snapshot_pushes(messages, width, least) -> records.  What is not yet in a record is always one slice,
 * messages[pending:i]: the pending ones, then the open run (from `run`).  The list's items are read as they are:
 * nothing here runs Python code (the comparisons are of ints, which the tuples keep alive). */
static PyObject *snapshot_pushes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[0]) || !PyLong_Check(args[1]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "snapshot_pushes(messages, width, least)");
        return NULL;
    }
    PyObject *messages = args[0];
    Py_ssize_t width = PyLong_AsSsize_t(args[1]), least = PyLong_AsSsize_t(args[2]), n = PyList_GET_SIZE(messages);
    if ((width == -1 || least == -1) && PyErr_Occurred())
        return NULL;
    if (width < 0) {
        PyErr_SetString(PyExc_ValueError, "width must not be negative");
        return NULL;
    }
    PyObject *records = PyList_New(0);
    if (records == NULL)
        return NULL;
    Py_ssize_t pending = 0, run = -1;   /* the open run's first (-1: none) */
    long long next = 0;                 /* the sequence number the open run takes next */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(messages, i);
        int ok = carried(m, width);
        if (ok < 0)
            goto fail;
        long long seq = 0;
        if (ok) {
            seq = PyLong_AsLongLong(PyTuple_GET_ITEM(m, 0));
            if (seq == -1 && PyErr_Occurred())
                goto fail;
        }
        if (run >= 0) {
            PyObject *first = PyList_GET_ITEM(messages, run);
            int same = ok && seq == next;
            for (int k = 2; same > 0 && k <= 5; k += k == 2 ? 2 : 1)   /* kind, priority, enqueued */
                same = PyObject_RichCompareBool(PyTuple_GET_ITEM(m, k), PyTuple_GET_ITEM(first, k), Py_EQ);
            if (same < 0)
                goto fail;
            if (same) {
                next++;
                continue;
            }
            if (end_run(records, messages, &pending, run, i, width, least) < 0)
                goto fail;
            run = -1;
        }
        if (ok) {
            run = i;
            next = seq + 1;
        }
    }
    if (end_run(records, messages, &pending, run, n, width, least) < 0 || pushes(records, messages, pending, n) < 0)
        goto fail;
    return records;
fail:
    Py_DECREF(records);
    return NULL;
}

static PyObject *marshal_dumps;   /* marshal.dumps, for what flat() leaves to it */
static out_buf scratch;

static int put_byte(out_buf *o, char c)
{
    if (o->len < o->cap) {
        o->buf[o->len++] = c;
        return 0;
    }
    return put(o, &c, 1);
}

static int put_u32(out_buf *o, char type, uint32_t v)
{
    char b[5] = {type, (char)(v & 0xff), (char)((v >> 8) & 0xff), (char)((v >> 16) & 0xff), (char)(v >> 24)};
    return put(o, b, 5);
}

/* An int of up to 64 bits: 'i' and 4 bytes where it fits in 32, else 'l', the count of 15-bit digits (negative
 * for a negative number) and the digits, least significant first (marshal's w_PyLong).  -> 1, 0 too big, -1 */
static int flat_int(out_buf *o, PyObject *v)
{
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow)
        return 0;
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (x >= INT32_MIN && x <= INT32_MAX)
        return put_u32(o, 'i', (uint32_t)(int32_t)x) < 0 ? -1 : 1;
    unsigned long long m = x < 0 ? (unsigned long long)(-(x + 1)) + 1 : (unsigned long long)x;
    char digits[10];
    int n = 0;
    for (; m; m >>= 15, n += 2) {
        digits[n] = (char)(m & 0xff);
        digits[n + 1] = (char)((m >> 8) & 0x7f);
    }
    int32_t count = x < 0 ? -(n / 2) : n / 2;
    return put_u32(o, 'l', (uint32_t)count) < 0 || put(o, digits, n) < 0 ? -1 : 1;
}

/* -> 1 written, 0 a value for marshal.dumps, -1 an error */
static int flat(out_buf *o, PyObject *v, int depth)
{
    if (v == Py_None)
        return put_byte(o, 'N') < 0 ? -1 : 1;
    if (v == Py_True)
        return put_byte(o, 'T') < 0 ? -1 : 1;
    if (v == Py_False)
        return put_byte(o, 'F') < 0 ? -1 : 1;
    if (PyLong_CheckExact(v))
        return flat_int(o, v);
    if (PyUnicode_CheckExact(v)) {
        Py_ssize_t n;
        const char *s;
        if (PyUnicode_IS_ASCII(v)) {
            n = PyUnicode_GET_LENGTH(v);
            s = (const char *)PyUnicode_1BYTE_DATA(v);
            if (n < 256) {
                char head[2] = {'z', (char)n};
                return put(o, head, 2) < 0 || put(o, s, n) < 0 ? -1 : 1;
            }
            if (n > INT32_MAX)
                return 0;
            return put_u32(o, 'a', (uint32_t)n) < 0 || put(o, s, n) < 0 ? -1 : 1;
        }
        s = PyUnicode_AsUTF8AndSize(v, &n);
        if (s == NULL) {   /* a lone surrogate: marshal writes it with surrogatepass */
            PyErr_Clear();
            return 0;
        }
        if (n > INT32_MAX)
            return 0;
        return put_u32(o, 'u', (uint32_t)n) < 0 || put(o, s, n) < 0 ? -1 : 1;
    }
    if (PyBytes_CheckExact(v)) {
        Py_ssize_t n = PyBytes_GET_SIZE(v);
        if (n > INT32_MAX)
            return 0;
        return put_u32(o, 's', (uint32_t)n) < 0 || put(o, PyBytes_AS_STRING(v), n) < 0 ? -1 : 1;
    }
    if (depth >= FLAT_DEPTH)
        return 0;
    if (PyTuple_CheckExact(v) || PyList_CheckExact(v)) {
        int tuple = PyTuple_CheckExact(v);
        Py_ssize_t n = tuple ? PyTuple_GET_SIZE(v) : PyList_GET_SIZE(v);
        int err;
        if (tuple && n < 256) {
            char head[2] = {')', (char)n};
            err = put(o, head, 2);
        } else if (n > INT32_MAX) {
            return 0;
        } else {
            err = put_u32(o, tuple ? '(' : '[', (uint32_t)n);
        }
        if (err < 0)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {   /* nothing here runs Python code: the list stays as it is */
            int r = flat(o, tuple ? PyTuple_GET_ITEM(v, i) : PyList_GET_ITEM(v, i), depth + 1);
            if (r <= 0)
                return r;
        }
        return 1;
    }
    if (PyDict_CheckExact(v)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        if (put_byte(o, '{') < 0)
            return -1;
        while (PyDict_Next(v, &pos, &key, &value)) {
            int r = flat(o, key, depth + 1);
            if (r > 0)
                r = flat(o, value, depth + 1);
            if (r <= 0)
                return r;
        }
        return put_byte(o, '0') < 0 ? -1 : 1;
    }
    if (PyFloat_CheckExact(v)) {
        char b[9] = {'g'};
        if (PyFloat_Pack8(PyFloat_AS_DOUBLE(v), b + 1, 1) < 0)
            return -1;
        return put(o, b, 9) < 0 ? -1 : 1;
    }
    return 0;
}

/* flat_dumps(obj) -> bytes */
static PyObject *flat_dumps(PyObject *self, PyObject *obj)
{
    scratch.len = 0;
    int r = flat(&scratch, obj, 0);
    PyObject *out = NULL;
    if (r > 0)
        out = PyBytes_FromStringAndSize(scratch.buf, scratch.len);
    else if (r == 0)
        out = PyObject_CallFunction(marshal_dumps, "Oi", obj, 4);
    if (scratch.cap > FLAT_KEEP) {   /* one huge record does not pin its size for good */
        PyMem_Free(scratch.buf);
        scratch.buf = NULL;
        scratch.len = scratch.cap = 0;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"b64url_chunks", (PyCFunction)(void (*)(void))b64url_chunks, METH_FASTCALL,
     "b64url_chunks(raw, width) -> texts: see workers/workqueues/purecore.py"},
    {"grant", (PyCFunction)(void (*)(void))grant, METH_FASTCALL,
     "grant(leases, leased, deliveries, seqs, receipts, granted, deadline, visibility, holder) -> redeliveries"},
    {"delivered", (PyCFunction)(void (*)(void))delivered, METH_FASTCALL,
     "delivered(store, deliveries, seqs, receipts, ms) -> deliveries: see workers/workqueues/purecore.py"},
    {"ack_run", (PyCFunction)(void (*)(void))ack_run, METH_FASTCALL,
     "ack_run(leases, leased, store, deliveries, receipts, start, now, done, results, acked) -> (stop, size)"},
    {"render_deliveries", (PyCFunction)(void (*)(void))render_deliveries, METH_FASTCALL,
     "render_deliveries(messages, kind_json, render) -> bytes: see workers/workqueues/purecore.py"},
    {"store_run", (PyCFunction)(void (*)(void))store_run, METH_FASTCALL,
     "store_run(store, seq, ids, kind, datas, priority, wall) -> size: see workers/workqueues/purecore.py"},
    {"store_put", (PyCFunction)(void (*)(void))store_put, METH_FASTCALL,
     "store_put(store, messages) -> size: see workers/workqueues/purecore.py"},
    {"snapshot_pushes", (PyCFunction)(void (*)(void))snapshot_pushes, METH_FASTCALL,
     "snapshot_pushes(messages, width, least) -> records: see workers/workqueues/purecore.py"},
    {"flat_dumps", flat_dumps, METH_O, "flat_dumps(obj) -> bytes: see workers/workqueues/purecore.py"},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *module)
{
    if (marshal_dumps == NULL) {
        PyObject *marshal = PyImport_ImportModule("marshal");
        if (marshal == NULL)
            return -1;
        marshal_dumps = PyObject_GetAttrString(marshal, "dumps");
        Py_DECREF(marshal);
        if (marshal_dumps == NULL)
            return -1;
    }
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

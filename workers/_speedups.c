/* The per-message hot path, compiled: the same functions as workers/purepath.py, with the same results for every
 * input (tests/test_speedups.py compares them on random and mutated input).  purepath.py is the reference and says
 * what each function does; this file says only how.
 *
 * Every read of the input is bounds-checked against its length: a client controls these bytes, and a fault here
 * would take down every connection of the worker.  Nothing here keeps state between calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A byte of an argument: what bytes.split() does not split on (so a PUB line reads the same here and in the
 * general parser). */
static inline int is_token(unsigned char c)
{
    return !(c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f');
}

static inline int is_blank(unsigned char c) { return c == ' ' || c == '\t'; }

typedef struct {
    Py_ssize_t subject, subject_len;   /* offsets into the buffer */
    Py_ssize_t reply, reply_len;       /* reply_len 0: none */
    long long size;
    Py_ssize_t eol;                    /* just after the line's LF */
    Py_ssize_t line_len;               /* without CRLF or LF */
} pub_line;

/* After a size token's digits at i: blanks, then CRLF or LF.  -> the offset after the LF, or -1. */
static Py_ssize_t line_end(const unsigned char *b, Py_ssize_t i, Py_ssize_t n)
{
    while (i < n && is_blank(b[i]))
        i++;
    if (i < n && b[i] == '\r')
        i++;
    if (i < n && b[i] == '\n')
        return i + 1;
    return -1;
}

/* A size token at i: 1 to 12 ASCII digits.  -> the offset after them (and the value), or -1. */
static Py_ssize_t digits(const unsigned char *b, Py_ssize_t i, Py_ssize_t n, long long *value)
{
    Py_ssize_t start = i;
    long long v = 0;
    while (i < n && b[i] >= '0' && b[i] <= '9') {
        if (i - start == 12)
            return -1;   /* a 13th digit: \d{1,12} cannot end here, and the byte after is no blank */
        v = v * 10 + (b[i] - '0');
        i++;
    }
    if (i == start)
        return -1;
    *value = v;
    return i;
}

/* The PUB line at pos, as purepath's _PUB_LINE matches it.  -> 1 (filled in) or 0. */
static int match_pub(const unsigned char *b, Py_ssize_t pos, Py_ssize_t n, pub_line *out)
{
    Py_ssize_t i = pos, t2, t2_end, j, k;
    long long size;

    if (n - i < 4)
        return 0;
    if ((b[i] | 0x20) != 'p' || (b[i + 1] | 0x20) != 'u' || (b[i + 2] | 0x20) != 'b' || !is_blank(b[i + 3]))
        return 0;
    i += 3;
    while (i < n && is_blank(b[i]))
        i++;
    out->subject = i;
    while (i < n && is_token(b[i]))
        i++;
    out->subject_len = i - out->subject;
    if (out->subject_len == 0 || i >= n || !is_blank(b[i]))
        return 0;
    while (i < n && is_blank(b[i]))
        i++;
    t2 = i;
    while (i < n && is_token(b[i]))
        i++;
    t2_end = i;
    if (t2_end == t2)
        return 0;
    /* With a reply: blanks, then a size token that ends the line. */
    j = t2_end;
    while (j < n && is_blank(b[j]))
        j++;
    if (j > t2_end) {
        k = digits(b, j, n, &size);
        if (k >= 0 && (k = line_end(b, k, n)) >= 0) {
            out->reply = t2;
            out->reply_len = t2_end - t2;
            goto matched;
        }
    }
    /* Without: the second token is the size. */
    k = digits(b, t2, n, &size);
    if (k != t2_end || (k = line_end(b, k, n)) < 0)
        return 0;
    out->reply = 0;
    out->reply_len = 0;
matched:
    out->size = size;
    out->eol = k;
    out->line_len = k - pos - ((k - 2 >= pos && b[k - 2] == '\r') ? 2 : 1);
    return 1;
}

static PyObject *scan_pubs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t pos, max_line, n;
    long long max_payload;
    const unsigned char *b;
    PyObject *payloads = NULL, *subject = NULL, *reply = NULL, *result = NULL;
    pub_line first, line;
    int have = 0;

    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "scan_pubs(buf, pos, max_line, max_payload)");
        return NULL;
    }
    pos = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    max_line = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (max_line == -1 && PyErr_Occurred())
        return NULL;
    max_payload = PyLong_AsLongLong(args[3]);
    if (max_payload == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    b = (const unsigned char *)view.buf;
    n = view.len;
    if (pos < 0)
        pos = 0;   /* as re.match(buf, pos) */
    payloads = PyList_New(0);
    if (payloads == NULL)
        goto done;
    while (pos < n) {
        Py_ssize_t end;
        PyObject *payload;
        if (!match_pub(b, pos, n, &line) || line.line_len > max_line)
            break;
        if (line.size > max_payload || line.size > n - line.eol - 2)
            break;
        end = line.eol + (Py_ssize_t)line.size + 2;
        if (b[end - 2] != '\r' || b[end - 1] != '\n')
            break;
        if (have) {
            if (line.subject_len != first.subject_len || line.reply_len != first.reply_len
                || memcmp(b + line.subject, b + first.subject, (size_t)line.subject_len) != 0
                || memcmp(b + line.reply, b + first.reply, (size_t)line.reply_len) != 0)
                break;
        } else {
            first = line;
            have = 1;
        }
        payload = PyBytes_FromStringAndSize((const char *)b + line.eol, (Py_ssize_t)line.size);
        if (payload == NULL || PyList_Append(payloads, payload) < 0) {
            Py_XDECREF(payload);
            goto done;
        }
        Py_DECREF(payload);
        pos = end;
    }
    if (have) {
        subject = PyBytes_FromStringAndSize((const char *)b + first.subject, first.subject_len);
        if (subject == NULL)
            goto done;
        if (first.reply_len) {
            reply = PyBytes_FromStringAndSize((const char *)b + first.reply, first.reply_len);
            if (reply == NULL)
                goto done;
        } else {
            reply = Py_NewRef(Py_None);
        }
    } else {
        subject = Py_NewRef(Py_None);
        reply = Py_NewRef(Py_None);
    }
    result = Py_BuildValue("(OOOn)", subject, reply, payloads, pos);
done:
    Py_XDECREF(subject);
    Py_XDECREF(reply);
    Py_XDECREF(payloads);
    PyBuffer_Release(&view);
    return result;
}

/* Decimal digits of v >= 0 into buf (at least 20 bytes), -> their count. */
static int put_decimal(char *buf, Py_ssize_t v)
{
    char tmp[24];
    int k = 0, i;
    do {
        tmp[k++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (i = 0; i < k; i++)
        buf[i] = tmp[k - 1 - i];
    return k;
}

static PyObject *msg_tails(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *payloads, *reply, *out;
    const char *r = NULL;
    Py_ssize_t rlen = 0, count, i;

    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "msg_tails(payloads, reply)");
        return NULL;
    }
    payloads = args[0];
    reply = args[1];
    if (!PyList_Check(payloads)) {
        PyErr_SetString(PyExc_TypeError, "payloads must be a list of bytes");
        return NULL;
    }
    if (reply != Py_None) {
        if (!PyBytes_Check(reply)) {
            PyErr_SetString(PyExc_TypeError, "reply must be bytes or None");
            return NULL;
        }
        r = PyBytes_AS_STRING(reply);
        rlen = PyBytes_GET_SIZE(reply);
    }
    count = PyList_GET_SIZE(payloads);
    out = PyList_New(count);
    if (out == NULL)
        return NULL;
    for (i = 0; i < count; i++) {
        PyObject *p = PyList_GET_ITEM(payloads, i), *tail;
        char digits_buf[24], *w;
        Py_ssize_t plen;
        int nd;
        if (!PyBytes_Check(p)) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_TypeError, "payloads must be a list of bytes");
            return NULL;
        }
        plen = PyBytes_GET_SIZE(p);
        nd = put_decimal(digits_buf, plen);
        if (plen > PY_SSIZE_T_MAX - rlen - nd - 8) {
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
        /* " [reply ]<size>\r\n<payload>\r\n" */
        tail = PyBytes_FromStringAndSize(NULL, 1 + (rlen ? rlen + 1 : 0) + nd + 2 + plen + 2);
        if (tail == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        w = PyBytes_AS_STRING(tail);
        *w++ = ' ';
        if (rlen) {
            memcpy(w, r, (size_t)rlen);
            w += rlen;
            *w++ = ' ';
        }
        memcpy(w, digits_buf, (size_t)nd);
        w += nd;
        *w++ = '\r';
        *w++ = '\n';
        memcpy(w, PyBytes_AS_STRING(p), (size_t)plen);
        w += plen;
        *w++ = '\r';
        *w++ = '\n';
        PyList_SET_ITEM(out, i, tail);
    }
    return out;
}

/* Printable ASCII but '"' and '\\' (purepath's _PLAIN). */
static inline int is_plain(unsigned char c) { return c >= 0x20 && c <= 0x7e && c != '"' && c != '\\'; }

static const char PUB_HEAD[] = "{\"op\":\"pub\",\"topic\":\"";
static const char PUB_MID[] = "\",\"data\":\"";

/* `head`, a name of one or more plain characters, `mid`, at the start of a line: -> the offset after `mid`, with
 * the name's offsets, or -1. */
static Py_ssize_t match_name(const unsigned char *b, Py_ssize_t n, const char *head, Py_ssize_t head_len,
                             const char *mid, Py_ssize_t mid_len, Py_ssize_t *t0, Py_ssize_t *t1)
{
    Py_ssize_t i = head_len;
    if (n < i || memcmp(b, head, (size_t)i) != 0)
        return -1;
    *t0 = i;
    while (i < n && is_plain(b[i]))
        i++;
    *t1 = i;
    if (*t1 == *t0 || n - i < mid_len || memcmp(b + i, mid, (size_t)mid_len) != 0)
        return -1;
    return i + mid_len;
}

/* A canonical NDJSON publish (purepath's _NDJSON_PUB, matched whole).  -> 1 with the topic's and the data's
 * (quotes included) offsets, or 0. */
static int match_ndjson_pub(const unsigned char *b, Py_ssize_t n, Py_ssize_t *t0, Py_ssize_t *t1,
                            Py_ssize_t *d0, Py_ssize_t *d1)
{
    Py_ssize_t i = match_name(b, n, PUB_HEAD, sizeof(PUB_HEAD) - 1, PUB_MID, sizeof(PUB_MID) - 1, t0, t1);
    if (i < 0)
        return 0;
    *d0 = i - 1;   /* the opening quote */
    while (i < n && is_plain(b[i]))
        i++;
    if (i >= n || b[i] != '"')
        return 0;
    *d1 = ++i;     /* after the closing quote */
    if (i >= n || b[i] != '}')
        return 0;
    i++;
    if (i < n && b[i] == '\r')
        i++;
    return i == n;
}

/* Every byte of b[0:n] plain, eight at a time (the tests of "Bit Twiddling Hacks": a byte below 0x20, a byte
 * with its high bit set once 1 is added (0x7f and up), a byte equal to '"' or '\\'). */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
static int all_plain(const unsigned char *b, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v, q, e;
        memcpy(&v, b + i, 8);
        q = v ^ (ONES * '"');
        e = v ^ (ONES * '\\');
        if (((v - ONES * 0x20) & ~v & HIGHS) | ((v | (v + ONES)) & HIGHS) | ((q - ONES) & ~q & HIGHS)
                | ((e - ONES) & ~e & HIGHS))
            return 0;
    }
    for (; i < n; i++)
        if (!is_plain(b[i]))
            return 0;
    return 1;
}

/* unplain(datas) -> those of datas (bytes) that are not a JSON string of plain characters (purepath's). */
static PyObject *unplain(PyObject *module, PyObject *datas)
{
    if (!PyList_Check(datas)) {
        PyErr_SetString(PyExc_TypeError, "datas must be a list");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(datas); i++) {
        PyObject *data = PyList_GET_ITEM(datas, i);
        if (!PyBytes_Check(data)) {
            PyErr_SetString(PyExc_TypeError, "datas must be bytes");
            Py_DECREF(out);
            return NULL;
        }
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(data);
        Py_ssize_t n = PyBytes_GET_SIZE(data);
        int plain = n >= 2 && b[0] == '"' && b[n - 1] == '"' && all_plain(b + 1, n - 2);
        if (!plain && PyList_Append(out, data) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static const char QPUSH_HEAD[] = "{\"op\":\"qpush\",\"queue\":\"";
static const char QPUSH_MID[] = "\",\"data\":";

static const char PRIORITY_KEY[] = ",\"priority\":";
static const char DELAY_KEY[] = ",\"delay_ms\":";
#define MAX_OPTION_DIGITS 9

/* Where `key` and the JSON integer after it (0, or up to MAX_OPTION_DIGITS digits without a leading zero) start,
 * when they end b[lo:end]; else end. */
static Py_ssize_t int_option(const unsigned char *b, Py_ssize_t lo, Py_ssize_t end, const char *key, Py_ssize_t klen)
{
    Py_ssize_t i = end;
    while (i > lo && end - i <= MAX_OPTION_DIGITS && b[i - 1] >= '0' && b[i - 1] <= '9')
        i--;
    if (i == end || end - i > MAX_OPTION_DIGITS || (end - i > 1 && b[i] == '0') || i - lo < klen
        || memcmp(b + i - klen, key, (size_t)klen) != 0)
        return end;
    return i - klen;
}

static const char DEDUP_KEY[] = ",\"dedup_id\":\"";
#define MAX_DEDUP_CHARS 128

/* Where `,"dedup_id":"` and the rest of the string after it (1 to MAX_DEDUP_CHARS plain characters, its closing
 * quote) start, when they end b[lo:end], with *v0 where its characters start; else end. */
static Py_ssize_t dedup_option(const unsigned char *b, Py_ssize_t lo, Py_ssize_t end, Py_ssize_t *v0)
{
    Py_ssize_t last = end - 1, from, i, klen = sizeof(DEDUP_KEY) - 1;
    const unsigned char *quote;
    if (last <= lo || b[last] != '"')
        return end;
    /* The quote before the last one, found at memrchr's speed: a push's data is often a string that ends the
     * same way, and it is the key before that quote that tells them apart, not its plain characters. */
    from = last - 1 - MAX_DEDUP_CHARS > lo ? last - 1 - MAX_DEDUP_CHARS : lo;
#ifdef __GLIBC__
    quote = memrchr(b + from, '"', (size_t)(last - from));
#else
    for (quote = NULL, i = last - 1; i >= from; i--)
        if (b[i] == '"') {
            quote = b + i;
            break;
        }
#endif
    if (quote == NULL)
        return end;
    i = quote - b + 1;   /* the value's first character */
    if (i == last || i - lo < klen || memcmp(b + i - klen, DEDUP_KEY, (size_t)klen) != 0
        || !all_plain(b + i, last - i))
        return end;
    *v0 = i;
    return i - klen;
}

/* A canonical NDJSON single push (purepath's _NDJSON_QPUSH, matched whole): the data is whatever follows, up to
 * the closing brace or to the options before it (`,"priority":N`, then `,"delay_ms":N`, then
 * `,"dedup_id":"..."`, each optional), without control characters.  -> 1 with the queue's and the data's offsets,
 * where the priority and delay end (they start where the data ends), and the dedup_id's characters (*u0 -1:
 * none), or 0. */
static int match_ndjson_qpush(const unsigned char *b, Py_ssize_t n, Py_ssize_t *t0, Py_ssize_t *t1,
                              Py_ssize_t *d0, Py_ssize_t *d1, Py_ssize_t *o1, Py_ssize_t *u0, Py_ssize_t *u1)
{
    Py_ssize_t i = match_name(b, n, QPUSH_HEAD, sizeof(QPUSH_HEAD) - 1, QPUSH_MID, sizeof(QPUSH_MID) - 1, t0, t1);
    Py_ssize_t end = n, j;
    if (i < 0)
        return 0;
    if (end > i && b[end - 1] == '\r')
        end--;
    if (end - i < 2 || b[end - 1] != '}')
        return 0;
    for (j = i; j < end - 1; j++)
        if (b[j] < 0x20)
            return 0;
    *d0 = i;
    /* the data keeps a byte at least: it is checked as JSON later, and what is not goes line by line */
    *u0 = -1;
    *o1 = dedup_option(b, i + 1, end - 1, u0);
    *u1 = end - 2;   /* the dedup_id's closing quote */
    j = int_option(b, i + 1, *o1, DELAY_KEY, sizeof(DELAY_KEY) - 1);
    *d1 = int_option(b, i + 1, j, PRIORITY_KEY, sizeof(PRIORITY_KEY) - 1);
    return 1;
}

static PyObject *ndjson_runs(PyObject *module, PyObject *lines)
{
    PyObject *out, *payloads = NULL, *run_lines = NULL, *dedups = NULL;
    /* the open run's topic or queue, and a push run's options, inside a line that run_lines keeps alive */
    const char *topic = NULL, *options = NULL;
    int run_kind = 0;           /* the open run's: 1 publishes, 2 pushes, 3 pushes with a dedup_id each */
    Py_ssize_t topic_len = 0, options_len = 0, count, i;

    if (!PyList_Check(lines)) {
        PyErr_SetString(PyExc_TypeError, "lines must be a list");
        return NULL;
    }
    out = PyList_New(0);
    if (out == NULL)
        return NULL;
    count = PyList_GET_SIZE(lines);
    for (i = 0; i < count; i++) {
        PyObject *line = PyList_GET_ITEM(lines, i), *data, *dedup = NULL;
        Py_ssize_t t0, t1, d0, d1, o1, u0 = -1, u1 = 0;
        const unsigned char *b;
        int kind = 0;
        if (PyBytes_Check(line)) {
            b = (const unsigned char *)PyBytes_AS_STRING(line);
            if (match_ndjson_pub(b, PyBytes_GET_SIZE(line), &t0, &t1, &d0, &d1)) {
                kind = 1;
                o1 = d1;
            }
            else if (match_ndjson_qpush(b, PyBytes_GET_SIZE(line), &t0, &t1, &d0, &d1, &o1, &u0, &u1))
                kind = u0 < 0 ? 2 : 3;
        }
        if (kind == 0) {
            if (line != Py_None && !PyBytes_Check(line)) {
                PyErr_SetString(PyExc_TypeError, "lines must be bytes or None");
                goto fail;
            }
            if (PyList_Append(out, line) < 0)
                goto fail;
            topic = NULL;
            continue;
        }
        data = PyBytes_FromStringAndSize((const char *)b + d0, d1 - d0);
        if (data == NULL)
            goto fail;
        if (kind == 3 && (dedup = PyUnicode_DecodeASCII((const char *)b + u0, u1 - u0, NULL)) == NULL) {
            Py_DECREF(data);
            goto fail;
        }
        if (topic != NULL && kind == run_kind && t1 - t0 == topic_len && o1 - d1 == options_len
            && memcmp(b + t0, topic, (size_t)topic_len) == 0
            && memcmp(b + d1, options, (size_t)options_len) == 0) {
            if (PyList_Append(payloads, data) < 0 || PyList_Append(run_lines, line) < 0
                || (dedup != NULL && PyList_Append(dedups, dedup) < 0)) {
                Py_DECREF(data);
                Py_XDECREF(dedup);
                goto fail;
            }
            Py_DECREF(data);
            Py_XDECREF(dedup);
            continue;
        }
        {
            PyObject *name = PyBytes_FromStringAndSize((const char *)b + t0, t1 - t0), *opts = NULL, *run = NULL;
            payloads = PyList_New(1);
            run_lines = PyList_New(1);
            dedups = kind == 3 ? PyList_New(1) : Py_NewRef(Py_None);
            if (kind != 1)
                opts = PyBytes_FromStringAndSize((const char *)b + d1, o1 - d1);
            if (name == NULL || payloads == NULL || run_lines == NULL || dedups == NULL
                || (kind != 1 && opts == NULL)) {
                Py_XDECREF(name);
                Py_XDECREF(opts);
                Py_XDECREF(payloads);
                Py_XDECREF(run_lines);
                Py_XDECREF(dedups);
                Py_DECREF(data);
                Py_XDECREF(dedup);
                goto fail;
            }
            PyList_SET_ITEM(payloads, 0, data);
            PyList_SET_ITEM(run_lines, 0, Py_NewRef(line));
            if (dedup != NULL)
                PyList_SET_ITEM(dedups, 0, dedup);
            run = kind == 1 ? PyTuple_Pack(3, name, payloads, run_lines)
                            : PyTuple_Pack(5, name, payloads, run_lines, opts, dedups);
            Py_DECREF(name);
            Py_XDECREF(opts);
            Py_DECREF(payloads);     /* the tuple holds them; so does `out` once appended */
            Py_DECREF(run_lines);
            Py_DECREF(dedups);
            if (run == NULL || PyList_Append(out, run) < 0) {
                Py_XDECREF(run);
                goto fail;
            }
            Py_DECREF(run);
            topic = (const char *)b + t0;
            topic_len = t1 - t0;
            options = (const char *)b + d1;
            options_len = o1 - d1;
            run_kind = kind;
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static const char QBATCH_MID[] = "\",\"messages\":[";
static const char ITEM_HEAD[] = "{\"data\":";

/* The end of the string whose opening quote is at b[i], or -1. */
static Py_ssize_t skip_string(const unsigned char *b, Py_ssize_t i, Py_ssize_t n)
{
    for (i++; i < n; i++) {
        if (b[i] == '\\')
            i++;
        else if (b[i] == '"')
            return i + 1;
    }
    return -1;
}

/* The end of the JSON value at b[i], before n, or -1 (purepath's _skip_value). */
static Py_ssize_t skip_value(const unsigned char *b, Py_ssize_t i, Py_ssize_t n)
{
    Py_ssize_t depth = 0, start = i;
    if (i >= n)
        return -1;
    if (b[i] == '"')
        return skip_string(b, i, n);
    if (b[i] == '{' || b[i] == '[') {
        while (i < n) {
            unsigned char c = b[i];
            if (c == '"') {
                i = skip_string(b, i, n);
                if (i < 0)
                    return -1;
                continue;
            }
            if (c == '{' || c == '[')
                depth++;
            else if ((c == '}' || c == ']') && --depth == 0)
                return i + 1;
            i++;
        }
        return -1;
    }
    while (i < n && b[i] != ',' && b[i] != '}' && b[i] != ']' && b[i] != ' ' && b[i] != '\t' && b[i] != '\r'
           && b[i] != '\n')
        i++;
    return i > start ? i : -1;
}

/* What may follow a canonical batch's messages: the request's other fields (",...}"), which the caller checks by
   name, but never a second "messages", which a JSON parser would take instead of the first. */
static int batch_tail(const unsigned char *b, Py_ssize_t i, Py_ssize_t n)
{
    static const char key[] = "\"messages\"";
    Py_ssize_t k;

    if (i >= n || b[i] != ',' || b[n - 1] != '}')
        return 0;
    for (k = i; k + (Py_ssize_t)sizeof(key) - 1 <= n; k++)
        if (b[k] == '"' && memcmp(b + k, key, sizeof(key) - 1) == 0)
            return 0;
    return 1;
}

static PyObject *qpush_batch(PyObject *module, PyObject *line)
{
    const unsigned char *b;
    Py_ssize_t n, i, t0, t1;
    PyObject *datas;

    if (!PyBytes_Check(line)) {
        PyErr_SetString(PyExc_TypeError, "line must be bytes");
        return NULL;
    }
    b = (const unsigned char *)PyBytes_AS_STRING(line);
    n = PyBytes_GET_SIZE(line);
    if (n > 0 && b[n - 1] == '\r')
        n--;
    i = match_name(b, n, QPUSH_HEAD, sizeof(QPUSH_HEAD) - 1, QBATCH_MID, sizeof(QBATCH_MID) - 1, &t0, &t1);
    if (i < 0)
        Py_RETURN_NONE;
    datas = PyList_New(0);
    if (datas == NULL)
        return NULL;
    for (;;) {
        Py_ssize_t end;
        PyObject *data;
        if (n - i < (Py_ssize_t)sizeof(ITEM_HEAD) - 1 || memcmp(b + i, ITEM_HEAD, sizeof(ITEM_HEAD) - 1) != 0)
            break;
        i += sizeof(ITEM_HEAD) - 1;
        end = skip_value(b, i, n);
        if (end < 0 || end >= n || b[end] != '}')
            break;
        data = PyBytes_FromStringAndSize((const char *)b + i, end - i);
        if (data == NULL || PyList_Append(datas, data) < 0) {
            Py_XDECREF(data);
            Py_DECREF(datas);
            return NULL;
        }
        Py_DECREF(data);
        i = end + 1;
        if (i < n && b[i] == ',') {
            i++;
            continue;
        }
        if (i < n && b[i] == ']' && (i + 2 == n ? b[i + 1] == '}' : batch_tail(b, i + 1, n)))
            return datas;
        break;
    }
    Py_DECREF(datas);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan_pubs", (PyCFunction)(void (*)(void))scan_pubs, METH_FASTCALL,
     "scan_pubs(buf, pos, max_line, max_payload) -> (subject, reply, payloads, pos): see workers/purepath.py"},
    {"msg_tails", (PyCFunction)(void (*)(void))msg_tails, METH_FASTCALL,
     "msg_tails(payloads, reply) -> list of ' [reply] <size>\\r\\n<payload>\\r\\n': see workers/purepath.py"},
    {"ndjson_runs", (PyCFunction)ndjson_runs, METH_O,
     "ndjson_runs(lines) -> lines with runs of canonical publishes grouped: see workers/purepath.py"},
    {"unplain", (PyCFunction)unplain, METH_O,
     "unplain(datas) -> those that are not a JSON string of plain characters: see workers/purepath.py"},
    {"qpush_batch", (PyCFunction)qpush_batch, METH_O,
     "qpush_batch(line) -> the data values' text of a canonical batch push, or None: see workers/purepath.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "workers._speedups", "The compiled hot path (see workers/purepath.py).", 0, methods,
};

PyMODINIT_FUNC PyInit__speedups(void)
{
    return PyModuleDef_Init(&module_def);
}

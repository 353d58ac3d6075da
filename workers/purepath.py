"""The per-message hot path in pure Python: the reference, and the fallback where the compiled one is missing.

``workers/_speedups.c`` implements the same functions; ``workers.speedups`` picks one.  Both must give identical
results for every input (tests/unit/test_speedups.py checks them against each other on random and mutated input), so
any change here is a change there.

- ``scan_pubs``: a run of complete, well-formed NATS ``PUB`` commands to one subject (and one reply subject), read
  from a buffer in one call.  Anything else (another verb, HPUB, a line too long, a payload too large or not yet
  complete, a missing CRLF) ends the run and is left to the general parser, which also reports its errors.
- ``msg_tails``: what follows ``MSG <subject> <sid>`` for each payload of a run, the same for every subscriber.
- ``ndjson_runs``: NDJSON lines with the runs of publishes in their canonical form (``{"op":"pub","topic":"T",
  "data":"S"}``, as our client and most JSON encoders write them) to one topic grouped, so that a run is routed and
  batched in one call.  The form is narrow on purpose: printable ASCII without quotes or backslashes in T and S,
  so the data string is its own canonical JSON encoding (what orjson would write back) and the topic needs no
  decoding.  Runs of single pushes in theirs (``{"op":"qpush","queue":"Q","data":D}``) to one queue are grouped
  too, so that a run is gathered for the queue's owner in one call (workers/protocols/ndjson/queue_verbs.py,
  ``push_run``).  D is any text without control characters: whether it is JSON is checked there, and what is not
  goes back to the general path, line by line.  Every other line stays a line for the general path.
- ``qpush_batch``: the data values' text of a batch push in its canonical form
  (``{"op":"qpush","queue":"Q","messages":[{"data":D},...]}``), a line orjson has already accepted, so that the
  batch is stored as the client wrote it without encoding each value again (workers/protocols/ndjson/queue_verbs.py).
"""

from __future__ import annotations

import re

# A well-formed PUB control line (verb in any case, CRLF or LF); what it does not match takes the general path.
# Its arguments are what ``bytes.split()`` makes of the line (no vertical tab or form feed inside), so a PUB reads
# the same whether it arrives whole (here) or with its payload in a later read (the general parser).
_PUB_LINE = re.compile(rb"(?i:pub)[ \t]+([^ \t\r\n\v\f]+)[ \t]+(?:([^ \t\r\n\v\f]+)[ \t]+)?(\d{1,12})[ \t]*\r?\n")


def scan_pubs(buf: bytes, pos: int, max_line: int, max_payload: int) -> tuple:
    """-> (subject, reply or None, payloads, position after the run); payloads is empty if ``buf`` at ``pos`` does
    not start with a complete well-formed PUB (subject and reply are None then)."""
    n = len(buf)
    match = _PUB_LINE.match
    payloads: list[bytes] = []
    subject = reply = None
    while pos < n:
        m = match(buf, pos)
        if m is None:
            break
        eol = m.end()
        # the line's length without its CRLF (or LF), as the general parser measures it
        if eol - pos - (2 if buf[eol - 2] == 13 else 1) > max_line:
            break
        s, r, size = m.groups()
        nbytes = int(size)
        end = eol + nbytes + 2
        if nbytes > max_payload or end > n or buf[end - 2:end] != b"\r\n":
            break
        if payloads:
            if s != subject or r != reply:
                break
        else:
            subject, reply = s, r
        payloads.append(buf[eol:end - 2])
        pos = end
    return subject, reply, payloads, pos


# printable ASCII but the quote and the backslash: a JSON string's content that needs no escape and no decoding
_PLAIN = rb"[\x20\x21\x23-\x5b\x5d-\x7e]"
_NDJSON_PUB = re.compile(rb'\{"op":"pub","topic":"(' + _PLAIN + rb'+)","data":("' + _PLAIN + rb'*")\}\r?')
# A single push's data is any text without control characters, checked as JSON later
# (protocols.ndjson.queue_verbs.push_run), and
# its options after it, each optional: a priority, then a delay, JSON integers of up to nine digits, then a
# dedup_id of 1-128 plain characters.
_INT_OPTION = rb"(?:0|[1-9][0-9]{0,8})"
_NDJSON_QPUSH = re.compile(rb'\{"op":"qpush","queue":"(' + _PLAIN + rb'+)","data":([^\x00-\x1f]+?)((?:,"priority":'
                           + _INT_OPTION + rb')?(?:,"delay_ms":' + _INT_OPTION + rb')?)(?:,"dedup_id":"(' + _PLAIN
                           + rb'{1,128})")?\}\r?')


def ndjson_runs(lines: list) -> list:
    """-> the lines, where each run of consecutive canonical publishes to one topic is replaced by one
    ``(topic, payloads, lines)`` (payloads: the data values' JSON, quotes included), and each run of canonical
    single pushes to one queue with the same options by one ``(queue, datas, lines, options, dedups)`` (datas:
    the text of the data values, not yet known to be JSON; options: the priority and delay after them, ``b""`` or
    ``b',"priority":4,"delay_ms":100'`` or either part alone; dedups: each push's ``dedup_id``, after those, for a
    run of pushes that all have one, else None)."""
    out: list = []
    pub = _NDJSON_PUB.fullmatch
    qpush = _NDJSON_QPUSH.fullmatch
    run = None   # the open run: ((name, (options, has a dedup_id) or None for publishes), values, lines, dedups)
    for line in lines:
        m = None
        if line is not None:
            m = pub(line)
            if m is None:
                m = qpush(line)
        if m is None:
            out.append(line)
            run = None
            continue
        name, value, *push = m.groups()
        key = (name, (push[0], push[1] is not None) if push else None)
        if run is not None and run[0] == key:
            run[1].append(value)
            run[2].append(line)
            if run[3] is not None:
                run[3].append(push[1].decode())
            continue
        run = (key, [value], [line], [push[1].decode()] if push and push[1] is not None else None)
        out.append((name, run[1], run[2], push[0], run[3]) if push else (name, run[1], run[2]))
    return out


_PLAIN_STRING = re.compile(rb'"' + _PLAIN + rb'*"').fullmatch


def unplain(datas: list) -> list:
    """-> those of ``datas`` (a run's data values' text) that are not a JSON string of plain characters: what is
    left to check as JSON (a string of printable ASCII without quotes or escapes in it is JSON as it stands)."""
    if type(datas) is not list:
        raise TypeError("datas must be a list")
    if not all(type(data) is bytes for data in datas):
        raise TypeError("datas must be bytes")
    return [data for data in datas if not _PLAIN_STRING(data)]


# A canonical batch push: this head, then ``{"data":D}`` items, comma-separated, then ``]}``.  A data value is
# skipped as JSON is written (valid, as orjson accepted the line): a string up to its closing quote, an object or
# an array up to the bracket that closes it (strings in it skipped whole), anything else up to a comma, a
# closing bracket or a blank.
_NDJSON_QBATCH = re.compile(rb'\{"op":"qpush","queue":"' + _PLAIN + rb'+","messages":\[')
_ITEM = b'{"data":'
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NESTED = re.compile(_STRING.pattern + rb'|["{}\[\]]', re.S)   # a whole string, a lone quote, a bracket
_SCALAR = re.compile(rb'[^,}\] \t\r\n]+')


def qpush_batch(line: bytes) -> list[bytes] | None:
    """The data values' text of a batch push in the canonical form
    ``{"op":"qpush","queue":"Q","messages":[{"data":D},...]}`` (a line orjson accepted: each D is JSON), in
    order; None for any other line.  The request's other fields may follow the messages (``],"dedup_id":...}``:
    the caller checks which), but not a second ``"messages"``, which a JSON parser would keep instead."""
    m = _NDJSON_QBATCH.match(line)
    if m is None:
        return None
    n = len(line) - 1 if line.endswith(b"\r") else len(line)
    i = m.end()
    datas = []
    while True:
        if not line.startswith(_ITEM, i, n):
            return None
        i += len(_ITEM)
        end = _skip_value(line, i, n)
        if end < 0 or line[end:end + 1] != b"}":
            return None
        datas.append(line[i:end])
        i = end + 1
        if line[i:i + 1] == b",":
            i += 1
            continue
        if line[i:i + 1] != b"]":
            return None
        if i + 2 == n:
            return datas if line[i + 1:n] == b"}" else None
        tail = line[i + 1:n]
        return datas if tail[:1] == b"," and tail[-1:] == b"}" and b'"messages"' not in tail else None


def _skip_value(line: bytes, i: int, n: int) -> int:
    """The end of the JSON value at ``i`` (before ``n``), or -1."""
    if i >= n:
        return -1
    c = line[i]
    if c == 0x22:   # "
        m = _STRING.match(line, i, n)
        return m.end() if m is not None else -1
    if c == 0x7b or c == 0x5b:   # { [
        depth = 0
        for t in _NESTED.finditer(line, i, n):
            token = t.group()
            if token == b'"':   # a string that does not end
                return -1
            if len(token) > 1:
                continue
            depth += 1 if token in b"{[" else -1
            if depth == 0:
                return t.end()
        return -1
    m = _SCALAR.match(line, i, n)
    return m.end() if m is not None else -1


def msg_tails(payloads: list[bytes], reply: bytes | None) -> list[bytes]:
    """`` [reply] <size>\\r\\n<payload>\\r\\n`` for each payload."""
    if reply:
        return [b" %s %d\r\n%s\r\n" % (reply, len(p), p) for p in payloads]
    return [b" %d\r\n%s\r\n" % (len(p), p) for p in payloads]

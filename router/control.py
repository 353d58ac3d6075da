"""Every control item that crosses the fabric, in one vocabulary.

A control item is a small tuple whose first element is its kind; it rides in a frame's control list
(``router.frames``), ordered with the link's messages, acknowledged, and never dropped (``router.fabric``).  The
fabric answers its own kinds; the worker dispatches the others to whoever registered the kind
(``workers.hub.Hub.handle``), so a new owner of control traffic adds its kinds here and a handler there.

==========  =========================================  ==========================================================
kind        item                                       meaning
==========  =========================================  ==========================================================
hello       ``(HELLO,)``                               the fabric: a new link (or a replaced worker) says hello
hello_ack   ``(HELLO_ACK,)``                           the fabric: the answer; its frame's ack proves the link
``+``       ``(INTEREST_ADD, pattern)``                interest: a subscription pattern of the sender's clients
``-``       ``(INTEREST_DEL, pattern)``                interest: the last subscription to it is gone
snap        ``(INTEREST_SNAPSHOT, [pattern, ...])``    interest: all of them, to a peer that said hello
``q+``      ``(GROUP_ADD, pattern, member)``           a queue-group member, ``member = (group, cid, sid, user)``
``q-``      ``(GROUP_DEL, pattern, member)``           that member is gone
qsnap       ``(GROUP_SNAPSHOT, [(pattern, member)])``  all of them, to a peer that said hello
cnt         ``(COUNTERS, {subject: (msgs, bytes)})``   subject counters, shipped to the subject's owner
sync        ``(SYNC,)``                                a sync point: only its acknowledgement matters
fin         ``(FIN,)``                                 the sender stops: nothing more comes on this link
wq          ``(WQ_REQUEST, rid, op, args, holder)``    a work-queue request to the queue's owner
wqr         ``(WQ_REPLY, rid, result)``                its reply, to the worker that asked
wq-gone     ``(WQ_GONE, holder)``                      connection ``holder`` closed: end its polls and leases
==========  =========================================  ==========================================================
"""

HELLO = "hello"
HELLO_ACK = "hello_ack"

INTEREST_ADD = "+"
INTEREST_DEL = "-"
INTEREST_SNAPSHOT = "snap"

GROUP_ADD = "q+"
GROUP_DEL = "q-"
GROUP_SNAPSHOT = "qsnap"

COUNTERS = "cnt"
SYNC = "sync"
FIN = "fin"

WQ_REQUEST = "wq"
WQ_REPLY = "wqr"
WQ_GONE = "wq-gone"
WORK_QUEUE_KINDS = (WQ_REQUEST, WQ_REPLY, WQ_GONE)

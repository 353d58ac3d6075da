"""What every worker agrees on, with no I/O of a client: subject syntax (``subjects``), the subscription trie
(``sublist``), which worker owns a subject (``shardmap``), the ZeroMQ fabric between workers (``fabric``, the
state of each peer's ``link``, its ``frames`` and the ``control`` items' vocabulary), and callbacks that must not stop
their loop (``guard``)."""

"""A worker process: its core (``process``, ``connection``, ``hub``, ``turn``, ``groups``, ``backpressure``,
``polls``), one folder per client protocol (``protocols``), and the work-queue engine (``workqueues``)."""

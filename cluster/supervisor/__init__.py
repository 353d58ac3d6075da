"""The supervisor: binds the listeners, starts and watches the workers, hands them connections, and talks to
systemd and to ``brokerctl`` (``core`` holds ``Supervisor``; ``listeners``, ``acceptor``, ``admission``,
``handoff``, ``forkserver``, ``launch``, ``slots``, ``messages``, ``reload``, ``lameduck``, ``systemd``,
``service_status``, ``command_socket``, ``datadir`` its parts)."""

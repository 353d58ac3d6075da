"""What the tests share: the broker harness (harness), in-process hubs and sessions (inprocess), certificates, systemd
stand-ins and the sandbox runner."""

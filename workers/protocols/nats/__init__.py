"""The NATS core protocol (docs/nats.md): nats.py and every NATS client work unchanged; work queues on ``$Q.``."""

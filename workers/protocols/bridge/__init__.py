"""Bridge's small binary protocol (docs/bridge.md)."""

"""The leaf-node link (docs/leafnodes.md): each worker joins the configured NATS deployments as a nats-server leaf."""

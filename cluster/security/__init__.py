"""Security at run time: the user registry (``users``), the supervisor's authority over it (``manager``), login
attempts per address (``attempts``) and TLS contexts and handshakes (``tls``).  The formats the configuration
validates (password hashes, permission strings, certificate names) are the configuration's: ``cluster.config``."""

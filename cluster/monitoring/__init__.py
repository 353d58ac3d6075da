"""Monitoring: the HTTP endpoints the supervisor serves (``endpoints``, ``httpd``), /metrics (``metrics``),
/connz sorting (``connz``, which the workers apply too) and what the kernel says of the broker's processes
(``processes``)."""

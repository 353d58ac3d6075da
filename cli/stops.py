"""The stop signals ``brokerctl start`` noted before its supervisor ran (``cli.entry``), for the supervisor to act
on."""

STOPS: list[int] = []

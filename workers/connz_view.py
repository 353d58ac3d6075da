"""A connection as /connz shows it (nats-server's shape): the fields, and the ones it sorts by.

A mixin of ``workers.connection.Connection``: the view reads the connection's counters, and a protocol's session
adds its own fields (NATS: name, lang, version, rtt; qlite: its consumer) by extending ``info``."""

from __future__ import annotations

# /connz fields (``info``) and the attributes that hold them, for sorting (``sort_field``)
_SORT_ATTRS = {"cid": "cid", "out_msgs": "msgs_out", "in_msgs": "msgs_in", "out_bytes": "bytes_out",
               "in_bytes": "bytes_in", "last_activity": "last_activity", "start": "started", "rtt": "rtt"}


class ConnzView:
    def subjects(self) -> list[str]:
        return sorted({sub.subject for sub in self.subs.values()})

    def sort_field(self, name: str) -> float:
        """A field of ``info`` that /connz sorts by (cluster/monitoring/connz.py), read without building the whole
        dict."""
        if name == "subscriptions":
            return len(self.subs)
        if name == "pending_bytes":
            return self.pending_bytes
        return getattr(self, _SORT_ATTRS[name], 0)

    def info(self) -> dict:
        """This connection in nats-server's /connz shape (plus ``protocol`` and, from the worker, ``worker``)."""
        return {
            "cid": self.cid, "kind": "Client", "type": self.protocol, "protocol": self.protocol,
            "ip": self.peer[0], "port": self.peer[1], "start": self.started,
            "authorized_user": self.user.name if self.user is not None else "",
            "subscriptions": len(self.subs), "pending_bytes": self.pending_bytes,
            "in_msgs": self.msgs_in, "in_bytes": self.bytes_in, "out_msgs": self.msgs_out, "out_bytes": self.bytes_out,
            "out_wire_bytes": self.flushed_total, "last_activity": self.last_activity,
            "name": "", "lang": "", "version": "",
        } | (self._tls_info() if self.tls else {})

    def _tls_info(self) -> dict:
        """nats-server's /connz TLS fields."""
        ssl_object = self.transport.get_extra_info("ssl_object") if self.transport is not None else None
        if ssl_object is None:
            return {}
        cipher = ssl_object.cipher()
        return {"tls_version": (ssl_object.version() or "").replace("TLSv", ""),
                "tls_cipher_suite": cipher[0] if cipher else ""}

"""The broker's one typed configuration object, and its loader.

A Jolt config file (``network``, ``security``) is accepted as is; the other sections are this broker's extensions.
The loader rejects unknown keys, wrong types and out-of-range values with one line naming the key
(``ConfigError``), before anything starts.  CLI flags are applied as dotted-key overrides on the raw document, so a
bad flag is reported exactly like a bad file entry.  See docs/configuration.md for every key.

The rooms: ``sections`` (the dataclasses, one per section), ``schema`` (the walker that reads a document into them,
and ``ConfigError``), ``loader`` (``load``: file, overrides, then the rules that span keys), ``users``, ``tls`` and
``paths`` (the rules about the configured users, TLS and directories), beside the formats the configuration
validates (``passwords``, ``permissions``, ``certnames``) and the protocol registry (``protocols``).  The rest of the
broker imports the names below from here.
"""

from shardbroker.cluster.config.leafnodes import LeafnodesConfig, LeafRemoteConfig, LeafTlsConfig, LeafUrl, parse_url
from shardbroker.cluster.config.loader import document, from_document, load
from shardbroker.cluster.config.schema import ConfigError
from shardbroker.cluster.config.sections import (
                                                 QLITE_MAX_HIDDEN,
                                                 TLS_LISTENERS,
                                                 BridgeConfig,
                                                 Config,
                                                 FabricConfig,
                                                 LimitsConfig,
                                                 ListenerTls,
                                                 ListenerTlsConfig,
                                                 LoggingConfig,
                                                 MonitoringConfig,
                                                 NatsConfig,
                                                 NetworkConfig,
                                                 QliteConfig,
                                                 QueueDefinition,
                                                 QueuesConfig,
                                                 RuntimeConfig,
                                                 SecurityConfig,
                                                 ShutdownConfig,
                                                 TlsConfig,
                                                 TlsSettings,
                                                 UserConfig,
                                                 WorkersConfig,
)
from shardbroker.cluster.config.tls import tls_settings
from shardbroker.cluster.config.users import (
                                                 configured_users,
                                                 has_plaintext_passwords,
                                                 has_qlite_secrets,
                                                 valid_name,
                                                 without_plaintext_passwords,
)

__all__ = [
    "QLITE_MAX_HIDDEN", "TLS_LISTENERS", "BridgeConfig", "Config", "ConfigError", "FabricConfig", "LimitsConfig",
    "LeafRemoteConfig", "LeafTlsConfig", "LeafUrl", "LeafnodesConfig", "parse_url",
    "ListenerTls", "ListenerTlsConfig", "LoggingConfig", "MonitoringConfig", "NatsConfig", "NetworkConfig",
    "QliteConfig", "QueueDefinition", "QueuesConfig", "RuntimeConfig", "SecurityConfig", "ShutdownConfig",
    "TlsConfig", "TlsSettings", "UserConfig", "WorkersConfig", "configured_users", "document", "from_document",
    "has_plaintext_passwords", "has_qlite_secrets", "load", "tls_settings", "valid_name",
    "without_plaintext_passwords",
]

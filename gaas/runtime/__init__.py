"""What every GaaS service shares: server bootstrap, request context, logs, metrics, tracing,
Redis and SQL connections. Services import it; nothing here is copied into a service."""

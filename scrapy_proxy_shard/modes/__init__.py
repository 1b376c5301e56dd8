"""Where the engine runs: Redis connections, the embedded engine, static sharding, the Redis fallback."""

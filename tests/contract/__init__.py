"""Contract tests: every prefix-index backend keeps the same promises (memory, Redis, Cluster)."""

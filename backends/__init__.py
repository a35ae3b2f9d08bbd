"""Everything about inference servers: the simulated engine, the capacity planner and
per-engine knowledge (vLLM / SGLang metric names, KV-event formats)."""

"""Trace formats, synthetic generators and prompt rendering for replay.

``TraceRequest`` is the common in-memory type; ``load_trace`` reads Mooncake, Bailian-style
and OpenAI-body JSONL; ``generators`` builds seeded synthetic workloads; ``prompts`` turns
hash ids back into block-exact prompts.
"""

from loadtest.traces.formats import load_trace, write_mooncake
from loadtest.traces.types import TraceFormatError, TraceRequest

__all__ = ["TraceFormatError", "TraceRequest", "load_trace", "write_mooncake"]

"""Traces, generators, live and offline replay, benchmarks and reports."""

"""Unit tests of pure modules (no sockets, no clocks)."""

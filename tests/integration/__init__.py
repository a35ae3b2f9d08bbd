"""Integration tests: real sockets, real Redis, simulated engines and the router together."""

"""Test support: real services (Redis, simulated engines, routers) started on free ports."""

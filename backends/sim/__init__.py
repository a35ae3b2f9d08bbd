"""The simulated GPU engine: pure engine model (kvcache, engine), its HTTP server and CLI."""

"""kvrouter test suite: unit, contract, integration and end-to-end tests (``make test``)."""

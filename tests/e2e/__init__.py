"""End-to-end tests: the CLI, deploy files and whole topologies as a user runs them."""

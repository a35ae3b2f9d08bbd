"""Prefix index adapters: one async interface (:mod:`router.index.base`), memory and Redis."""

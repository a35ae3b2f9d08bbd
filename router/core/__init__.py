"""Pure routing logic: block hashing, prefix structures, scoring and the scheduler.

Nothing in this package does I/O, reads a clock, or touches asyncio: time and randomness
are passed in, so the live router and the offline simulator run exactly the same code.
"""

"""Parallel modes: each is its maths plus calls into ncclscope.runtime.comm."""

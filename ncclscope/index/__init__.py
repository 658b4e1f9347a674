"""Stage 2, index: the derived views of a Trace, built once and shared by every question.

`views.py` (`Index`) owns them: group membership, collective instances and
their missing members, p2p pairs, rank states, labels, stack excerpts,
per-rank summaries, iterations from repetition, and the wait-for edges and graph.
"""

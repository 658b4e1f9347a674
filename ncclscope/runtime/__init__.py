"""ncclscope.runtime: the instrumented training runtime (imports torch).

Trains a small GPT with TP, DP (+ZeRO), PP, CP and EP on one mesh. Every
collective and point-to-point op goes through `comm.py`, which times it out and
writes begin/end rows to the per-rank trace that the analyzer reads.
"""

"""Stage 3a, the hang and mismatch questions: each reads the index and returns typed findings.

`verdict/diagnose.py` asks them and decides which finding explains which.
"""

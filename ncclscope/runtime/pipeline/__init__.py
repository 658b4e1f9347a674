"""Pipeline-parallel schedules and a dry-run simulator, as pure logic.

Why this exists: when a pipeline-parallel job hangs, the first question is
"which rank is waiting on which send/recv, and is that even legal for the
schedule?".  Answering it needs the *intended* per-rank action order
(GPipe, 1F1B, interleaved 1F1B) and a way to replay an order without GPUs or
processes to see whether it can deadlock and what its bubble should be.
Nothing in this package imports torch or starts processes.
"""

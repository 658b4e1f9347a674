"""Stage 1, load: whatever is on disk becomes one `Trace` (`load/trace.py`).

Run directories (`trace.py` with `ipc_read.py`, `columns.py`, `opsjoin.py`,
`groupviews.py`, `fr_merge.py`), foreign formats (`foreign/`: Flight Recorder
dumps, profiler traces), every file through the guarded reader `safe_io.py`,
and the process heap policy (`heap.py`). Every unreadable piece is a warning
line on the Trace, never a crash.
"""

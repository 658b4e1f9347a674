"""Reading large inputs on many processes: a Dask cluster (local worker processes or one someone started),
stage 1 of docs/scale.md's plan (per rank: read and turn into columns) for run directories and Flight Recorder
dumps, merged in the driver into the Trace one process would build; for an analysis of a run directory the
begin/end join and the utilization's per-rank half too (ops_chunks.py), so the driver holds no event rows.

    from ncclscope.engine.cluster import open_engine
    from ncclscope.load.foreign import load_any
    with open_engine(workers=2) as engine:
        trace = load_any("runs/big", engine=engine)      # the same Trace as load_any("runs/big")
        trace = load_any("runs/big", engine=engine, ops_only=True)   # ops and marks, no event rows
"""

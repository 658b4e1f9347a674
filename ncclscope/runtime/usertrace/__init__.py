"""The tracer for a user's own job (`ncclscope run`), the torch half of it.

    bootstrap.py  the per-rank entry: warm imports, recorder, telemetry, tracer,
                  then the script via runpy as `__main__` with its own argv
    launcher.py   `ncclscope run --nproc N`: torch's elastic launch API
                  (torchrun's own machinery), then run.json with exit codes
    tracer.py     the Tracer: install / uninstall / close, assembled from
      opspec.py     what each wrapped torch.distributed call is (plain data)
      ops.py        the begin/end wrappers (the hot path), Work.wait
      callsite.py   the user's file:line, cached
      group_calls.py groups as data: init_process_group, new_group, device meshes
      steps.py      steps from optimizer hooks, ncclscope.step() / annotate()
      nancheck.py   the first non-finite input of a reduction / DDP gradient: a marker
      evidence.py   watch thread, poller, Flight Recorder snapshots, SIGTERM
      gpu.py        NCCL: the end row at GPU completion (CUDA events)
      clock.py      clock offset to rank 0 through the job's c10d store

Imports only point down this list (tracer -> facets -> opspec/callsite), no
cycles. It lives in the runtime because it imports torch; the torch-free
parts stay in the analyzer: the `ncclscope.step()` / `annotate()` API in
`ncclscope/__init__.py` and the loader's Flight Recorder merge in
`ncclscope/load/fr_merge.py`.
"""

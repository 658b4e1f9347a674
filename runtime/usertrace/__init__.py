"""The tracer for a user's own job (`ncclscope run`), the torch half of it.

    bootstrap.py  the per-rank entry: recorder, telemetry, tracer, then the
                  script via runpy as `__main__` with its own argv
    tracer.py     wraps the public torch.distributed API (begin/end rows in the
                  schema `ncclscope train` writes), records process groups,
                  steps from optimizer hooks, dumps Flight Recorder + stacks
    launcher.py   `ncclscope run --nproc N`: torch's elastic launch API
                  (torchrun's own machinery), then run.json with exit codes

It lives in the runtime because it imports torch; the torch-free parts (the
`ncclscope.step()` / `annotate()` API and the loader's Flight Recorder merge)
stay in `ncclscope/usertrace/`, which the analyzer may import.
"""

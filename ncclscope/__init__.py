"""ncclscope: a debugger and trace analyzer for distributed training.

This package is the analyzer and the CLI. It never imports torch, so a run
directory copied off a cluster can be opened on any laptop. The instrumented
training runtime lives in `ncclscope.runtime` (source folder `runtime/`).
"""
__version__ = "0.1.0"

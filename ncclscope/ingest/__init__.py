"""Readers for traces other tools wrote (Flight Recorder dumps, profiler traces)."""

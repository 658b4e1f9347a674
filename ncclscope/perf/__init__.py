"""Stage 3b, the performance questions: bubbles, stragglers, bandwidth, utilization,
divergence, memory and MoE; `performance.py` runs them all under the verdict's error guard."""

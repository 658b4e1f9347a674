"""Random SPMD torch.distributed programs with known ground truth: the accuracy yardstick for verdicts
on programs nobody here wrote. Entry point: benchmarks/random_programs.py.

    catalogue.py  bug classes and the headline kinds a right verdict may have
    generator.py  seed -> (plain torch.distributed script, ground truth)
    runner.py     run one program under `ncclscope run` with a hard deadline; extract the FR dumps
    scorer.py     judge an `ncclscope analyze --json` report against the ground truth
"""

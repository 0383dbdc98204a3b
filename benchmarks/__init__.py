"""Side-by-side benchmarks for `spotfill bench` (see run.py); each module is also a runnable script.

    python benchmarks/run.py --quick --json bench.json     # what `spotfill bench --quick` runs
    python benchmarks/checkpoint.py --preset 50m            # one section alone
"""

"""Course tooling: what the notebooks and benchmarks use to measure, explain and exercise the engine."""

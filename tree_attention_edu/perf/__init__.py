"""What things cost: reading the compiled program (`introspect`), the closed-form cost model
(`costmodel`, the facade of `formulas`, `links`, `patterns`, `predict`, `paper` and
`crossover`, whose arguments `checks` checks), measurements of this machine (`microbench`,
`calibrate`) and side-by-side benchmarks (`benchmark`, the one registry of measured
methods). Uses `core`."""

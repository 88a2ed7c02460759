"""What things cost: reading the compiled program (`introspect`), the closed-form cost model
(`costmodel`), measurements of this machine (`calibrate`) and side-by-side benchmarks
(`benchmark`, the one registry of measured methods). Uses `core`."""

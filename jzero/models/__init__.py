"""Reference models used by the CLI, the tests and the benchmarks."""

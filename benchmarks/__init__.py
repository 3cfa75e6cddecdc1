"""Benchmarks: each module has main(argv) -> int and a --quick mode."""

"""Benchmarks that print figures and write JSON under bench/results/."""

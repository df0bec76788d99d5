"""Benchmark harness: load generator, peer comparison, machine limits (`axonserve bench ...`)."""

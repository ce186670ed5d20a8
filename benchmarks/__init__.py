"""Benchmarks: memory and speed of tfmem against stock TensorFlow (run as `python -m benchmarks.<name>`)."""

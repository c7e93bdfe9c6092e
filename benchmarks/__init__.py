"""Side-by-side benchmarks of ds4-vllm, run from the repository root as `python -m benchmarks.<name>`."""

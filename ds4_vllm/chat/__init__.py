"""ds4-exact prompt rendering and tokenization, without vLLM (shared/specs/kvc-format.md §8-§9)."""

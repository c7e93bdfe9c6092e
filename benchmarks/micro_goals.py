"""The microbenchmarks' goals (issue 11), shared by the measurement and its tables."""

#: Issue 11's goal for (c): a restore after a restart at least this much faster than cold...
MIN_RESTART_SPEEDUP = 20.0
#: ...and within this factor of reading the file sequentially plus prefilling the suffix.
MAX_OVER_BOUND = 1.5

"""The prefill-vs-decode logprob KL check: its three helpers, thresholds, verdict and rendering,
and `localize`, which turns a dirty KL result into a first-divergence run."""

"""Workloads, mode-neutral: trace loaders (the project's JSONL, Azure CSV, Mooncake JSONL, length-only CSVs),
synthetic arrivals and prompts, and prefix reuse. The simulator, real-mode replay, the bench client and the
dashboard read requests through here."""

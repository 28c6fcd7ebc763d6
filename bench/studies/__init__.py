"""One-off investigations, each with its finding in README.md beside it; the benchmarks a user runs are bench/."""

"""Benchmarks: acceptance, decode speed, chat/tool behaviour. JSONL results in bench/results/."""

"""Probes of a trained model's behaviour under named, synthetic conditions: where its misses
come from, not how often it misses on a corpus (tools/bench/ measures that)."""

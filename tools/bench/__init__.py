"""Benchmarks of the model and its detector: each module measures one speed or quality
goal and prints its figures (`python -m wakefl.tools.bench.<name>`); tests never
assert timings. The fleet's and server's benchmarks are in tools/fleet/."""

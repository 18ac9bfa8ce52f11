"""Offline study code: routing traces, their analysis, benchmarks, exactness checks, quality costs.

Nothing in the runtime imports this package; it imports the runtime (and the model builders) to measure it.
"""

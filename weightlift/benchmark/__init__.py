"""The benchmark harness behind ``weightlift bench`` and ``bench/*.py``: fresh process per run, arms
interleaved, medians and spread. Nothing in the library imports it."""

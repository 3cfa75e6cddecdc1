"""Shared pytest set-up: every test has a timeout (setup.cfg), and hypothesis
runs without a deadline since two busy cores make per-example timing noisy."""

from hypothesis import settings

settings.register_profile("ncclkv", deadline=None, print_blob=True)
settings.load_profile("ncclkv")


pytest_plugins = ["strict_skips", "thread_leaks", "gpu_select"]  # a skipped test fails the run (tests/strict_skips.py); so does a link thread that outlives its test (tests/thread_leaks.py); GPU tests run where torch sees the GPUs they need (tests/gpu_select.py)

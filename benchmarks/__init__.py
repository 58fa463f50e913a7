"""qkv's benchmarks: ``python -m benchmarks.run --help`` (``load_test.py`` is the HTTP server's load test)."""

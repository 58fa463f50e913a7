"""The ``qkv`` command line (top): one module per family of commands over the library's functions."""

"""The HTTP server: the app, its request API and the dynamic batcher."""

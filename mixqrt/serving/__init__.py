"""The OpenAI layer: request parsing and reply shapes (protocol), the llama-cpp-python-shaped Python API (api) and the HTTP server (server; the `serve` extra)."""

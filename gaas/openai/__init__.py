"""The HTTP surface of vLLM's OpenAI-compatible server: request bodies in, answers out."""

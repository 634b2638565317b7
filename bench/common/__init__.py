"""What every benchmark shares: its progress lines and result files (output), its percentiles (stats),
the mesh it runs against (mesh) and vLLM's own server beside it for comparison (vllm)."""

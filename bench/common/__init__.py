"""What every benchmark shares: its progress lines and result files (output), its percentiles (stats) and
the mesh it runs against (mesh)."""

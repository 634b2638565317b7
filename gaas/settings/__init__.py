"""What a service is configured with: its GAAS_* environment and the deployment file."""

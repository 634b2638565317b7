"""The mesh on Kubernetes: manifests rendered from the one topology (render.py, manifests.py, pods.py), their secrets, their validation (validate.py, rules.py)."""

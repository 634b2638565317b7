"""What a service is configured with: its GAAS_* environment and the deployment file.

- env.py: how a setting is declared (setting()), read (from_env, errors naming the variable) and
  written back (to_env, env_of: what `gaas up` hands a service's process).
- common.py: the settings every service has; control.py, kvcache.py, billing.py, worker.py,
  router.py: each service's one settings class (services.py: by service name).
- docs.py: the table of docs/configuration.md and each service's --help, from the declarations.
- deployspec.py: the deployment file (deploy/gaas.yaml).
"""

"""The `gaas` command: one module per command group, each adding its commands to the parser
(register) beside what runs them; main.py is the entry point and lists them in order.

  main        the parser, the order of the commands, main() (pyproject: gaas = gaas.cli.main:main)
  common      what the commands share: finding the running mesh, its ingress and control, the options
  up          gaas up: start the mesh, keep it running                 (gaas.launcher.mesh)
  trace       gaas trace: a request's spans as a waterfall             (gaas.ops.traces)
  generate    gaas generate: stream a generation through the ingress
  sessions    gaas session list|show|delete
  status      gaas status: health of every instance, Envoy and worker  (gaas.ops.probe)
  top         gaas top: the live view
  restart     gaas restart: rolling restarts                           (gaas.launcher.supervisor)
  models      gaas models: what the mesh serves
  tenants     gaas tenant ..., gaas key ...: tenants and API keys       (control)
  billing     gaas usage, gaas budget ..., gaas invoice preview          (billing)
  kv          gaas kv stats, gaas kv public ...                        (kvcache, control)
  model       gaas model build                                         (gaas.model.build)
  envoy       gaas envoy render                                        (gaas.envoy.config)
  router_settings  the router's settings the CLI shows (from gaas/settings/router.py)
"""

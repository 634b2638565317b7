"""The SITS2026 scorecard (seed 003's six dimensions), measured on a live mesh: `gaas bench sits`
(python -m bench.sits). Each dimension is a module with a workload built for it (routing, kvshare,
batching, fragmentation, switching, hetero); target.py is the mesh they run against (the
scorecard's own, or a running one: --target RUN_DIR); card.py the matrix's shape and the seed's
three columns; report.py the table, the JSON, the PNG chart and the HTML page."""

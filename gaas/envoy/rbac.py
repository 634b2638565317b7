"""The RBAC filter of a sidecar's inbound listener, from the mesh's one access table
(gaas/ops/access.py): each caller identity may call exactly the methods the table gives its kind."""

from __future__ import annotations

from gaas.contracts import identity
from gaas.ops import access


def rbac(kind: str, direct: bool = False) -> dict:
    """Envoy's RBAC filter for kind's inbound listener: one policy per caller kind, naming exactly
    the methods it may call; health checks from any identity of the mesh; nothing else.
    direct: the ingress sends generations to the workers itself (ingress.path: direct)."""
    by_caller: dict[str, list[str]] = {}
    for path, callers in access.method_paths(kind, direct).items():
        for caller in callers:
            by_caller.setdefault(caller, []).append(path)

    def permission(path: str) -> dict:
        matcher = {"prefix": path} if path.endswith("/") else {"exact": path}
        return {"url_path": {"path": matcher}}

    def principal(prefix: str) -> dict:
        return {"authenticated": {"principal_name": {"prefix": prefix}}}

    policies = {
        f"{caller}-calls": {
            "permissions": [permission(p) for p in sorted(paths)],
            "principals": [principal(identity.kind_prefix(caller))],
        }
        for caller, paths in sorted(by_caller.items())
    }
    policies["mesh-health"] = {
        "permissions": [permission("/grpc.health.v1.Health/")],
        "principals": [principal(identity.MESH_PREFIX)],
    }
    return {
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
            "rules": {"action": "ALLOW", "policies": policies},
        },
    }

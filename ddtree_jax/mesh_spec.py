"""The `--mesh` spec string, parsed without importing jax (so the CLI rejects a bad one before any loading)."""

from __future__ import annotations

from ddtree_jax.errors import UserError

MESH_AXES = ("data", "expert", "tensor")


class MeshSpecError(UserError, ValueError):
    """A malformed `--mesh` spec or one that does not match the devices; the message is one line."""


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """ "expert=4,tensor=2" -> {"data": 1, "expert": 4, "tensor": 2} (unnamed axes have size 1)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for part in spec.split(","):
        name, eq, value = (p.strip() for p in part.partition("="))
        if not eq or name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise MeshSpecError(
                f"--mesh {spec!r}: expected comma-separated axis=size with axes {', '.join(MESH_AXES)} "
                f"and sizes >= 1, got {part.strip()!r}"
            )
        if name in seen:
            raise MeshSpecError(f"--mesh {spec!r}: axis {name!r} given twice")
        seen.add(name)
        sizes[name] = int(value)
    return sizes

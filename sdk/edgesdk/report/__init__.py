"""Reports built from stage records and manifests (never recomputed)."""

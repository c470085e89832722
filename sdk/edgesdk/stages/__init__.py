"""The six pipeline stages. Each is `run(artifact, ctx) -> record`; none imports another."""

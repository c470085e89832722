"""Device models: op-support tables and cost formulas, as data."""

"""Graph rewrite rules shared by import and legalize (the graph-optimization issue fills this)."""

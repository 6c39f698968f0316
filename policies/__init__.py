"""Per-specialist speculation policies and the runtime gate."""

"""Small utilities shared by the wrappers (memory accounting)."""

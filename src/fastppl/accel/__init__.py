"""Performance features applied around a built model or a hot function."""

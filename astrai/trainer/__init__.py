"""astrai."""

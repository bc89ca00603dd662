"""The ssd tier."""

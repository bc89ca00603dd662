"""The object tier."""

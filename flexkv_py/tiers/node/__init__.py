"""The node tier."""

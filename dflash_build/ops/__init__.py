"""The store commands behind the CLI: plan, explain, gc, verify (operate) and status."""

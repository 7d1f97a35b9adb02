"""The store commands behind the CLI, one module each: estimate (plan), explain, gc (with the
registrations of configs sharing a store), verify, status."""

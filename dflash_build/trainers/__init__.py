"""Drafter trainers the build's train stage runs, each in an environment of its own."""

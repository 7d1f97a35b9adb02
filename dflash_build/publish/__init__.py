"""What a build hands over in dist/: dataset folders swapped whole (release) and their card (report)."""

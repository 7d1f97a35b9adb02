"""The store: atomic writes, the journal, the row index, record schemas, and its layout."""

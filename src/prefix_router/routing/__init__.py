"""The pure routing core: bytes, ids and counts in, decisions out. No I/O, no frameworks."""

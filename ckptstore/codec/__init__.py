"""Codecs: the state tree <-> tensors + typed JSON, and the payload file formats."""

"""Model loading, tiny test models and the tree-capable KV-cache runner."""

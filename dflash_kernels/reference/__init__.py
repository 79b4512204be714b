"""PyTorch reference implementations: plain, obviously right; the oracle for every kernel (and the "torch" backend)."""

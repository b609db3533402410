"""The backends: one object per strategy, owning the resource it runs on (a flashinfer workspace,
a symmetric buffer, nothing for NCCL and the torch reference)."""

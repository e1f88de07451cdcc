"""``gpufleet diag``: what a node kept when something failed, and what it says (the failure-signature catalog)."""

"""The systemd units gpufleet writes: values escaped into them, and how exposed their services may be."""

"""A node's GPUs: the document the NVML probe prints, declared hardware profiles, NVLink topology, and the
probe run on live hosts."""

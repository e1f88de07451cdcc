"""gpufleet: vLLM serving fleets on bare-metal NVIDIA GPU servers, built with pyinfra."""

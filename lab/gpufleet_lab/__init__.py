"""The lab: a local fleet of systemd-nspawn nodes with lab doubles for the hardware and NVIDIA repository it lacks."""

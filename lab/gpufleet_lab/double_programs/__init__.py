"""Programs the lab-double .debs install in place of NVIDIA's: small stdlib (+ pynvml) Python scripts.

Each file here is copied into a package by :mod:`gpufleet_lab.standin_debs` and runs on lab nodes with the
node's ``/usr/bin/python3``; none of them is imported by the toolkit itself.
"""

"""``gpufleet bench``: a model's serving ceiling measured with a real LLM benchmark client, kept as a record per
model x release x layout x GPU profile on the monitoring hosts, and read back by the alerts, the plan and the
rollouts."""

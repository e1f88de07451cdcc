"""What gpufleet hands Prometheus and Grafana: scrape jobs, alert rules, the plan as recording rules, dashboards."""

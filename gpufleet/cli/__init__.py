"""The ``gpufleet`` command (:mod:`gpufleet.cli.main`) and its subcommands, one module per group of them."""

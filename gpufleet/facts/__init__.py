"""gpufleet's pyinfra facts: what a node reports about itself, each read with one remote command.

One module per domain, paired as pyinfra pairs them with ``gpufleet/operations/<domain>.py``. Each fact documents
its arguments and an example of what it returns, as pyinfra's own facts do; tests as data live in
``tests/data/facts/<Fact>/*.json`` (arguments, the command, the node's output, the parsed value).
"""

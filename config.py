"""pyinfra's configuration file, executed by pyinfra before it reads the inventory.

gpufleet uses it for one thing: an inventory file that fails to compile or run is reported in one line,
``file:line: Error: message``, with exit status 2, the way every other bad input is.
"""

from gpufleet.inventory.load import report_inventory_errors

report_inventory_errors()

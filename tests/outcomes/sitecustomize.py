"""Run at the start of every Python process whose path holds this folder (the mutation runner
puts it there): the exception that ends the process goes to the failure log (failures.py)."""

import failures

failures.install_excepthook()

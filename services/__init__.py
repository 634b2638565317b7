"""The mesh's services, one package each (`python -m services.NAME.server`).

Like gaas/__init__.py, lets Python write the bytecode of what a service imports.
"""

import sys

sys.dont_write_bytecode = False

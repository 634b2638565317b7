"""GaaS: the CLI, the launcher and what the services share.

Importing it lets Python write the bytecode of what it imports next, even where
PYTHONDONTWRITEBYTECODE is set: the install compiles none (scripts/install.sh), and otherwise every
process would compile torch and vLLM again at each start (seconds of a worker's).
"""

import sys

sys.dont_write_bytecode = False
